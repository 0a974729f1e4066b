"""Pipeline parallelism on gloo ranks against single-rank training of the same model and global
batch: pp=2 (1F1B, GPipe), pp=2 with 2 virtual stages (interleaved 1F1B), dp=2 x pp=2,
tp=2 x pp=2 and dp=2 x tp=2 x pp=2.

Each layout is one spawn (module fixtures) that runs its cases and returns numbers; every rank
also trains the single-rank reference itself, so nothing but JSON crosses process boundaries.
Tolerance: the pipeline computes the same fp32 sums as the reference, but in another order
(micro-batch accumulation, dp reduce-scatter, the norm's partial sums; under tp also each
row-parallel GEMM's inner sum), which moves results by a few ulp per step: losses and norms
agree within 1e-5 relative and weights within 1e-5 absolute after 3 steps at lr 1e-2, ~1e-7 on
average. AdamW's eps is 1e-6, as in test_tensor_parallel.py: at 1e-8 an element whose gradient
is at rounding level gets a step of about +-lr whichever way rounding tipped it (3e-5 seen
under tp). A real error (a lost micro-batch, a missed embedding gradient) moves the weights by
~1e-3 on average and ~1e-2 at most.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from mshpc.batch import Batch
from mshpc.config import Config, ModelConfig, OptimConfig, ParallelConfig, TrainConfig
from mshpc.mesh_shape import MeshShape
from mshpc.parallel import comm
from mshpc.parallel.apply import apply_tp
from mshpc.parallel.mesh import Mesh, build_mesh
from mshpc.parallel.pipeline import TIED, build_pipeline, pipeline_train_step
from mshpc.parallel.schedules import peak_live
from support.rank_runner import run_ranks
from support.single_rank import train_single_rank

TINY = ModelConfig(vocab_size=64, seq_len=16, n_layer=4, n_head=2, d_model=32)
GLOBAL_BATCH = 8
MICRO_BATCHES = 4  # train.grad_accum: pp=2 with 2 virtual stages needs a multiple of 2
STEPS = 3
GRAD_CLIP = 0.05  # below these steps' gradient norms: clipping acts in every step


def optim_cfg(name: str) -> OptimConfig:
    return OptimConfig(name=name, lr=1e-2, weight_decay=0.1, grad_clip=GRAD_CLIP, eps=1e-6)


def batch(step: int) -> torch.Tensor:
    return torch.randint(0, TINY.vocab_size, (GLOBAL_BATCH, TINY.seq_len + 1),
                         generator=torch.Generator().manual_seed(100 + step))


def config(world: int, pp: int, v: int, schedule: str, name: str, overlap: bool = True, tp: int = 1) -> Config:
    dp = world // pp // tp
    parallel = ParallelConfig(dp=dp, tp=tp, pp=pp, virtual_stages=v, pp_schedule=schedule, dp_overlap=overlap,
                              bucket_mb=16 / 1024)  # 16 KiB: several buckets per stage
    train = TrainConfig(micro_batch=GLOBAL_BATCH // dp // MICRO_BATCHES, grad_accum=MICRO_BATCHES)
    return Config(model=TINY, parallel=parallel, optim=optim_cfg(name), train=train)


def reference_params(cfg: Config, mesh: Mesh, model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The reference's parameters under the names and tp slicing of the pipeline's."""
    if cfg.parallel.tp > 1:
        apply_tp(model, mesh.tp, cfg.parallel)  # the same slices of the reference's weights
    return dict(model.named_parameters()) | {TIED[1]: model.lm_head.weight}


def train_case(rank: int, cfg: Config) -> dict:
    p = cfg.parallel
    mesh = build_mesh(MeshShape(pp=p.pp, dp=p.dp, tp=p.tp))
    coords = mesh.coords
    torch.manual_seed(0)
    pipe = build_pipeline(mesh, torch.device("cpu"), None, model_cfg=cfg.model, parallel=cfg.parallel,
                          train=cfg.train, optim=cfg.optim)
    initial = {n: q.detach().clone() for n, q in pipe.model.named_parameters()}
    per_rank = GLOBAL_BATCH // p.dp
    losses, norms = [], []
    for step in range(STEPS):
        local = batch(step)[coords.dp * per_rank:(coords.dp + 1) * per_rank]
        before = comm.RECORDER.snapshot()[-1].seq
        loss, norm = pipeline_train_step(pipe, Batch(local), train=cfg.train, optim=cfg.optim, parallel=cfg.parallel)
        losses.append(loss.item())
        norms.append(norm.item())
    p2p = [r.op[:4] for r in comm.RECORDER.snapshot() if r.seq > before and r.op[:4] in ("send", "recv")]
    planned = [a.op.split("_")[0] for a in pipe.runner.plan if a.op.startswith(("send", "recv"))]
    pipe.engine.wait_params()
    ref_model, _, ref_losses, ref_norms = train_single_rank(TINY, cfg.optim, batch, STEPS)
    ref = reference_params(cfg, mesh, ref_model)
    mine = dict(pipe.model.named_parameters())
    tied = {n: mine[n].flatten().tolist() for n in TIED if n in mine}
    return {"losses": losses, "norms": norms, "ref_losses": ref_losses, "ref_norms": ref_norms,
            "names": sorted(mine), "tied": tied, "p2p_recorded": sorted(p2p) == sorted(planned) and len(p2p) > 0,
            "pp_rank": coords.pp, "replica": [coords.dp, coords.tp], "schedule": (p.pp_schedule, p.virtual_stages), "peak_live": pipe.runner.peak_live, "plan_peak_live": peak_live(pipe.runner.plan),
            "param_diff": max((mine[n] - ref[n]).abs().max().item() for n in mine),
            "param_mean_diff": max((mine[n] - ref[n]).abs().mean().item() for n in mine),
            "moved": min((mine[n] - initial[n]).abs().max().item() for n in mine)}


