"""Claim: mshpc's optimisations (fused kernels, overlapped collectives, the background data
pipeline) make a real training run faster on a GPU. Trains the same config twice in one run,
with every optimisation on and with all of them off, and prints one JSON line per run and one
with the ratio: median MFU, tokens/s per GPU and peak memory over the steps after warm-up.

    python3 benchmarks/gpu/train_compare.py [--config configs/gpt-1.3b.yaml] [--steps 20] [--set k=v ...]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from mshpc.bench import harness
from mshpc.bench.harness import REPO
from mshpc.run_dir import read_metrics

# What "off" means: the reference operators, no overlap of ZeRO or tensor-parallel collectives,
# and the plain torch loader; the engine, bf16 and the model are the same.
OFF = ["model.fused_kernels=off", "parallel.dp_overlap=false", "parallel.tp_overlap=false", "data.loader=torch"]
ON = ["model.fused_kernels=on"]


def train(config: str, overrides: list[str], steps: int, out: Path, name: str) -> list[dict]:
    sets = [*overrides, f"train.steps={steps}", f"run.out_dir={out}", f"run.name={name}", "run.progress=none",
            "checkpoint.interval_steps=0"]
    cmd = [sys.executable, "-m", "mshpc", "train", config, *[a for s in sets for a in ("--set", s)]]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"train_compare: the {name} run failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    return read_metrics(out / name / "metrics.jsonl")


def summary(records: list[dict], world: int) -> dict:
    steady = records[len(records) // 3:]  # the first third: warm-up, compilation, allocator growth
    mfu = [r["mfu"] for r in steady if r["mfu"] is not None]
    mem = [r["max_memory_gib"] for r in steady if r.get("max_memory_gib") is not None]
    return {
        "tokens_per_s_per_gpu": statistics.median(r["tokens_per_s"] for r in steady) / world,
        "mfu": statistics.median(mfu) if mfu else None,
        "step_time_s": statistics.median(r["step_time_s"] for r in steady),
        "peak_memory_gib": max(mem) if mem else None,
        "final_loss": records[-1]["loss"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--config", default=str(REPO / "configs/gpt-1.3b.yaml"))
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        runs = {}
        for name, extra in (("optimised", ON), ("baseline", OFF)):
            runs[name] = summary(train(args.config, [*args.set, *extra], args.steps, Path(tmp), name), world=1)
            harness.emit({"bench": "gpu_train", "run": name, "config": Path(args.config).name, **runs[name]})
    on, off = runs["optimised"], runs["baseline"]
    harness.emit(harness.record("gpu_train", "tokens_per_s_per_gpu_optimised_vs_all_off", on["tokens_per_s_per_gpu"],
                                "tokens/s", off["tokens_per_s_per_gpu"], digits=1, load_avg=harness.load_average()))


if __name__ == "__main__":
    main()
