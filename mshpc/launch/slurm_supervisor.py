"""The supervisor in a Slurm batch script: one job step (srun, or mpiexec) per attempt, on the
allocation's nodes less the evicted ones, with spares (`train.spare_nodes`) held back to take an
evicted node's place. The job is submitted with --no-kill, so a failed node shrinks the
allocation instead of ending the job; Slurm's own view of the nodes (sinfo) is asked after every
failure. With no spare left, the job is requeued with the evicted nodes excluded.

`python -m mshpc.launch.slurm_supervisor --hosts n1,n2 --per-node 1 --logs DIR -- CONFIG [--set k=v ...]`
is sbatch/train.sbatch's side; `mshpc.submit` calls `supervise_slurm` in its batch task.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import FrameType

from mshpc.checkpoint.paths import checkpoint_root
from mshpc.config import SlurmConfig, SupervisorConfig, load_config
from mshpc.errors import MshpcError
from mshpc.launch.env import LaunchEnv, read_launch_env
from mshpc.launch.monitor import RankState
from mshpc.launch.recovery import NodePool
from mshpc.launch.requeue import job_key, requeue_guarded, run_batch_helper
from mshpc.launch.supervisor import Supervisor
from mshpc.run_dir import run_path

UNUSABLE = ("down", "drain", "fail", "maint", "unknown")  # sinfo states a step cannot use
STEP_EXIT_WAIT_S = 60.0  # after scancel of a step: Slurm's KillWait and then some


@dataclass(frozen=True)
class StepSpec:
    """How every attempt's ranks start: launcher, tasks per node, log files, and the rank command."""

    launch: str  # "srun" or "mpiexec"
    per_node: int
    rank_argv: tuple[str, ...]  # the command of one rank
    output: str  # per-rank log pattern, %t = the rank
    job_id: int
    mpiexec: str = "mpiexec"
    error: str | None = None  # stderr's pattern, when apart from stdout


def step_command(spec: StepSpec, hosts: list[str], evicted: list[str], attempt: int) -> list[str]:
    n = len(hosts) * spec.per_node
    if spec.launch == "mpiexec":
        out = spec.output.replace("%t", "%r")
        return [spec.mpiexec, "-n", str(n), "-ppn", str(spec.per_node), "-hosts", ",".join(hosts),
                f"-outfile-pattern={out}", f"-errfile-pattern={out}", *spec.rank_argv]
    return ["srun", f"--job-name=mshpc-attempt-{attempt}", f"--nodes={len(hosts)}", f"--ntasks={n}",
            f"--ntasks-per-node={spec.per_node}", f"--nodelist={','.join(hosts)}",
            *([f"--exclude={','.join(evicted)}"] if evicted else []),
            "--kill-on-bad-exit=1", "--wait=60", f"--output={spec.output}", "--open-mode=append",
            *([f"--error={spec.error}"] if spec.error else []), *spec.rank_argv]


class SlurmStep:
    """One attempt's ranks: the srun (or mpiexec) process and the job step it started."""

    def __init__(self, spec: StepSpec, hosts: list[str], evicted: list[str], attempt: int, env: dict[str, str]) -> None:
        self.spec, self.attempt = spec, attempt
        self.proc = subprocess.Popen(step_command(spec, hosts, evicted, attempt), env={**os.environ, **env})
        self.ended_at: float | None = None

    def signal(self, signum: int) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signum)

    def request_stop(self) -> None:
        """srun passes SIGTERM to every task, which the ranks under Slurm take as a stop request."""
        self.signal(signal.SIGTERM)

    def update(self, states: dict[int, RankState]) -> None:
        """When the step has ended, every rank that said nothing ended with it."""
        if self.proc.poll() is None:
            return
        self.ended_at = self.ended_at or time.time()
        for s in states.values():
            if s.exited_at is None:
                s.exited_at = self.ended_at
                if s.outcome is None:  # said nothing: srun's code is all there is to go by
                    s.exit_code = 0 if self.proc.returncode == 0 else None

    def stop(self, grace_s: float) -> list[int]:
        """scancel the step (Slurm's SIGCONT, SIGTERM, KillWait, SIGKILL); kill the launcher last."""
        if self.proc.poll() is not None:
            return []
        step = self._step_id()
        if step is not None:
            subprocess.run(["scancel", step], capture_output=True, timeout=30)
        else:
            self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=grace_s + STEP_EXIT_WAIT_S)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        return []

    def _step_id(self) -> str | None:
        if self.spec.launch != "srun":
            return None
        out = subprocess.run(["squeue", "-h", "-s", "-j", str(self.spec.job_id), "-o", "%i %j"],
                             capture_output=True, text=True, timeout=30).stdout
        name = f"mshpc-attempt-{self.attempt}"
        return next((line.split()[0] for line in out.splitlines() if line.split()[1:] == [name]), None)


