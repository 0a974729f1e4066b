"""The Python API on submitit: `mshpc.submit(config, ...) -> Job` and `mshpc.submit_sweep(configs)`.

A job runs `mshpc train` semantics in every task (srun under Slurm; the local launcher with
`cluster="local"`). Its result is read back from the run directory (metrics.jsonl and the FINISHED
marker the job writes), never from a pickle: submitit's own result files are not loaded.
"""

from __future__ import annotations

import difflib
import logging
import re
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mshpc.checkpoint.paths import checkpoint_root
from mshpc.config import Config, SlurmConfig, SupervisorConfig, dump_yaml, load_config
from mshpc.errors import ConfigError, LaunchError, shown
from mshpc.launch.requeue import finished_by, latest_checkpoint_step, mark_finished
from mshpc.run_dir import METRICS_FILE, read_metrics, run_path

CLUSTERS = ("slurm", "local")
SIGNAL_DELAY_S = 120  # the pre-timeout signal comes this long before the limit (sbatch --signal)
# Set through submit()'s own arguments, so not accepted among **slurm_kwargs.
_NAMED = {"nodes", "time", "partition", "gpus_per_node", "ntasks_per_node", "job_name", "num_gpus"}
_TIME = re.compile(r"^(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?$")


def slurm_parameters() -> list[str]:
    """The Slurm parameters `submit` accepts as keyword arguments (submitit's, less the named ones)."""
    from submitit.slurm.slurm import SlurmExecutor

    return sorted(SlurmExecutor._valid_parameters() - _NAMED)


