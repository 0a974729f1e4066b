"""Shared by tests/faults: a small supervised run through the real CLI, and what its events say."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from support.ckpt_runs import final_params
from support.cli_runner import REPO, mshpc, read_metrics, train_args

STEPS = 8
HEARTBEAT_S = 0.2
CRASH_TIMEOUT_S = 60.0  # no phase of these runs times out, no rank freezes: only the hang tests use a short one
# checkpoints every 2 steps, so every fault has one to fall back to; short heartbeats and grace
SUPERVISED = [f"train.steps={STEPS}", "checkpoint.interval_steps=2", "checkpoint.keep=4",
              f"supervisor.heartbeat_interval_s={HEARTBEAT_S}", f"supervisor.timeout_floor_s={CRASH_TIMEOUT_S}",
              f"supervisor.heartbeat_timeout_s={CRASH_TIMEOUT_S}",
              "supervisor.stop_grace_s=2", "supervisor.setup_timeout_s=240", "supervisor.max_restarts=2"]


def supervised(tmp_path: Path, cache: Path, name: str, *overrides: str, faults: str | None = None, nproc: int = 2):
    out = mshpc(*train_args(tmp_path, cache, *SUPERVISED, *overrides, name=name), "--nproc", str(nproc),
                env={"MSHPC_TEST_FAULTS": faults} if faults else None, timeout_s=600)
    return out


def start_supervised(tmp_path: Path, cache: Path, name: str, *overrides: str) -> subprocess.Popen:
    """`supervised`, started in the background; its output goes to tmp_path/`name`.log (a pipe
    nobody reads while the test waits could fill and stall it)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "PMI", "OMPI_"))}
    args = train_args(tmp_path, cache, *SUPERVISED, *overrides, name=name)
    with open(tmp_path / f"{name}.log", "w") as log:
        return subprocess.Popen([sys.executable, "-m", "mshpc", *args, "--nproc", "2"], cwd=REPO, env=env,
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def wait_for_step(proc: subprocess.Popen, run_dir: Path, timeout_s: float = 240.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not ((run_dir / "metrics.jsonl").exists() and read_metrics(run_dir)):
        assert proc.poll() is None, f"the run ended (code {proc.returncode}) before its first step"
        assert time.monotonic() < deadline, "no step logged"
        time.sleep(0.05)


def events(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]


def kinds(evs: list[dict]) -> list[str]:
    return [e["kind"] for e in evs]


def one(evs: list[dict], kind: str) -> dict:
    found = [e for e in evs if e["kind"] == kind]
    assert len(found) == 1, f"expected one {kind} event, got {kinds(evs)}"
    return found[0]


def assert_recovered_exactly(run_dir: Path, reference) -> None:
    """Finished at the target step, every step once, with bitwise the reference's parameters."""
    want, want_losses = reference
    got = final_params(run_dir / "checkpoints")
    assert want.keys() == got.keys() and len(want) > 0
    for name in want:
        assert (want[name] == got[name]).all(), f"{name} differs from the undisturbed run"
    records = read_metrics(run_dir)
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    assert [r["loss"] for r in records] == want_losses


def assert_story(run_dir: Path, fault: str, failure: str, rank: int | None) -> list[dict]:
    # rank None: any rank may be the first to report (a NaN loss is the same on every rank)
    """events.jsonl tells it in order: injected, detected (within the timeout), stopped,
    classified, restarted, resumed from a checkpoint, recovered, finished with one failure."""
    evs = events(run_dir)
    story = ["fault_injected", "failure_detected", "ranks_stopped", "classified", "restart",
             "attempt_start", "resumed", "recovered", "run_end"]
    seen = iter(kinds(evs))
    assert all(k in seen for k in story), f"events out of order: {kinds(evs)}"
    injected, detected = one(evs, "fault_injected"), one(evs, "failure_detected")
    assert injected["fault"] == fault
    assert detected["failure"] == failure and rank in (None, detected["rank"]), detected
    timeout = detected["timeout_s"] or CRASH_TIMEOUT_S
    # detected within the configured timeout (+ one heartbeat and the supervisor's poll)
    assert detected["time"] - injected["time"] <= timeout + 2 * HEARTBEAT_S + 1.0, (injected, detected)
    end = one(evs, "run_end")
    assert (end["outcome"], end["failures"], end["exit_code"]) == ("finished", 1, 0)
    assert len(end["time_to_recover_s"]) == 1 and 0 < end["effective_time_ratio"] < 1
    resumed = [e for e in evs if e["kind"] == "resumed"][-1]
    assert resumed["from_step"] <= injected["step"]  # a checkpoint taken before the fault
    return evs
