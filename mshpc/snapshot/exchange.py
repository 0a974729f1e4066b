"""How a rank's buddy gets a copy of each of its snapshots (mshpc/snapshot/placement.py says who).

Two ways, chosen once per generation by every rank alike and logged:
  send    after each seal, the slot goes to the buddy over a gloo group of its own (a thread's
          point-to-point send and receive: this rank ships its slot to its buddy and receives
          its ward's), into two slots the buddy keeps for it. The way between hosts, and the
          GPU way (the slots are pinned host memory, so NCCL's traffic is untouched).
  shared  CPU ranks whose buddies share their host (the local launcher's simulated nodes): each
          rank's own two slots are files in /dev/shm without a name (O_TMPFILE), which its buddy
          maps too through the owner's descriptor, checked as ZeRO's shared buckets check theirs
          (mshpc/cpu_ranks/shared_buckets.py). A snapshot then reaches the buddy by being written:
          the copy a send would make costs this machine's only cores, while a GPU node sends
          with cores and a link the step does not use. The pages live while either process maps
          them, so a rank's state outlives it in its buddy, and dies with both, as across hosts.
"""

from __future__ import annotations

import logging
import os

import torch
import torch.distributed as dist

from mshpc.cpu_ranks.shared_buckets import SHM_DIR, create_unnamed, identity, map_peer
from mshpc.parallel import comm
from mshpc.snapshot.placement import Buddies
from mshpc.snapshot.slot import Slot, SlotLayout, private_buffer
from mshpc.snapshot.store import Exchange

log = logging.getLogger(__name__)


class SendExchange:
    """Ships each sealed slot to the buddy and receives the ward's into the slot of the same index."""

    def __init__(self, group: dist.ProcessGroup, rank: int, buddy: int, ward: int, wards: list[Slot]) -> None:
        self.group, self.rank, self.buddy, self.ward, self.wards = group, rank, buddy, ward, wards

    def ship(self, index: int, slot: Slot) -> None:
        """Collective over the exchange's group (each rank ships its slot of the same index)."""
        if self.buddy == self.rank:
            return
        target = self.wards[index]
        target.invalidate()  # until the whole slot has arrived
        try:
            works = [comm.isend(slot.buffer, self.buddy, self.group), comm.irecv(target.buffer, self.ward, self.group)]
            for work in works:
                work.wait()
        except BaseException:
            target.invalidate()  # a part may have landed: not a slot to restore from
            raise

    def held(self) -> dict[int, list[Slot]]:
        return {} if self.buddy == self.rank else {self.ward: self.wards}

    def close(self) -> None:
        pass


class SharedExchange:
    """The ward's slots are its own files in /dev/shm, mapped here: nothing to ship."""

    def __init__(self, ward: int, wards: list[Slot]) -> None:
        self.ward, self.wards = ward, wards

    def ship(self, index: int, slot: Slot) -> None:
        pass

    def held(self) -> dict[int, list[Slot]]:
        return {self.ward: self.wards}

    def close(self) -> None:
        pass


def build_exchange(layout: SlotLayout, buddies: Buddies, group: dist.ProcessGroup, pinned: bool,
                   shared: bool) -> tuple[list[Slot], Exchange]:
    """This rank's two own slots and its exchange. Collective over `group` (every rank, gloo):
    shared memory where `shared` (CPU ranks) and every buddy can map its ward's files, else sends."""
    rank = dist.get_rank(group)
    sizes = comm.all_gather_json(layout.nbytes, group)
    buddy, ward = buddies.buddy[rank], buddies.ward[rank]
    opaque = SlotLayout.opaque_of(sizes[ward])
    if shared and not pinned:
        mapped = _map_shared(layout, opaque, rank, ward, group)
        if mapped is not None:
            own, wards = mapped
            log.debug("snapshots: rank %d's slots in shared memory, mapped by its buddy %d", rank, buddy)
            return own, SharedExchange(ward, wards)
    own = [Slot(layout, private_buffer(layout.nbytes, pinned)) for _ in range(2)]
    wards = [Slot(opaque, private_buffer(opaque.nbytes, pinned)) for _ in range(2)] if buddy != rank else []
    return own, SendExchange(group, rank, buddy, ward, wards)


def _map_shared(layout: SlotLayout, opaque: SlotLayout, rank: int, ward: int,
                group: dist.ProcessGroup) -> tuple[list[Slot], list[Slot]] | None:
    """Each rank creates its two slot buffers without a name and announces them; its buddy maps
    them through the owner's descriptors, then the descriptors close (the mappings keep the pages).
    None, on every rank alike, when any rank could not create its buffers or map its ward's."""
    fds = [create_unnamed(layout.nbytes) for _ in range(2)]
    try:
        everyone = comm.all_gather_json([identity(fd) for fd in fds], group)
        own: list[Slot | None] = []
        wards: list[Slot | None] = []
        if all(who is not None for ids in everyone for who in ids):
            me = everyone[rank][0]
            own = [_map(fd, who, me, layout) for fd, who in zip(fds, everyone[rank], strict=True)]
            wards = [_map(None, who, me, opaque) for who in everyone[ward]]
        ok = bool(own) and all(s is not None for s in [*own, *wards])
        agreed = all(comm.all_gather_json(ok, group))  # and every buddy has mapped: the descriptors may close
    finally:
        for fd in fds:
            if fd is not None:
                os.close(fd)
    if not agreed:
        log.info("snapshots: not every buddy shares its ward's host (%s): slots are sent", SHM_DIR)
        return None
    return [s for s in own if s is not None], [s for s in wards if s is not None]


def _map(own: int | None, who: dict, me: dict, layout: SlotLayout) -> Slot | None:
    mapped = map_peer(own, who, me, layout.nbytes)
    return None if mapped is None else Slot(layout, torch.frombuffer(mapped, dtype=torch.uint8))  # keeps the map
