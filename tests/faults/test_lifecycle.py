"""The supervisor's lifecycle through the real CLI: SIGTERM to `mshpc train --nproc 2` stops the
run after a checkpoint with `run_end` and a last line; kill -9 of it leaves no rank behind; a rank
whose supervisor is gone stops itself; a failing rerun in the same folder names its root cause and
counts no earlier run's steps as its own."""

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from support.cli_runner import REPO, read_metrics, train_args
from support.fault_runs import SUPERVISED, events, one

LONG = ["train.steps=100000", "checkpoint.interval_steps=100000"]  # runs until told otherwise; no save on its own
STEPS_BEFORE_SIGNAL = 2
GONE_WITHIN_S = 5.0  # ranks of a supervisor killed with -9


def start(tmp_path: Path, cache: Path, name: str, *overrides: str, nproc: int = 2,
          env: dict[str, str] | None = None) -> tuple[subprocess.Popen, Path]:
    """`mshpc train` in the background, its stdout and stderr to files; returns it and its stderr file."""
    full_env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "PMI", "OMPI_"))}
    full_env.update(env or {})
    err = tmp_path / f"{name}.stderr"
    with open(tmp_path / f"{name}.stdout", "w") as out_f, open(err, "w") as err_f:
        proc = subprocess.Popen([sys.executable, "-m", "mshpc", *train_args(tmp_path, cache, *overrides, name=name),
                                 "--nproc", str(nproc)], stdout=out_f, stderr=err_f, env=full_env, cwd=REPO)
    return proc, err


def wait_for_steps(proc: subprocess.Popen, run_dir: Path, steps: int, timeout_s: float = 240) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"the run ended early with {proc.returncode}"
        if (run_dir / "metrics.jsonl").exists() and len(read_metrics(run_dir)) >= steps:
            return
        time.sleep(0.1)
    raise AssertionError(f"no {steps} steps within {timeout_s} s")


def alive(pid: int) -> bool:
    """Running (a zombie, only waiting to be reaped, is not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def processes_of(marker: str) -> set[int]:
    """Every live process whose command line holds `marker` (the run's folder: one per test)."""
    found = set()
    for d in Path("/proc").iterdir():
        try:
            if d.name.isdigit() and marker.encode() in (d / "cmdline").read_bytes() and alive(int(d.name)):
                found.add(int(d.name))
        except OSError:
            continue
    return found


def survivors(pids: set[int], within_s: float) -> set[int]:
    deadline = time.monotonic() + within_s
    while (left := {p for p in pids if alive(p)}) and time.monotonic() < deadline:
        time.sleep(0.05)
    for p in left:  # never leave them to the rest of the suite
        os.kill(p, signal.SIGKILL)
    return left


def last_line(path: Path) -> str:
    return path.read_text().strip().splitlines()[-1]


@pytest.fixture(scope="module")
def stopped(tmp_path_factory, corpus_cache):
    """A supervised run told SIGTERM after a few steps: what it left, and how it ended."""
    tmp = tmp_path_factory.mktemp("sigterm")
    proc, err = start(tmp, corpus_cache, "s", *SUPERVISED, *LONG)
    try:
        wait_for_steps(proc, tmp / "s", STEPS_BEFORE_SIGNAL)
        ranks = processes_of(f"run.out_dir={tmp}\0") - {proc.pid}
        sent = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=120)
    finally:
        proc.kill()
    return {"dir": tmp / "s", "tmp": tmp, "code": code, "stop_s": time.monotonic() - sent, "ranks": ranks,
            "last": last_line(err), "events": events(tmp / "s"), "left": survivors(ranks, 1.0)}


def test_sigterm_stops_the_ranks_after_a_checkpoint_and_ends_the_run(stopped):
    assert len(stopped["ranks"]) == 3, stopped["ranks"]  # two ranks and the fork server that forked them
    assert stopped["left"] == set(), "ranks outlived their supervisor"
    assert stopped["code"] == 128 + signal.SIGTERM, stopped["last"]
    evs = stopped["events"]
    assert one(evs, "stop_requested")["how"] == "a checkpoint at the next step"
    end = one(evs, "run_end")
    assert (end["outcome"], end["exit_code"], end["failures"]) == ("stopped", 143, 0)
    last_step = read_metrics(stopped["dir"])[-1]["step"]  # the ranks saved the step they stopped at
    assert (stopped["dir"] / "checkpoints" / f"step-{last_step:07d}" / "manifest.json").is_file()
    assert stopped["last"] == (f"mshpc: stopped by SIGTERM; latest checkpoint: step {last_step} "
                               "(the same command resumes from it)")
    print(f"SIGTERM to exit: {stopped['stop_s']:.1f} s")