def check_slurm_parameters(kwargs: dict[str, Any]) -> None:
    valid = slurm_parameters()
    for key in kwargs:
        if key not in valid:
            close = difflib.get_close_matches(key, valid, n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise ConfigError(f"unknown Slurm parameter {key!r} ({hint}valid: {', '.join(valid)})")
    check_script_values(kwargs)


def check_script_values(values: dict[str, Any], where: str = "") -> None:
    """Every value that goes into the job script (an `#SBATCH --key=value` line, shell-quoted by
    submitit) must be printable: a newline inside the quotes would end the line there, run the
    rest as commands, and make sbatch ignore every later #SBATCH line."""
    for key, value in values.items():
        if isinstance(value, dict):
            check_script_values(value, f"{where}{key}.")
        elif any(not c.isprintable() for c in str(value)):
            raise ConfigError(f"Slurm parameter {where}{key}={shown(value)} holds a control character (a newline "
                              "would end its line of the job script)")


def time_minutes(limit: int | str) -> int:
    """A Slurm time limit (minutes, 'MM:SS', 'HH:MM:SS', 'D-HH[:MM[:SS]]') in whole minutes."""
    if isinstance(limit, int):
        return limit
    m = _TIME.match(limit.strip())
    if m is None:
        raise ConfigError(f"time={limit!r} is not a Slurm time limit (e.g. 90, '01:30:00', '2-00:00:00')")
    days, b, c = (int(g) if g else None for g in m.group(1, 3, 4))
    a = int(m.group(2))  # the one group the pattern requires
    if days is not None:  # D-HH, D-HH:MM, D-HH:MM:SS
        seconds = days * 86400 + a * 3600 + (b or 0) * 60 + (c or 0)
    elif b is not None and c is not None:  # HH:MM:SS (c is only ever set with b)
        seconds = a * 3600 + b * 60 + c
    else:  # MM or MM:SS
        seconds = a * 60 + (b or 0)
    return max(1, -(-seconds // 60))


@dataclass(frozen=True)
class TrainTask:
    """What every task of a job runs: the config is a YAML file in the job folder, so the pickle
    submitit sends holds two strings and the job reads no pickled configuration."""

    config_path: str
    token: str  # names this submission in the FINISHED marker
    local_nproc: int  # ranks to start when no launcher started them (cluster="local")
    tasks_per_node: int = 1  # ranks per node under Slurm

    def __call__(self) -> None:
        from mshpc.launch.env import read_launch_env

        cfg = load_config(self.config_path)
        run_dir = run_path(cfg.run)
        checkpoints = checkpoint_root(cfg.checkpoint, run_dir)
        if finished_by(run_dir, self.token):  # a requeue after the run finished
            return
        env = read_launch_env()
        # as `mshpc train` logs: rank 0 its progress, the others only warnings and errors
        logging.basicConfig(level=logging.INFO if env.rank == 0 else logging.WARNING, format="mshpc: %(message)s")
        if env.launcher == "single" and (env.slurm is not None or self.local_nproc > 1):
            # the batch script of the job, or cluster="local"
            code = self._supervise(env, supervisor=cfg.supervisor, slurm=cfg.slurm, spare_nodes=cfg.train.spare_nodes,
                                   run_dir=run_dir, checkpoints=checkpoints)
            if code != 0:
                raise LaunchError(f"training failed with exit code {code} (see {run_dir / 'events.jsonl'})")
        else:
            from mshpc.train import train

            train(cfg, env)
        if env.rank == 0:
            mark_finished(run_dir, self.token, latest_checkpoint_step(checkpoints))


    def _supervise(self, env: Any, *, supervisor: SupervisorConfig, slurm: SlurmConfig, spare_nodes: int,
                   run_dir: Path, checkpoints: Path) -> int:
        """The supervisor: under Slurm it starts each attempt's ranks as submitit tasks of this
        job (one srun per attempt, logs where `Job.log(rank)` reads them); locally, as ranks."""
        if env.slurm is None:
            from mshpc.launch.supervisor import supervise_local

            return supervise_local(["train", self.config_path], self.local_nproc, supervisor=supervisor,
                                   spare_nodes=spare_nodes, run_dir=run_dir, checkpoints=checkpoints)
        import subprocess
        import sys

        import submitit

        from mshpc.launch.slurm_supervisor import StepSpec, supervise_slurm

        job = submitit.JobEnvironment()
        folder = Path(job.paths.folder)
        hosts = subprocess.run(["scontrol", "show", "hostnames", env.slurm.nodelist], capture_output=True,
                               text=True, check=True).stdout.split()
        rank_argv = (sys.executable, "-u", "-m", "submitit.core._submit", str(folder))
        spec = StepSpec("srun", self.tasks_per_node, rank_argv, str(folder / f"{job.job_id}_%t_log.out"),
                        env.slurm.job_id, error=str(folder / f"{job.job_id}_%t_log.err"))
        return supervise_slurm(env, hosts, spec, supervisor=supervisor, slurm=slurm, spare_nodes=spare_nodes,
                               run_dir=run_dir, checkpoints=checkpoints)


@dataclass(frozen=True)
class RunResult:
    run_dir: Path
    steps: int  # the last logged step
    final_loss: float | None


class Job:
    """A submitted training job: its state, logs per rank, and its result from the run directory."""

    def __init__(self, job: Any, run_dir: Path, token: str) -> None:
        self._job, self.run_dir, self.token = job, run_dir, token

    @property
    def job_id(self) -> str:
        return str(self._job.job_id)

    @property
    def state(self) -> str:
        return str(self._job.state)

    @property
    def folder(self) -> Path:
        return Path(self._job.paths.folder)

    @property
    def sbatch_script(self) -> Path:
        """The rendered sbatch script, saved in the job folder."""
        return Path(self._job.paths.submission_file)

    def done(self) -> bool:
        return bool(self._job.done())

    def cancel(self) -> None:
        self._job.cancel(check=False)

    def log(self, rank: int = 0) -> str:
        """Rank `rank`'s stdout and stderr (one task per rank)."""
        task = self._job.task(rank) if self._job.num_tasks > 1 else self._job
        return (task.stdout() or "") + (task.stderr() or "")

    def wait(self, timeout_s: float | None = None) -> None:
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while not self._job.done():
            if deadline is not None and time.monotonic() > deadline:
                raise LaunchError(f"job {self.job_id} not done after {timeout_s:.0f} s (state {self.state})")
            time.sleep(1.0)

    def result(self, timeout_s: float | None = None) -> RunResult:
        """Wait for the job; the run it finished, or a LaunchError with rank 0's last words."""
        self.wait(timeout_s)
        if not finished_by(self.run_dir, self.token):
            lines = [line for line in self.log(0).splitlines() if line.strip()]
            why = f": {lines[-1].strip()}" if lines else ""
            raise LaunchError(f"job {self.job_id} ended ({self.state}) without finishing {self.run_dir}{why}")
        records = read_metrics(self.run_dir / METRICS_FILE)
        last = records[-1] if records else {}
        return RunResult(run_dir=self.run_dir, steps=last.get("step", 0), final_loss=last.get("loss"))

    def __repr__(self) -> str:
        return f"Job(job_id={self.job_id!r}, run_dir={str(self.run_dir)!r})"


def _resolve(config: str | Path | Config, overrides: Sequence[str]) -> Config:
    if isinstance(config, Config):
        if overrides:
            raise ConfigError("overrides apply to a config file; pass a path, or change the Config itself")
        return config
    return load_config(config, list(overrides))


def build_executor(folder: Path, cluster: str | None, nodes: int, tasks_per_node: int,
                   gpus_per_node: int, partition: str | None, time: int | str, name: str,
                   preempt_signal: str, slurm_kwargs: dict[str, Any]) -> Any:
    """A submitit executor: one task per rank under Slurm, one task (starting the ranks) locally."""
    import submitit

    if cluster is not None and cluster not in CLUSTERS:
        raise ConfigError(f"cluster={cluster!r} (choose {', '.join(CLUSTERS)}, or None: Slurm when srun is here)")
    check_slurm_parameters(slurm_kwargs)
    check_script_values({"name": name, "folder": str(folder), "partition": partition or "", "time": time})
    kwargs = {f"slurm_{k}": v for k, v in slurm_kwargs.items()}
    delay_s = kwargs.pop("slurm_signal_delay_s", SIGNAL_DELAY_S)
    # no-kill: a failed node shrinks the allocation; the supervisor replaces it (a spare) or requeues
    extra = {"signal": f"{preempt_signal}@{delay_s}", "requeue": True, "no-kill": True,
             **kwargs.pop("slurm_additional_parameters", {})}
    executor = submitit.AutoExecutor(folder=folder / "%j", cluster=cluster)
    local = executor.cluster != "slurm"
    executor.update_parameters(
        name=name, nodes=1 if local else nodes, tasks_per_node=1 if local else tasks_per_node,
        timeout_min=time_minutes(time), slurm_additional_parameters=extra, **kwargs,
        # the batch script runs the supervisor, which starts the ranks (one srun per attempt)
        **({} if local else {"slurm_use_srun": False}),
        **({"gpus_per_node": gpus_per_node} if gpus_per_node else {}),
        **({"slurm_partition": partition} if partition else {}),
    )
    return executor


def _tasks(cfgs: list[Config], folder: Path, nproc: int, per_node: int) -> list[TrainTask]:
    names = [str(run_path(c.run)) for c in cfgs]
    clash = sorted({n for n in names if names.count(n) > 1})
    if clash:
        raise ConfigError(f"the sweep's configs share run directories {clash}: give each its own run.name")
    folder.mkdir(parents=True, exist_ok=True)
    tasks = []
    for cfg in cfgs:
        token = uuid.uuid4().hex
        path = folder / f"{cfg.run.name}-{token[:8]}.yaml"
        path.write_text(dump_yaml(cfg))
        tasks.append(TrainTask(str(path.resolve()), token, nproc, per_node))
    return tasks


def submit_sweep(configs: Sequence[str | Path | Config], *, nodes: int = 1, gpus_per_node: int = 0,
                 tasks_per_node: int | None = None, partition: str | None = None,
                 time: int | str = "01:00:00", cluster: str | None = None, folder: str | Path | None = None,
                 **slurm_kwargs: Any) -> list[Job]:
    """Submit one training job per config, as one Slurm job array; see `submit` for the arguments."""
    cfgs = [_resolve(c, ()) for c in configs]
    if not cfgs:
        raise ConfigError("submit_sweep needs at least one config")
    first = cfgs[0]
    per_node = tasks_per_node or gpus_per_node or max(1, first.world_size // nodes)
    root = Path(folder) if folder is not None else Path(first.run.out_dir) / "slurm"
    # the spares (train.spare_nodes) are allocated too: the supervisor keeps them for an evicted node
    executor = build_executor(root, cluster, nodes + first.train.spare_nodes, per_node, gpus_per_node, partition, time,
                              f"mshpc-{first.run.name}", first.slurm.preempt_signal, slurm_kwargs)
    tasks = _tasks(cfgs, root / "configs", nodes * per_node, per_node)
    with executor.batch():
        jobs = [executor.submit(task) for task in tasks]
    return [Job(j, run_path(c.run).resolve(), t.token) for j, c, t in zip(jobs, cfgs, tasks, strict=True)]


def submit(config: str | Path | Config, *, overrides: Sequence[str] = (), nodes: int = 1,
           gpus_per_node: int = 0, tasks_per_node: int | None = None, partition: str | None = None,
           time: int | str = "01:00:00", cluster: str | None = None, folder: str | Path | None = None,
           **slurm_kwargs: Any) -> Job:
    """Submit a training job: `nodes` x `tasks_per_node` ranks (default: one per GPU, or the
    config's world on CPU). `time` is a Slurm limit; `cluster` "slurm", "local" or None (Slurm
    when srun is on PATH); job files go to `folder` (default <run.out_dir>/slurm/<job id>/);
    other Slurm parameters (account, qos, constraint, exclude, mem...) pass as keywords."""
    return submit_sweep([_resolve(config, overrides)], nodes=nodes, gpus_per_node=gpus_per_node, tasks_per_node=tasks_per_node,
                        partition=partition, time=time, cluster=cluster, folder=folder, **slurm_kwargs)[0]
