"""A snapshot slot is trusted only sealed, of its own layout and with its checksum intact."""

import pytest
import torch

from mshpc.snapshot.slot import EMPTY, SEALED, Slot, SlotLayout, private_buffer


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"master/w": torch.randn(7, 3, generator=g), "optim.exp_avg/w": torch.randn(21, generator=g),
            "optim.step": torch.tensor([5.0]), "rng/cpu": torch.get_rng_state()}


def _sealed(state: dict[str, torch.Tensor], step: int = 5) -> Slot:
    layout = SlotLayout.of(state)
    slot = Slot(layout, private_buffer(layout.nbytes, pinned=False))
    slot.begin(step, {"step": step, "scheduler": {"last_epoch": step}})
    for name, view in slot.tensors().items():
        view.copy_(state[name])
    slot.seal()
    return slot


def test_a_sealed_slot_gives_back_every_tensor_and_the_extras_bitwise():
    state = _state()
    slot = _sealed(state)
    assert slot.problem() is None and slot.state == SEALED and slot.step == 5
    assert slot.extras() == {"step": 5, "scheduler": {"last_epoch": 5}}
    for name, view in slot.tensors().items():
        assert view.dtype == state[name].dtype and torch.equal(view, state[name])
    offsets = [e.offset for e in slot.layout.entries]
    assert all(o % 64 == 0 for o in offsets) and offsets == sorted(offsets)


@pytest.mark.parametrize("where", ["tensor", "extras", "padding"])
def test_one_flipped_bit_anywhere_past_the_header_fails_the_checksum(where):
    slot = _sealed(_state())
    entry = slot.layout.entries[0]
    at = {"tensor": entry.offset + 9, "extras": 64 + 3, "padding": entry.offset + entry.nbytes + 1}[where]
    slot.buffer[at] ^= 0x10
    assert slot.problem() == "failed its checksum"


def test_a_slot_cut_short_or_empty_or_of_another_layout_is_refused():
    state = _state()
    slot = _sealed(state)
    slot.begin(6, {"step": 6})  # a crash here leaves it WRITING
    assert slot.problem() == "cut short while being written"
    slot.invalidate()
    assert slot.state == EMPTY and slot.problem() == "empty"
    other = _sealed({**state, "master/w": torch.zeros(3, 7)})  # same bytes, another shape
    as_mine = Slot(slot.layout, other.buffer)
    assert as_mine.problem() == "of another state layout"
    kept = Slot(SlotLayout.opaque_of(other.layout.nbytes), other.buffer)  # a buddy checks bytes only
    assert kept.problem() is None and kept.step == 5


def test_the_step_is_part_of_the_checksum():
    slot = _sealed(_state(), step=5)
    slot.buffer[16:24].view(torch.int64)[0] = 6  # the header's step word
    assert slot.problem() == "failed its checksum"


def test_extras_too_large_for_the_slot_are_an_error_not_a_truncation():
    slot = _sealed(_state())
    with pytest.raises(ValueError, match="exceed the slot"):
        slot.begin(7, {"blob": "x" * 70_000})
