"""Run the real `mshpc` command from tests and read what it leaves behind."""

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

# A model small enough that a few steps on 2 CPU ranks take seconds. The torch loader: DALI's
# import costs each rank about 1 CPU-s, more than such a run's steps; DALI is checked against it
# batch for batch (tests/unit/data/test_loader.py) and trains in test_train_data.py and
# test_resume.py, which ask for data.loader=auto.
SMALL = ["model.n_layer=2", "model.d_model=64", "model.n_head=2", "model.seq_len=32",
         "optim.warmup_steps=2", "run.progress=lines", "train.cpu_threads=1", "data.loader=torch"]


def mshpc(*args: str, env: dict[str, str] | None = None, timeout_s: float = 300,
          launcher: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    """Run the real `mshpc` command (optionally under a launcher such as mpiexec)."""
    full_env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "PMI", "OMPI_"))}
    full_env.update(env or {})
    return subprocess.run([*launcher, sys.executable, "-m", "mshpc", *args], capture_output=True,
                          text=True, timeout=timeout_s, env=full_env, cwd=REPO)


def train_args(tmp_path: Path, cache: Path, *overrides: str, name: str = "t") -> list[str]:
    sets = [*SMALL, f"run.out_dir={tmp_path}", f"run.name={name}", f"data.cache_dir={cache}", *overrides]
    return ["train", str(REPO / "configs/tiny.yaml"), *[a for s in sets for a in ("--set", s)]]


def read_metrics(run_dir: Path) -> list[dict]:
    """The run's final history of rows (each attempt's marker drops the steps trained again)."""
    from mshpc.run_dir import read_metrics as final_rows

    return final_rows(run_dir / "metrics.jsonl")
