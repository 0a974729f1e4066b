"""A run directory claimed by the run that trains in it, before anything is written there: the
supervisor's lock inherited by its ranks, or taken by rank 0 for ranks started without one."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import torch

from mshpc.launch.rendezvous import DistInfo
from mshpc.launch.runtime import Runtime
from mshpc.parallel import comm
from mshpc.run_lock import (
    LOCK_FILE,
    RunLockError,
    check_run_lock,
    hold_run_lock,
    inherited_token,
    read_holder,
    token_digest,
)


@contextmanager
def claim_run_dir(run_dir: Path, info: DistInfo, rt: Runtime) -> Iterator[None]:
    """Make sure this rank's run holds run_dir before anything is written there. Ranks started by
    a holder (the supervisor) inherit its token and check it against the lock file; without one
    (a single process, or ranks of srun, mpiexec or torchrun alone) rank 0 takes the lock for the
    run, and the world agrees on it collectively, so every rank fails alike if it cannot."""
    token = inherited_token()
    if token is not None:
        check_run_lock(run_dir, token)
        yield
        return
    with ExitStack() as held:
        error = None
        if info.rank == 0:
            try:
                token = held.enter_context(hold_run_lock(run_dir)).token
            except RunLockError as exc:
                error = exc
        comm.raise_if_any_failed(error, "taking the run directory's lock")
        _check_rank0_holds(run_dir, token, rt)
        yield


def _check_rank0_holds(run_dir: Path, token: str | None, rt: Runtime) -> None:
    """Collective over the world: rank 0's token, as a digest summed with the others' zeros (one
    all-reduce on any backend), must be the one the lock file names on every rank."""
    digest = torch.tensor([token_digest(token) if token else 0], dtype=torch.int64, device=rt.device)
    comm.all_reduce(digest)
    holder = read_holder(run_dir / LOCK_FILE)
    if holder is None or token_digest(holder.token) != digest.item():
        who = holder.describe() if holder else "nobody"
        raise RunLockError(f"{run_dir}: rank 0 took {run_dir / LOCK_FILE}, "
                           f"but this rank sees it held by {who}")
