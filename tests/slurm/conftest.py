"""The real local Slurm for tests marked `slurm`: started (as root) by tests/slurm/cluster.sh,
which `make test` runs first; skipped with the reason only where it cannot be started, and a
failure instead under CI=true, where it must run."""

import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from support.cli_runner import REPO, SMALL, read_metrics

CLUSTER_SH = REPO / "tests/slurm/cluster.sh"
VENV_BIN = Path(sys.executable).parent


def _cluster_ready() -> str | None:
    """None when the cluster is up, else why it is not (starting it if we are root)."""
    if shutil.which("sbatch") and subprocess.run(["bash", CLUSTER_SH, "status"], capture_output=True).returncode == 0:
        return None
    if os.geteuid() != 0:
        return "not root: the local Slurm cannot be started (run `make test` or tests/slurm/cluster.sh start as root)"
    out = subprocess.run(["bash", CLUSTER_SH, "start"], capture_output=True, text=True, timeout=900)
    if out.returncode != 0:
        pytest.fail(f"tests/slurm/cluster.sh start failed:\n{out.stderr[-3000:]}")
    return None


@pytest.fixture(scope="session")
def slurm_cluster() -> None:
    reason = _cluster_ready()
    if reason is None:
        return
    if os.environ.get("CI") == "true":
        pytest.fail(f"CI=true but the Slurm tests cannot run: {reason}")
    pytest.skip(reason)


class Slurm:
    """Submit to the local cluster from a test's folder and watch what Slurm reports."""

    def __init__(self, cwd: Path) -> None:
        self.cwd = cwd
        self.submitted: list[str] = []
        env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "PMI", "OMPI_", "MSHPC_"))}
        env.update(PATH=f"{VENV_BIN}:{env.get('PATH', '')}", MSHPC_PYTHON=sys.executable)
        self.env = env

    def sbatch(self, *args: str, env: dict[str, str] | None = None) -> str:
        out = subprocess.run(["sbatch", "--parsable", *args], capture_output=True, text=True,
                             cwd=self.cwd, env={**self.env, **(env or {})}, timeout=60)
        assert out.returncode == 0, out.stderr
        job_id = out.stdout.strip().split(";")[0]
        self.submitted.append(job_id)
        return job_id

    def info(self, job_id: str) -> dict[str, str]:
        """`scontrol show job` as a dict (finished jobs stay visible for MinJobAge=300 s)."""
        out = subprocess.run(["scontrol", "-o", "show", "job", job_id], capture_output=True, text=True, timeout=30)
        return dict(f.split("=", 1) for f in out.stdout.split() if "=" in f)

    def wait_until(self, what: str, predicate, timeout_s: float = 180, poll_s: float = 0.3):
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            value = predicate()
            if value:
                return value
            time.sleep(poll_s)
        raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}")

    def wait_done(self, job_id: str, timeout_s: float = 180) -> dict[str, str]:
        ended = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED")
        return self.wait_until(f"job {job_id} to end",
                               lambda: (i := self.info(job_id)).get("JobState") in ended and i, timeout_s)

    def wait_nodes_free(self, timeout_s: float = 120) -> None:
        """Until no node is allocated or completing: a job the previous test waited for may still
        be finishing on its node (a run's FINISHED file comes before Slurm's epilog), and a test
        that checks which nodes it got needs them all to choose from."""
        busy = ("alloc", "mix", "comp")

        def free() -> bool:
            out = subprocess.run(["sinfo", "-h", "-N", "-o", "%T"], capture_output=True, text=True, timeout=30)
            return out.returncode == 0 and not any(state.startswith(busy) for state in out.stdout.split())
        self.wait_until("every node free", free, timeout_s)

    def batch_log(self, job_id: str, name: str = "mshpc-train") -> str:
        return (self.cwd / f"{name}-{job_id}.out").read_text()

    def train_sets(self, cache: Path, *overrides: str, name: str = "t") -> list[str]:
        """`--set` arguments for a small, fast tiny-config run in this test's folder."""
        sets = [*SMALL, f"run.out_dir={self.cwd / 'runs'}", f"run.name={name}", f"data.cache_dir={cache}", *overrides]
        return [a for s in sets for a in ("--set", s)]

    def cancel_leftovers(self) -> None:
        if self.submitted:
            subprocess.run(["scancel", *self.submitted], capture_output=True, timeout=30)


@pytest.fixture
def slurm(slurm_cluster, tmp_path) -> Slurm:
    s = Slurm(tmp_path)
    s.wait_nodes_free()
    yield s
    s.cancel_leftovers()  # a failed test leaves no job behind to load the shared cluster



@pytest.fixture(scope="session")
def two_node_run(slurm_cluster, tmp_path_factory, corpus_cache):
    """One 2 nodes x 1 task job of sbatch/train.sbatch (srun, 8 steps), read by several tests."""
    slurm = Slurm(tmp_path_factory.mktemp("srun"))
    slurm.wait_nodes_free()
    sets = slurm.train_sets(corpus_cache, "train.steps=8", "checkpoint.interval_steps=4")
    job = slurm.sbatch(str(REPO / "sbatch/train.sbatch"), str(REPO / "configs/tiny.yaml"), *sets)
    yield slurm, job, slurm.wait_done(job)
    slurm.cancel_leftovers()


@pytest.fixture(scope="session")
def steps_for(two_node_run):
    """steps_for(seconds): tiny-config steps that take at least that long here, even at the
    reference run's fastest step (a slower machine only makes them last longer)."""
    fastest_s = min(r["step_time_s"] for r in read_metrics(two_node_run[0].cwd / "runs/t"))
    return lambda seconds: math.ceil(seconds / fastest_s)
