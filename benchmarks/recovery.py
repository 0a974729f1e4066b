"""Robust training: time to detect and to recover from a crash (kill -9) and a hang (SIGSTOP),
and the heartbeat's cost on step time, measured side by side in one run. JSON lines.

    .venv/bin/python benchmarks/recovery.py [--steps 40] [--rounds 2]

Detect: from the fault's own `fault_injected` event to the supervisor's `failure_detected`
(baseline: the timeout that would end the run without the supervisor, the process group's 600 s,
for a hang; the hang timeout configured, for a crash). Recover: from detection to the first step
trained after the restart (baseline: the run's start-up, from launch to its first step).
Overhead: median step time of 2 ranks with heartbeats (default 1 s, and 0.1 s) over the same
ranks without a supervisor (no heartbeat thread), rounds interleaved, the order rotating.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from mshpc.bench import harness
from mshpc.bench.harness import REPO
from mshpc.events import read_events
from mshpc.run_dir import read_metrics

SMALL = ["model.n_layer=2", "model.d_model=128", "model.n_head=2", "model.seq_len=64", "optim.warmup_steps=2",
         "run.progress=none", "train.cpu_threads=1", "train.micro_batch=8"]
HANG_TIMEOUT_S = 10.0
PG_TIMEOUT_S = 600.0  # mshpc.launch.rendezvous.init_distributed's default: what ends a hang without us


def train(out: Path, cache: Path, name: str, *sets: str, faults: str | None = None, supervised: bool = True) -> Path:
    args = [*SMALL, f"run.out_dir={out}", f"run.name={name}", f"data.cache_dir={cache}", *sets]
    argv = ["train", str(REPO / "configs/tiny.yaml"), *[a for s in args for a in ("--set", s)]]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "MSHPC_"))}
    if faults:
        env["MSHPC_TEST_FAULTS"] = faults
    if supervised:
        cmd = [sys.executable, "-m", "mshpc", *argv, "--nproc", "2"]
    else:  # the same ranks through the plain local launcher: no supervisor, no heartbeat thread
        cmd = [sys.executable, "-c", "import sys; from mshpc.launch.local import launch_local; "
               "sys.exit(launch_local(sys.argv[1:], 2) is not None)", *argv]
    subprocess.run(cmd, check=True, env=env, cwd=REPO, capture_output=True, timeout=1800)
    return out / name


def step_times(run: Path) -> list[float]:
    return [r["step_time_s"] for r in read_metrics(run / "metrics.jsonl")[3:]]  # past warm-up


def emit(metric: str, value: float, unit: str, baseline: float, **extra: object) -> None:
    harness.emit(harness.record("recovery", metric, value, unit, baseline, digits=6, **extra,
                                load_avg=harness.load_average()))


def fault_run(out: Path, cache: Path, fault: str, steps: int) -> None:
    sets = [f"train.steps={steps}", f"checkpoint.interval_steps={steps // 4}", "supervisor.heartbeat_interval_s=0.5",
            f"supervisor.timeout_floor_s={HANG_TIMEOUT_S}", "supervisor.stop_grace_s=2"]
    start = time.time()
    run = train(out, cache, fault, *sets, faults=f"{fault}:rank=1:step={steps // 2}:attempt=0")
    evs = read_events(run)
    injected = next(e for e in evs if e["kind"] == "fault_injected")
    detected = next(e for e in evs if e["kind"] == "failure_detected")
    recovered = next(e for e in evs if e["kind"] == "recovered")
    first_resume = next(e for e in evs if e["kind"] == "resumed")
    startup = first_resume["time"] - start  # launch to the first step of a fresh start
    kind = "crash" if fault == "kill" else "hang"
    emit(f"{kind}_time_to_detect_vs_{'pg_timeout' if kind == 'hang' else 'hang_timeout'}",
         detected["time"] - injected["time"], "s", PG_TIMEOUT_S if kind == "hang" else HANG_TIMEOUT_S,
         supervisor_says_s=detected["time_to_detect_s"], timeout_s=detected["timeout_s"])
    emit(f"{kind}_time_to_recover_vs_fresh_startup", recovered["time_to_recover_s"], "s", startup,
         effective_time_ratio=evs[-1]["effective_time_ratio"])


def overhead(out: Path, cache: Path, steps: int, rounds: int) -> None:
    runs = {
        "none": lambda r: train(out, cache, f"off{r}", f"train.steps={steps}", supervised=False),
        "1s": lambda r: train(out, cache, f"on{r}", f"train.steps={steps}"),
        "0.1s": lambda r: train(out, cache, f"fast{r}", f"train.steps={steps}", "supervisor.heartbeat_interval_s=0.1"),
    }
    times: dict[str, list[float]] = {name: [] for name in runs}
    order = list(runs)
    for r in range(rounds):
        for name in order[r % len(order):] + order[:r % len(order)]:  # each takes each place in turn
            times[name] += step_times(runs[name](r))
    base = statistics.median(times["none"])
    for interval in ("1s", "0.1s"):
        emit(f"step_time_heartbeat_{interval}_vs_none", statistics.median(times[interval]), "s", base,
             steps_measured=len(times[interval]))
    emit("heartbeat_cpu_per_step_at_0.1s_vs_step_time", heartbeat_cpu_s(base, 0.1), "s", base)


def heartbeat_cpu_s(step_s: float, interval_s: float, n: int = 20000) -> float:
    """CPU seconds the heartbeat adds to one step, measured in this process: the loop's three
    phase() calls and its loss check, plus one beat (the side thread's work) per interval, sent to a real monitor.
    Less noisy than the end-to-end comparison on a busy machine."""
    from mshpc.launch.env import SupervisorLink
    from mshpc.launch.heartbeat import Heartbeat
    from mshpc.launch.monitor import Monitor
    from mshpc.loss_check import check_loss
    from mshpc.save_schedule import SaveSchedule

    monitor = Monitor(1, "t")
    no_saves = SaveSchedule(interval_steps=0, last_step=0)
    beat = Heartbeat(SupervisorLink("127.0.0.1", monitor.port, "t", 0), {"rank": 0, "host": "h"}, 3600.0, no_saves)
    with beat:
        start = time.process_time()
        for step in range(n):
            beat.phase("data", step)
            beat.phase("step", step)
            check_loss(1.0, step, None)
            beat.phase("checkpoint", step)
        phases_s = (time.process_time() - start) / n
        start = time.process_time()
        for _ in range(n // 20):
            beat._send(beat._beat())
        beat_s = (time.process_time() - start) / (n // 20)
    monitor.close()
    return phases_s + beat_s * step_s / interval_s


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=40)
    harness.add_rounds(p, 2, "rounds of the heartbeat-overhead runs; each variant takes each place in turn")
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-recovery-") as tmp:
        out, cache = Path(tmp, "runs"), Path(tmp, "cache")
        fault_run(out, cache, "kill", args.steps)
        fault_run(out, cache, "stop", args.steps)
        overhead(out, cache, args.steps, args.rounds)


if __name__ == "__main__":
    main()
