"""comm's reduce-scatter and all-gather on gloo ranks, at sizes that gloo's path cuts into
several messages (and a last, shorter one), and their entries in the flight recorder."""

import torch
import torch.distributed as dist

from mshpc.cpu_ranks.gloo_p2p import GLOO_MESSAGE_BYTES
from mshpc.parallel import comm
from support.rank_runner import run_ranks

N = GLOO_MESSAGE_BYTES // 4 * 2 + 1000  # per-rank fp32 elements: 3 pieces, the last short


def collectives(rank: int, world: int, members: list[int] | None = None) -> dict:
    """Over `members` (global ranks; None: the world); ranks outside return {}."""
    group = None if members is None else dist.new_group(members)
    if members is not None and rank not in members:
        return {}
    size, me = (world, rank) if members is None else (len(members), members.index(rank))

    def data(r: int) -> torch.Tensor:  # what group rank r contributes, knowable by every rank
        return torch.arange(size * N, dtype=torch.float32) * (r + 1)

    out = torch.empty(N)
    work = comm.reduce_scatter(out, data(me), group, async_op=True)
    work.wait()
    expected = sum(data(r) for r in range(size))[me * N:(me + 1) * N]
    gathered = torch.empty(size * N, dtype=torch.bfloat16)
    comm.all_gather(gathered, torch.full((N,), float(me), dtype=torch.bfloat16), group)
    ops = [r.op for r in comm.RECORDER.snapshot()]
    return {"reduce_scatter": torch.equal(out, expected),
            "all_gather": torch.equal(gathered.view(size, N)[:, 0], torch.arange(size, dtype=torch.bfloat16))
            and torch.equal(gathered.view(size, N), gathered.view(size, N)[:, :1].expand(size, N)),
            "recorded": ops[-2:] == ["reduce_scatter", "all_gather"]}


def test_reduce_scatter_and_all_gather_in_pieces_are_exact():
    for result in run_ranks(collectives, 2):
        assert result == {"reduce_scatter": True, "all_gather": True, "recorded": True}


def test_the_same_on_three_ranks_and_on_a_subgroup():
    # three ranks: each piece's sum has three terms; the subgroup [0, 2]: group ranks are not
    # global ranks, so every message must find its peer through the group
    for members in (None, [0, 2]):
        results = run_ranks(collectives, 3, members)
        ours = results if members is None else [results[r] for r in members]
        assert ours == [{"reduce_scatter": True, "all_gather": True, "recorded": True}] * len(ours)
