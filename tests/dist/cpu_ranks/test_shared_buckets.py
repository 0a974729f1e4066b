"""ZeRO's buckets in shared memory (mshpc/cpu_ranks/shared_buckets.py), on gloo ranks of this host:
the collectives give the point-to-point transport's results bitwise, nothing is left in /dev/shm, ranks
that cannot share fall back to private memory, and the engine trains bitwise as without."""

from pathlib import Path

import torch
import torch.distributed as dist

from mshpc.config import ModelConfig, OptimConfig, ParallelConfig
from mshpc.model.gpt import GPT, loss_fn
from mshpc.cpu_ranks import shared_buckets as host_shared
from mshpc.parallel import comm
from mshpc.parallel.zero_build import build_zero_engine
from support.rank_runner import run_ranks

N = 3000  # per-rank elements of the test's buffer: not a multiple of a page


def _ours(shm_dir: str) -> list[str]:
    return sorted(p.name for p in Path(shm_dir).glob("mshpc-*"))


def collectives(rank: int, world: int, members: list[int] | None, shm_dir: str) -> dict:
    """Over `members` (global ranks; None: the world); ranks outside return {}."""
    host_shared.SHM_DIR = Path(shm_dir)
    group = None if members is None else dist.new_group(members)
    if members is not None and rank not in members:
        return {}
    size, me = (world, rank) if members is None else (len(members), members.index(rank))
    shared = host_shared.map_buffers([(size * N, torch.float32), (size * N, torch.bfloat16)], group)
    assert shared is not None
    left = _ours(shm_dir)
    grads, params = shared.local
    zeroed = bool((grads == 0).all() and (params == 0).all())
    data = torch.randn(size * N, generator=torch.Generator().manual_seed(rank)) * 1e3
    grads.copy_(data)
    expected = torch.empty(N)
    comm.reduce_scatter(expected, data, group)
    host_shared.reduce_scatter(shared, 0, grads.view(size, N)[me]).wait()  # in place, as ZeRO does
    source = torch.randn(N, generator=torch.Generator().manual_seed(10 + rank)).to(torch.bfloat16)
    gathered = torch.empty(size * N, dtype=torch.bfloat16)
    comm.all_gather(gathered, source, group)
    host_shared.all_gather(shared, 1, source).wait()
    ops = [r.op for r in comm.RECORDER.snapshot()]
    return {"zeroed": zeroed, "files_left": left,
            "reduce_scatter": torch.equal(grads.view(size, N)[me], expected),
            "all_gather": torch.equal(params, gathered),
            # each shared collective recorded after its point-to-point twin
            "recorded": ops[-4:] == ["reduce_scatter"] * 2 + ["all_gather"] * 2}


def test_shared_collectives_equal_the_point_to_point_ones_bitwise(tmp_path):
    # two ranks (one add), three (a three-term sum in rank order) and the subgroup [0, 2] of
    # three, whose group ranks are not global ranks
    good = {"zeroed": True, "files_left": [], "reduce_scatter": True, "all_gather": True, "recorded": True}
    for world, members in ((2, None), (3, None), (3, [0, 2])):
        results = run_ranks(collectives, world, members, str(tmp_path))
        ours = results if members is None else [results[r] for r in members]
        assert ours == [good] * len(ours)
    assert _ours(str(tmp_path)) == []


def separate_dirs(rank: int, world: int, root: str) -> dict:
    # each rank its own directory: the ranks of two hosts, whose /dev/shm are not each other's
    host_shared.SHM_DIR = Path(root) / f"host{rank}"
    host_shared.SHM_DIR.mkdir()
    shared = host_shared.map_buffers([(8, torch.float32)], None)
    return {"shared": shared is not None, "files_left": _ours(str(host_shared.SHM_DIR))}


def one_rank_without_room(rank: int, world: int, root: str) -> dict:
    host_shared.SHM_DIR = Path(root) / ("missing" if rank == 1 else "")
    shared = host_shared.map_buffers([(8, torch.float32)], None)
    return {"shared": shared is not None, "files_left": _ours(root)}


def test_ranks_that_cannot_share_fall_back_and_leave_nothing(tmp_path):
    assert run_ranks(separate_dirs, 2, str(tmp_path)) == [{"shared": False, "files_left": []}] * 2
    assert run_ranks(one_rank_without_room, 2, str(tmp_path)) == [{"shared": False, "files_left": []}] * 2


TINY = ModelConfig(vocab_size=64, seq_len=16, n_layer=2, n_head=2, d_model=32)


def train(rank: int, world: int, shm_dir: str) -> dict:
    host_shared.SHM_DIR = Path(shm_dir)
    out = {}
    for shared in (True, False):
        torch.manual_seed(0)
        parallel = ParallelConfig(dp=world, bucket_mb=16 / 1024, dp_shared_memory=shared)
        engine = build_zero_engine(GPT(TINY), OptimConfig(lr=1e-2, grad_clip=0.05), parallel)
        losses = []
        for step in range(3):
            batch = torch.randint(0, TINY.vocab_size, (2, TINY.seq_len + 1),
                                  generator=torch.Generator().manual_seed(100 * step + rank))
            loss = loss_fn(engine.model(batch[:, :-1]), batch[:, 1:])
            engine.backward(loss)
            engine.step(0.05)
            losses.append(loss.item())
        engine.wait_params()
        out[shared] = {"mapped": engine.shared, "losses": losses,
                       "params": torch.cat([p.detach().reshape(-1) for p in engine.model.parameters()])}
    return {"mapped": [out[True]["mapped"], out[False]["mapped"]],
            "same_losses": out[True]["losses"] == out[False]["losses"],
            "same_params": torch.equal(out[True]["params"], out[False]["params"]),
            "buckets": len(engine.buckets)}


def test_zero_trains_bitwise_as_over_gloo(tmp_path):
    for result in run_ranks(train, 2, str(tmp_path)):
        assert result["mapped"] == [True, False]
        assert result["same_losses"] and result["same_params"]
        assert result["buckets"] > 1
