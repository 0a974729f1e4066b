"""The one reader of the launcher's environment (MPI, Slurm, torchrun, the local launcher).

Everything else in mshpc receives the typed `LaunchEnv` this module returns.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal, cast, overload

from mshpc.errors import LaunchError

Launcher = Literal["mpi", "slurm", "env", "single"]
LAUNCHERS: tuple[str, ...] = ("mpi", "slurm", "env", "single")

# Variables only a real MPI launcher sets (Hydra/MPICH, Open MPI, PMIx incl. `srun --mpi=pmix`).
# PMI_RANK alone is not enough: Slurm's pmi2 plugin sets it for plain `srun` too.
_MPI_MARKERS = ("MPI_LOCALNRANKS", "OMPI_COMM_WORLD_SIZE", "PMIX_RANK")


@dataclass(frozen=True)
class SlurmEnv:
    job_id: int
    step_id: int | None
    ntasks: int | None
    nodelist: str  # compressed hostlist of the step (or job), e.g. "node[1-3]"
    array_job_id: int | None
    array_task_id: int | None
    restart_count: int = 0  # SLURM_RESTART_COUNT: how often this job was requeued


@dataclass(frozen=True)
class SupervisorLink:
    """Where this rank's heartbeats go (set by mshpc's supervisor for the ranks it starts)."""

    host: str
    port: int
    token: str  # names the attempt: the supervisor ignores ranks of an earlier one
    attempt: int  # 0 for the first start of the ranks, +1 for each restart
    # whether this rank starts its node's heartbeat relay (launch/node_relay.py): MSHPC_NODE_RELAY_START
    # where the launcher says (local slots), else the node's local rank 0
    starts_relay: bool = False
    generation: int = 0  # MSHPC_GENERATION: recoveries in place within this attempt so far
    replacement: bool = False  # MSHPC_REPLACEMENT: this rank replaces a lost one in place


@dataclass(frozen=True)
class LaunchEnv:
    launcher: Launcher
    rank: int  # provisional for "mpi": mpi4py's communicator is the authority
    world_size: int
    local_rank: int
    local_world_size: int
    node: str
    master_addr: str | None
    master_port: int | None
    slurm: SlurmEnv | None
    test_faults: str | None  # MSHPC_TEST_FAULTS: fault injection, honoured only by tests
    supervisor: SupervisorLink | None = None  # MSHPC_SUPERVISOR=host:port, MSHPC_SUPERVISOR_TOKEN, MSHPC_ATTEMPT
    store_rank: int = 0  # MSHPC_STORE_RANK: the rank that serves the rendezvous store (a generation's may not be 0)


@overload
def _int(env: Mapping[str, str], name: str, default: int) -> int: ...
@overload
def _int(env: Mapping[str, str], name: str, default: int | None = None) -> int | None: ...
def _int(env: Mapping[str, str], name: str, default: int | None = None) -> int | None:
    raw = env.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise LaunchError(f"environment variable {name}={raw!r} is not an integer") from None


def _set_int(env: Mapping[str, str], name: str) -> int:
    """An integer the launcher must have set."""
    value = _int(env, name)
    if value is None:
        raise LaunchError(f"environment variable {name} is empty")
    return value


def _slurm(env: Mapping[str, str]) -> SlurmEnv | None:
    job_id = _int(env, "SLURM_JOB_ID")
    if job_id is None:
        return None
    return SlurmEnv(
        job_id=job_id,
        step_id=_int(env, "SLURM_STEP_ID"),
        ntasks=_int(env, "SLURM_STEP_NUM_TASKS", _int(env, "SLURM_NTASKS")),
        nodelist=env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST", ""),
        array_job_id=_int(env, "SLURM_ARRAY_JOB_ID"),
        array_task_id=_int(env, "SLURM_ARRAY_TASK_ID"),
        restart_count=_int(env, "SLURM_RESTART_COUNT", 0),
    )


def _detect(env: Mapping[str, str], slurm: SlurmEnv | None) -> Launcher:
    forced = env.get("MSHPC_BOOTSTRAP", "")
    if forced:
        if forced not in LAUNCHERS:
            raise LaunchError(f"MSHPC_BOOTSTRAP={forced!r} is not a launcher (choose {', '.join(LAUNCHERS)})")
        return cast(Launcher, forced)  # one of LAUNCHERS, checked above
    if any(name in env for name in _MPI_MARKERS):
        return "mpi"
    if slurm is not None and slurm.step_id is not None and "SLURM_PROCID" in env:
        return "slurm"
    if "RANK" in env and "WORLD_SIZE" in env:
        return "env"
    return "single"


def _mpi_env(env: Mapping[str, str]) -> tuple[int, int, int, int]:
    rank = _int(env, "OMPI_COMM_WORLD_RANK", _int(env, "PMI_RANK", _int(env, "PMIX_RANK", 0)))
    size = _int(env, "OMPI_COMM_WORLD_SIZE", _int(env, "PMI_SIZE", 1))
    local = _int(env, "OMPI_COMM_WORLD_LOCAL_RANK", _int(env, "MPI_LOCALRANKID", 0))
    local_size = _int(env, "OMPI_COMM_WORLD_LOCAL_SIZE", _int(env, "MPI_LOCALNRANKS", 1))
    return rank, size, local, local_size


def read_launch_env(environ: Mapping[str, str] | None = None) -> LaunchEnv:
    """Read rank, world and node from whichever launcher started this process."""
    env = os.environ if environ is None else environ
    slurm = _slurm(env)
    launcher = _detect(env, slurm)
    # MSHPC_NODE: the slot (simulated node) the local supervisor put this rank on
    node = env.get("SLURMD_NODENAME") or env.get("MSHPC_NODE") or socket.gethostname()
    addr, port = env.get("MASTER_ADDR"), _int(env, "MASTER_PORT")
    if launcher == "mpi":
        rank, world, local, local_world = _mpi_env(env)
    elif launcher == "slurm":
        rank, world = _int(env, "SLURM_PROCID", 0), _int(env, "SLURM_NTASKS", 1)
        local = _int(env, "SLURM_LOCALID", 0)
        local_world = _int(env, "SLURM_NTASKS_PER_NODE", 0) or _tasks_on_node(env)
    elif launcher == "env":
        rank, world = _set_int(env, "RANK"), _set_int(env, "WORLD_SIZE")
        local = _int(env, "LOCAL_RANK", 0)
        local_world = _int(env, "LOCAL_WORLD_SIZE", world)
        if addr is None or port is None:
            raise LaunchError("RANK and WORLD_SIZE are set but MASTER_ADDR or MASTER_PORT is not")
    else:
        rank, world, local, local_world = 0, 1, 0, 1
    return LaunchEnv(
        launcher=launcher, rank=rank, world_size=world, local_rank=local,
        local_world_size=local_world, node=node, master_addr=addr, master_port=port,
        slurm=slurm, test_faults=env.get("MSHPC_TEST_FAULTS") or None, supervisor=supervisor_link(env, local),
        store_rank=_int(env, "MSHPC_STORE_RANK", 0),
    )


def supervisor_link(environ: Mapping[str, str] | None = None, local_rank: int = 0) -> SupervisorLink | None:
    """Where heartbeats go (MSHPC_SUPERVISOR=host:port and its token), None without a supervisor."""
    env = os.environ if environ is None else environ
    raw = env.get("MSHPC_SUPERVISOR")
    if not raw:
        return None
    host, sep, port = raw.rpartition(":")
    if not sep or not port.isdigit():
        raise LaunchError(f"MSHPC_SUPERVISOR={raw!r} must be HOST:PORT")
    starts = env.get("MSHPC_NODE_RELAY_START")
    return SupervisorLink(host=host, port=int(port), token=env.get("MSHPC_SUPERVISOR_TOKEN", ""),
                          attempt=_int(env, "MSHPC_ATTEMPT", 0),
                          starts_relay=starts == "1" if starts else local_rank == 0,
                          generation=_int(env, "MSHPC_GENERATION", 0),
                          replacement=env.get("MSHPC_REPLACEMENT") == "1")


def _tasks_on_node(env: Mapping[str, str]) -> int:
    """SLURM_TASKS_PER_NODE looks like '2(x3),1'; this node's count is at SLURM_NODEID."""
    node_id = _int(env, "SLURM_NODEID", 0) or 0
    counts: list[int] = []
    for part in env.get("SLURM_TASKS_PER_NODE", "1").split(","):
        count, _, repeat = part.partition("(x")
        counts += [int(count)] * (int(repeat.rstrip(")")) if repeat else 1)
    return counts[min(node_id, len(counts) - 1)]


def check_world(env: LaunchEnv, world_size: int) -> None:
    """Under Slurm, the world the bootstrap found must equal the step's task count: a
    mis-built MPI silently starts N single-rank jobs instead of one N-rank job."""
    if env.slurm is None or env.slurm.ntasks is None or env.launcher not in ("mpi", "slurm"):
        return
    if world_size != env.slurm.ntasks:
        raise LaunchError(
            f"{env.launcher} bootstrap found world size {world_size} but SLURM_NTASKS="
            f"{env.slurm.ntasks}: mpi4py is likely built against another MPI than the launcher's"
        )