def unusable_nodes(hosts: list[str]) -> dict[str, str]:
    """Hosts Slurm reports down, draining, failed or not responding (a trailing '*'), with the state."""
    out = subprocess.run(["sinfo", "-h", "-N", "-n", ",".join(hosts), "-o", "%N %T"],
                         capture_output=True, text=True, timeout=30).stdout
    bad = {}
    for line in out.splitlines():
        host, state = line.split()
        if state.endswith("*") or state.lower().startswith(UNUSABLE):
            bad[host] = state
    return bad


def requeue_excluding(env: LaunchEnv, evicted: list[str], *, slurm: SlurmConfig, run_dir: Path,
                      checkpoints: Path) -> bool:
    """Requeue this job with `evicted` excluded: Slurm refuses ExcNodeList on a running job, so
    hold it on requeue, exclude, release. The requeue ends this batch script; SIGTERM is ignored
    meanwhile (Slurm's KillWait gives the few milliseconds needed)."""
    assert env.slurm is not None
    key = job_key(env.slurm)
    previous = signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        if not requeue_guarded(env, slurm=slurm, run_dir=run_dir, checkpoints=checkpoints, hold=True):
            return False
        subprocess.run(["scontrol", "update", f"JobId={key}", f"ExcNodeList={','.join(evicted)}"], check=False, timeout=30)
        return subprocess.run(["scontrol", "release", key], timeout=30).returncode == 0
    finally:
        signal.signal(signal.SIGTERM, previous)


def supervise_slurm(env: LaunchEnv, hosts: list[str], spec: StepSpec, *, supervisor: SupervisorConfig,
                    slurm: SlurmConfig, spare_nodes: int, run_dir: Path, checkpoints: Path) -> int:
    """Run the ranks as job steps on `hosts` under the supervisor; returns the exit code."""
    needed = len(hosts) - spare_nodes
    if needed < 1:
        raise MshpcError(f"train.spare_nodes={spare_nodes} leaves no node to train on "
                         f"(the allocation has {len(hosts)}: {','.join(hosts)})")
    pool = NodePool(hosts, needed, supervisor.evict_after)
    current: list[SlurmStep] = []

    def start(attempt: int, active: list[str], rank_env: dict[str, str]) -> SlurmStep:
        current[:] = [SlurmStep(spec, active, pool.evicted, attempt, rank_env)]
        return current[0]

    def forward(signum: int, frame: FrameType | None) -> None:  # the batch script passes Slurm's signals on
        sup.stopping = True
        if current:
            current[0].signal(signum)

    def requeue(evicted: list[str]) -> bool:
        return requeue_excluding(env, evicted, slurm=slurm, run_dir=run_dir, checkpoints=checkpoints)

    sup = Supervisor(needed * spec.per_node, pool, start, "0.0.0.0", supervisor=supervisor, spare_nodes=spare_nodes,
                     run_dir=run_dir, checkpoints=checkpoints, down=unusable_nodes, requeue=requeue)
    for signum in (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(signum, forward)
    return sup.run()


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m mshpc.launch.slurm_supervisor",
                                description="The supervisor of sbatch/train.sbatch (runs in the batch script).")
    p.add_argument("--hosts", required=True, help="comma-separated nodes to use, in rank order, spares last")
    p.add_argument("--per-node", type=int, required=True)
    p.add_argument("--logs", required=True, type=Path, help="folder of the per-rank logs")
    p.add_argument("--launch", default="srun", choices=("srun", "mpiexec"))
    p.add_argument("--mpiexec", default="mpiexec")
    p.add_argument("config")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse(argv)

    def supervise() -> int:
        cfg, env = load_config(args.config, args.set), read_launch_env()
        if env.slurm is None:
            raise MshpcError("the Slurm supervisor runs inside a Slurm job (SLURM_JOB_ID is not set)")
        rank_argv = (sys.executable, "-m", "mshpc", "train", args.config, *[a for s in args.set for a in ("--set", s)])
        spec = StepSpec(args.launch, args.per_node, rank_argv, str(args.logs / "rank-%t.log"), env.slurm.job_id,
                        args.mpiexec)
        run_dir = run_path(cfg.run)
        return supervise_slurm(env, args.hosts.split(","), spec, supervisor=cfg.supervisor, slurm=cfg.slurm,
                               spare_nodes=cfg.train.spare_nodes, run_dir=run_dir,
                               checkpoints=checkpoint_root(cfg.checkpoint, run_dir))

    return run_batch_helper(supervise)


if __name__ == "__main__":
    sys.exit(main())
