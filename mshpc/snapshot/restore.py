"""Restore in place: at the start of a new generation every rank agrees on the newest step of
which every rank's snapshot is whole somewhere (its own slots for a rank that lived on, its
buddy's copy for a replacement), the buddies send the replacements their slots, and every rank
installs its snapshot of that step.

Nothing here trusts a slot it has not checked: each offer is a slot that is sealed and passes
its checksum where it lies, and a replacement checks the one it received again. When no step is
whole for every rank (a rank and its buddy both lost, or their copies failing their checksums),
every rank raises SnapshotsUnusable with the reason, and the supervisor restarts from disk.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch.distributed as dist

from mshpc.errors import SnapshotsUnusable
from mshpc.parallel import comm
from mshpc.snapshot.placement import Buddies
from mshpc.snapshot.slot import Slot, SlotLayout, private_buffer
from mshpc.snapshot.state import TrainState, install


@dataclass
class Held:
    """The slots a process keeps across a generation change: its own (none in a replacement)
    and its wards'."""

    own: list[Slot] = field(default_factory=list)
    wards: dict[int, list[Slot]] = field(default_factory=dict)


@dataclass(frozen=True)
class Restored:
    step: int
    fetched_from: int | None  # the buddy this rank's snapshot came from (a replacement), else None
    problems: tuple[str, ...]  # slots found unusable on the way, in words (the event carries them)


def _offer(held: Held) -> dict[str, object]:
    """What this rank can restore from: the steps of its own whole slots and of each ward's, and
    the words for every slot that is not whole (an empty one says nothing)."""
    problems: list[str] = []
    own = _whole(held.own, "own", problems)
    wards = {str(ward): _whole(slots, f"rank {ward}'s", problems) for ward, slots in held.wards.items()}
    return {"alive": bool(held.own), "own": own, "wards": wards, "problems": problems}


def _whole(slots: list[Slot], whose: str, problems: list[str]) -> list[int]:
    """The steps of the whole slots; the others' problems appended in words."""
    steps = []
    for slot in slots:
        why = slot.problem()
        if why is None:
            steps.append(slot.step)
        elif why != "empty":
            problems.append(f"{whose} step {slot.step}: {why}")
    return steps


def choose_step(offers: list[dict], buddies: Buddies) -> tuple[int | None, str]:
    """The newest step every rank has whole, and in words why there is none: a pure function
    of every rank's offer, so each rank decides alike without another round."""
    common: set[int] | None = None
    for rank, offer in enumerate(offers):
        if offer["alive"]:
            steps = set(offer["own"])
        else:
            keeper = buddies.buddy[rank]
            if not offers[keeper]["alive"]:
                return None, f"rank {rank} and its buddy rank {keeper} were both lost"
            steps = set(offers[keeper]["wards"].get(str(rank), []))
        if not steps:
            return None, f"no whole snapshot of rank {rank} is left"
        common = steps if common is None else common & steps
    if not common:
        return None, "the ranks' whole snapshots have no step in common"
    return max(common), ""


def restore_in_place(held: Held, layout: SlotLayout, state: TrainState, buddies: Buddies,
                     group: dist.ProcessGroup, pinned: bool) -> Restored:
    """Install the newest common snapshot on this rank; collective over `group` (gloo, the whole
    world) and the engine's dp group. Raises SnapshotsUnusable on every rank alike."""
    rank = dist.get_rank(group)
    offer = _offer(held)
    offers = comm.all_gather_json(offer, group)
    step, why = choose_step(offers, buddies)
    problems = tuple(p for o in offers for p in o["problems"])
    if step is None:
        raise SnapshotsUnusable(f"no in-memory snapshot to recover in place from: {why}"
                                + (f" ({'; '.join(problems)})" if problems else ""))
    slot, error = _fetch(held, layout, step, offers, buddies, rank, group, pinned)
    comm.raise_if_any_failed(SnapshotsUnusable(error) if error else None, "receiving a snapshot from a buddy", group)
    install(slot.tensors(), slot.extras(), state)
    fetched = None if offer["alive"] else buddies.buddy[rank]
    return Restored(step, fetched, problems)


def _fetch(held: Held, layout: SlotLayout, step: int, offers: list[dict], buddies: Buddies, rank: int,
           group: dist.ProcessGroup, pinned: bool) -> tuple[Slot, str | None]:
    """This rank's slot of `step`: its own, or received from its buddy; meanwhile it sends each
    replaced ward its slot. Point to point over `group`; the error in words, or None."""
    sends = [(_of_step(slots, step).buffer, ward) for ward, slots in held.wards.items()
             if not offers[ward]["alive"]]
    if offer_alive := offers[rank]["alive"]:
        slot = _of_step(held.own, step)
    else:
        slot = Slot(layout, private_buffer(layout.nbytes, pinned))
    recvs = [] if offer_alive else [(slot.buffer, buddies.buddy[rank])]
    works = [comm.isend(t, peer, group) for t, peer in sends] + [comm.irecv(t, peer, group) for t, peer in recvs]
    for work in works:
        work.wait()
    why = slot.problem()
    if why is not None:
        return slot, f"rank {rank}'s snapshot of step {step} from rank {buddies.buddy[rank]}: {why}"
    if slot.step != step:
        return slot, f"rank {rank} received step {slot.step}, not {step}"
    return slot, None


def _of_step(slots: list[Slot], step: int) -> Slot:
    return next(s for s in slots if s.problem() is None and s.step == step)
