"""Recovery in place, a rank's side (`recovery.in_place`): when its loop raises because a peer was
lost, the rank does not exit. It tells the supervisor ("lost"), leaves its process groups, and
waits for the supervisor's word: the new generation's rendezvous. Its process, imports, device
context and in-memory snapshots stay; the train function runs again in the new generation, as
NVIDIA's in-process restart re-enters its wrapped function, and restores from the snapshots.

What a rank never waits out: a user error (MshpcError: a retry cannot fix it), snapshots that
cannot be restored (the supervisor restarts from disk), a rank found corrupting data (its node is
evicted): it exits as it always did, with its error.
"""

from __future__ import annotations

import dataclasses
import logging

import torch
import torch.distributed as dist

from mshpc.errors import MshpcError, SilentDataCorruption, SnapshotsUnusable
from mshpc.launch.env import LaunchEnv
from mshpc.launch.heartbeat import Heartbeat

log = logging.getLogger(__name__)

NOT_IN_PLACE: tuple[type[BaseException], ...] = (MshpcError, SnapshotsUnusable, SilentDataCorruption)


def abort_communicators() -> None:
    """NCCL: abort every communicator (ncclCommAbort through torch), so that a collective that
    waits for a lost peer returns with an error; run from the heartbeat's thread while the main
    thread may wait in one. gloo's waits end when the lost peer's sockets close (the supervisor
    ends that process first), so its groups are left to `leave_generation`."""
    if not dist.is_initialized() or not torch.cuda.is_available():
        return
    device = torch.device("cuda")
    for group in list(dist.distributed_c10d._world.pg_names):
        try:
            backend = group._get_backend(device)
        except RuntimeError:  # a group without a CUDA backend (gloo)
            continue
        if isinstance(backend, dist.ProcessGroupNCCL):
            backend.abort()


def leave_generation() -> None:
    """Destroy every process group of this process (the default one too): the next generation
    creates its own, with the group counter back at zero as a new process has it."""
    if dist.is_initialized():
        dist.destroy_process_group()


def rejoin(exc: BaseException, env: LaunchEnv, beat: Heartbeat, in_place: bool, wait_s: float) -> LaunchEnv:
    """The launch environment of the next generation, once the supervisor says; re-raises `exc`
    when this rank does not recover in place (see the module doc) or no word comes in `wait_s`."""
    link = env.supervisor
    if not in_place or link is None or isinstance(exc, NOT_IN_PLACE) or not isinstance(exc, Exception):
        raise exc
    log.warning("rank %d: %s: %s; waiting to recover in place", env.rank, type(exc).__name__, exc)
    beat.lost(exc)
    beat.restart()
    leave_generation()
    word = beat.await_rejoin(wait_s)
    if word is None:
        log.error("rank %d: no word from the supervisor within %g s: exiting", env.rank, wait_s)
        raise exc
    link = dataclasses.replace(link, generation=int(word["generation"]), attempt=int(word["attempt"]))
    return dataclasses.replace(env, master_port=int(word["port"]), store_rank=int(word["store_rank"]),
                               supervisor=link)