CASES = {  # world -> case name -> config arguments after world
    2: {"1f1b": (2, 1, "1f1b", "adamw"), "gpipe": (2, 1, "gpipe", "adamw"), "lamb": (2, 1, "1f1b", "lamb"),
        "interleaved": (2, 2, "1f1b", "adamw"), "interleaved-no-overlap": (2, 2, "1f1b", "adamw", False)},
    4: {"dp2-1f1b": (2, 1, "1f1b", "adamw"), "dp2-interleaved": (2, 2, "1f1b", "adamw"),
        "tp2-1f1b": (2, 1, "1f1b", "adamw", True, 2), "tp2-interleaved-lamb": (2, 2, "1f1b", "lamb", True, 2)},
    8: {"dp2-tp2-1f1b": (2, 1, "1f1b", "adamw", True, 2), "dp2-tp2-interleaved": (2, 2, "1f1b", "adamw", True, 2)},
}


def cases(rank: int, world: int) -> dict:
    out = {name: train_case(rank, config(world, *args)) for name, args in CASES[world].items()}
    dist.barrier()
    return out


@pytest.fixture(scope="module")
def pp2() -> list[dict]:
    return run_ranks(cases, 2, timeout_s=240)


@pytest.fixture(scope="module")
def world4() -> list[dict]:
    return run_ranks(cases, 4, timeout_s=400)


@pytest.fixture(scope="module")
def world8() -> list[dict]:
    return run_ranks(cases, 8, timeout_s=600)


@pytest.fixture(params=[(w, c) for w in CASES for c in CASES[w]], ids=lambda p: f"world{p[0]}-{p[1]}")
def case(request) -> tuple[str, list[dict]]:
    world, name = request.param
    ranks = request.getfixturevalue({2: "pp2", 4: "world4", 8: "world8"}[world])
    return name, [r[name] for r in ranks]


def test_loss_curve_and_parameters_match_single_rank_training(case):
    name, ranks = case
    for rank, r in enumerate(ranks):
        assert r["losses"] == pytest.approx(r["ref_losses"], rel=1e-5), (name, rank)
        assert r["param_diff"] < 1e-5 and r["param_mean_diff"] < 1e-6, (name, rank)
        assert r["moved"] > 1e-4  # every parameter moved by 10x the tolerance: no match of idle weights


def test_clipping_uses_the_global_norm_over_every_stage(case):
    name, ranks = case
    for rank, r in enumerate(ranks):
        assert min(r["ref_norms"]) > GRAD_CLIP  # clipping really acted
        assert r["norms"] == pytest.approx(r["ref_norms"], rel=1e-5), (name, rank)


def test_stages_own_disjoint_layers_under_full_model_names(pp2):
    first, last = pp2[0]["interleaved"]["names"], pp2[1]["interleaved"]["names"]
    assert not set(first) & set(last)
    # interleaved: rank 0 runs stages 0 and 2 (layers 0 and 2), rank 1 stages 1 and 3
    assert {n.split(".")[1] for n in first if n.startswith("layers.")} == {"0", "2"}
    assert {n.split(".")[1] for n in last if n.startswith("layers.")} == {"1", "3"}
    assert "tok_embeddings.weight" in first and {"norm.weight", "lm_head.weight"} <= set(last)


def test_tied_embeddings_stay_identical_on_first_and_last_stage(case):
    name, ranks = case
    first = {tuple(r["replica"]): r["tied"] for r in ranks if r["pp_rank"] == 0}
    last = {tuple(r["replica"]): r["tied"] for r in ranks if r["pp_rank"] == 1}
    assert first.keys() == last.keys() and len(first) == len(ranks) // 2
    for replica in first:  # the same dp (and tp) coordinates on the first and the last stage
        assert first[replica][TIED[0]] == last[replica][TIED[1]], (name, replica)  # bitwise, after 3 steps


def test_each_stage_holds_the_activations_its_schedule_promises(case):
    # measured while running (stage inputs whose backward has not run), equal to the plan's
    # count, which test_schedules checks against 1F1B's p - s and Megatron's interleaved bound
    name, ranks = case
    for r in ranks:
        assert r["peak_live"] == r["plan_peak_live"], name
        pp, s, m = 2, r["pp_rank"], MICRO_BATCHES
        want = {("gpipe", 1): m, ("1f1b", 1): pp - s, ("1f1b", 2): 2 * (pp - s - 1) + pp + 1}[tuple(r["schedule"])]
        assert r["peak_live"] == want, (name, s)


def test_every_send_and_receive_goes_through_the_flight_recorder(case):
    name, ranks = case
    assert all(r["p2p_recorded"] for r in ranks), name
