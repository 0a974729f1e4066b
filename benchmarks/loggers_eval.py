"""Claim: TensorBoard, W&B (offline) and a configured validation add under 1% to the time of the
steps that do not evaluate, against metrics.jsonl alone.

Side by side in one run: real `mshpc train` runs of configs/tiny.yaml on 2 ranks, alternating
"jsonl" (run.loggers [jsonl], eval off) and "all" (run.loggers [jsonl, tensorboard, wandb],
eval.interval_steps), so that machine noise falls on both alike. A step's time is the gap
between consecutive steps in rank 0's timings file, so it holds everything the loop does for
the step, the loggers' writes included; the "all" runs count only steps that neither evaluate
nor follow an evaluation. Prints the ratio of the median step times (target <= 1.01) and, as a
noise-free cross-check, the measured cost of one row written to all three loggers over the
median step: what the loop's thread waits for, and the work of all threads.

    .venv/bin/python benchmarks/loggers_eval.py [--rounds 2] [--steps 40] [--interval 10]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
WARMUP = 5  # steps whose time is start-up, not steady state
BASE = ["run.progress=none", "checkpoint.interval_steps=0", "train.cpu_threads=1"]
ALL = ["run.loggers=[jsonl,tensorboard,wandb]"]


def offline_env(tmp: Path) -> dict[str, str]:
    env = dict(os.environ, WANDB_MODE="offline", PYTHONPATH=str(REPO))
    for var in ("WANDB_DIR", "WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        env[var] = str(tmp / var.lower())
    return env


def train(tmp: Path, name: str, overrides: list[str], steps: int) -> Path:
    sets = [*BASE, f"run.out_dir={tmp}", f"run.name={name}", f"train.steps={steps}", *overrides]
    cmd = [sys.executable, "-m", "mshpc", "train", str(REPO / "configs/tiny.yaml"), "--nproc", "2",
           *[a for s in sets for a in ("--set", s)]]
    out = subprocess.run(cmd, capture_output=True, text=True, env=offline_env(tmp), cwd=REPO, timeout=1800)
    if out.returncode != 0:
        raise SystemExit(f"{name} failed:\n{out.stderr[-3000:]}")
    return tmp / name


def step_gaps(run_dir: Path, interval: int) -> list[float]:
    """Seconds between consecutive steps on rank 0, leaving out evaluating steps and the next."""
    lines = (run_dir / "timings" / "rank-00000.jsonl").read_text().splitlines()[1:]
    times = {r["step"]: r["time"] for r in map(json.loads, lines)}
    evaluates = (lambda s: interval > 0 and s % interval == 0)
    return [times[s] - times[s - 1] for s in sorted(times)
            if s > WARMUP and s - 1 in times and not evaluates(s) and not evaluates(s - 1)]


def row_cost_s(tmp: Path, rows: int = 300) -> tuple[float, float]:
    """Seconds per full row to metrics.jsonl, TensorBoard and W&B (offline), in process: what the
    loop's thread waits for (TensorBoard and W&B write on side threads), and all of it (the side
    threads drained)."""
    os.environ.update(offline_env(tmp))
    from mshpc.config import load_config
    from mshpc.loggers.sinks import build_loggers
    from mshpc.run_dir import MetricsLog

    run_dir = tmp / "rows"
    run_dir.mkdir()
    loggers = build_loggers(load_config(None, ALL), run_dir, MetricsLog(run_dir / "metrics.jsonl", 0), 0)
    row = {"loss": 2.5, "lr": 1e-3, "grad_norm": 0.7, "tokens_per_s": 3000.0, "step_time_s": 0.7, "mfu": 0.01,
           "tflops": 0.02, "data_wait_s": 1e-5, "ckpt_blocking_s": None, "ckpt_stage1_wait_s": None,
           "max_memory_gib": None}
    start = time.perf_counter()
    for step in range(1, rows + 1):
        loggers.write({"step": step, **row})
    loop_s = (time.perf_counter() - start) / rows
    loggers.close()
    return loop_s, (time.perf_counter() - start) / rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--interval", type=int, default=10)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="mshpc-loggers-") as name:
        tmp = Path(name)
        gaps: dict[str, list[float]] = {"jsonl": [], "all": []}
        for r in range(args.rounds):
            order = ["jsonl", "all"] if r % 2 == 0 else ["all", "jsonl"]
            for kind in order:
                extra = [*ALL, f"eval.interval_steps={args.interval}"] if kind == "all" else []
                run_dir = train(tmp, f"{kind}-{r}", extra, args.steps)
                gaps[kind] += step_gaps(run_dir, args.interval if kind == "all" else 0)
        base, ours = statistics.median(gaps["jsonl"]), statistics.median(gaps["all"])
        print(json.dumps({"bench": "loggers_eval", "metric": "step_time_tensorboard_wandb_eval_vs_jsonl_only",
                          "value": round(ours, 4), "unit": "s", "baseline": round(base, 4),
                          "ratio": round(ours / base, 4), "steps": [len(gaps["all"]), len(gaps["jsonl"])]}))
        loop_s, total_s = row_cost_s(tmp)
        for metric, cost in (("row_wait_on_loop_thread", loop_s), ("row_work_all_threads", total_s)):
            print(json.dumps({"bench": "loggers_eval", "metric": f"{metric}_vs_median_jsonl_step",
                              "value": round(cost, 6), "unit": "s", "baseline": round(base, 4),
                              "ratio": round(cost / base, 6)}))


if __name__ == "__main__":
    main()
