"""comm's reduce-scatter and all-gather on gloo ranks, at sizes that gloo's path cuts into
several messages (and a last, shorter one), and their entries in the flight recorder."""

import torch

from mshpc.parallel import comm
from support.rank_runner import run_ranks

N = comm.GLOO_MESSAGE_BYTES // 4 * 2 + 1000  # per-rank fp32 elements: 3 pieces, the last short


def collectives(rank: int, world: int) -> dict:
    def data(r: int) -> torch.Tensor:  # what rank r contributes, knowable by every rank
        return torch.arange(world * N, dtype=torch.float32) * (r + 1)

    out = torch.empty(N)
    work = comm.reduce_scatter(out, data(rank), async_op=True)
    work.wait()
    expected = sum(data(r) for r in range(world))[rank * N:(rank + 1) * N]
    gathered = torch.empty(world * N, dtype=torch.bfloat16)
    comm.all_gather(gathered, torch.full((N,), float(rank), dtype=torch.bfloat16))
    ops = [r.op for r in comm.RECORDER.snapshot()]
    return {"reduce_scatter": torch.equal(out, expected),
            "all_gather": torch.equal(gathered.view(world, N)[:, 0], torch.arange(world, dtype=torch.bfloat16))
            and torch.equal(gathered.view(world, N), gathered.view(world, N)[:, :1].expand(world, N)),
            "recorded": ops[-2:] == ["reduce_scatter", "all_gather"]}


def test_reduce_scatter_and_all_gather_in_pieces_are_exact():
    for result in run_ranks(collectives, 2):
        assert result == {"reduce_scatter": True, "all_gather": True, "recorded": True}