def test_ctrl_c_stops_the_ranks_after_a_checkpoint_as_sigterm_does(tmp_path, corpus_cache):
    """Ctrl-C in the terminal of `mshpc train --nproc 2` (SIGINT to the supervisor; its ranks run in
    a session of their own): a checkpoint at the next step, exit 130 and the same last line."""
    proc, err = start(tmp_path, corpus_cache, "c", *SUPERVISED, *LONG)
    try:
        wait_for_steps(proc, tmp_path / "c", STEPS_BEFORE_SIGNAL)
        proc.send_signal(signal.SIGINT)
        code = proc.wait(timeout=120)
    finally:
        proc.kill()
    last_step = read_metrics(tmp_path / "c")[-1]["step"]
    assert code == 128 + signal.SIGINT, err.read_text()[-3000:]
    assert (tmp_path / "c" / "checkpoints" / f"step-{last_step:07d}" / "manifest.json").is_file()
    assert last_line(err) == (f"mshpc: stopped by SIGINT; latest checkpoint: step {last_step} "
                              "(the same command resumes from it)")
    assert one(events(tmp_path / "c"), "stop_requested")["signal"] == "SIGINT"


@pytest.fixture(scope="module")
def failed_rerun(stopped, corpus_cache):
    """The same run again, with a data.path that does not exist: rank 0 fails with the DataError,
    rank 1 with its echo ("preparing the dataset failed on 1 other rank(s)"), both before a step."""
    tmp = stopped["tmp"]
    proc, err = start(tmp, corpus_cache, "s", *SUPERVISED, *LONG, f"data.path={tmp / 'no-such-data'}")
    code = proc.wait(timeout=300)
    return {"code": code, "last": last_line(err), "run_end": [e for e in events(tmp / "s") if e["kind"] == "run_end"][-1]}


def test_a_failing_rerun_names_the_root_cause(failed_rerun, stopped):
    assert failed_rerun["code"] == 2
    assert failed_rerun["last"].startswith("mshpc: rank 0 exited with code 2: DataError: data.path="), failed_rerun["last"]


def test_a_rerun_that_trains_no_step_counts_no_earlier_steps(failed_rerun):
    end = failed_rerun["run_end"]
    assert end["outcome"] == "failed"
    assert end["useful_s"] == 0 and end["effective_time_ratio"] == 0, end  # the first run's steps are not its own


def test_kill_9_of_the_supervisor_leaves_no_rank(tmp_path, corpus_cache):
    proc, _ = start(tmp_path, corpus_cache, "k", *SUPERVISED, *LONG)
    try:
        wait_for_steps(proc, tmp_path / "k", 1)
        ranks = processes_of(f"run.out_dir={tmp_path}\0") - {proc.pid}
        assert len(ranks) == 3, ranks  # two ranks and the fork server that forked them
    finally:
        proc.kill()
        proc.wait()
    killed = time.monotonic()
    assert survivors(ranks, GONE_WITHIN_S) == set(), f"ranks trained on for {GONE_WITHIN_S} s after kill -9 of their supervisor"
    print(f"kill -9 of the supervisor to no rank left: {time.monotonic() - killed:.2f} s")


def test_a_rank_whose_supervisor_is_gone_stops_after_a_checkpoint(tmp_path, corpus_cache):
    # one rank (no launcher of ours, so no parent-death signal) reporting to a stand-in supervisor
    server = socket.create_server(("127.0.0.1", 0))
    env = {"MSHPC_SUPERVISOR": f"127.0.0.1:{server.getsockname()[1]}", "MSHPC_SUPERVISOR_TOKEN": "tok"}
    proc, err = start(tmp_path, corpus_cache, "o", *LONG, nproc=1, env=env)
    try:
        server.settimeout(240)
        conn, _ = server.accept()
        wait_for_steps(proc, tmp_path / "o", STEPS_BEFORE_SIGNAL)
        gone = time.monotonic()
        conn.close()  # as a supervisor killed with -9 leaves it
        server.close()
        code = proc.wait(timeout=60)
        took = time.monotonic() - gone
    finally:
        proc.kill()
    text = err.read_text()
    assert code == 128 + signal.SIGTERM, text[-2000:]
    assert took < 10, f"the rank took {took:.1f} s to stop"
    print(f"supervisor connection closed to rank exit: {took:.1f} s")
    assert "is gone (its heartbeat connection closed): stopping after a checkpoint" in text
    assert "Traceback" not in text
    assert last_line(err) == "mshpc: stopping after a checkpoint (SIGHUP signal)"
    last_step = read_metrics(tmp_path / "o")[-1]["step"]
    assert (tmp_path / "o" / "checkpoints" / f"step-{last_step:07d}" / "manifest.json").is_file()
