"""The step-time model: the pipeline bubble against its closed forms, and the overlap and
communication rules on cases small enough to work by hand."""

import dataclasses

import pytest

from mshpc.config import load_config
from mshpc.diagnose.mfu import flops_per_token
from mshpc.plan.devices import DEVICES, device_spec
from mshpc.plan.layout import Layout
from mshpc.plan.steptime import bubble_fraction, dp_exposed_s, step_time, tp_exposed_s
from support.cli_runner import REPO

CFG = load_config(REPO / "configs/gpt-175b.yaml")
# links and memory so fast that only compute and the bubble remain
IDEAL = dataclasses.replace(DEVICES["h100"], intra_gbps=1e12, inter_gbps=1e12, hbm_gbps=1e12)
SECTIONS = dict(model_cfg=CFG.model, parallel=CFG.parallel)


def sections(cfg):
    return cfg.model, cfg.parallel


def layout(**kw):
    base = dict(dp=1, tp=8, pp=8, virtual_stages=1, micro_batch=1, n_micro=64, checkpointing="none")
    return Layout(**{**base, **kw})


@pytest.mark.parametrize("p,m,v", [(8, 64, 1), (4, 8, 1), (8, 64, 2), (8, 16, 4), (2, 2, 1)])
def test_bubble_matches_narayanan(p, m, v):
    # 1F1B: (p-1)/(m+p-1); interleaved: (p-1)/(v*m+p-1) (bubble (p-1)/(v m) of the ideal time)
    expected = (p - 1) / (m + p - 1) if v == 1 else (p - 1) / (v * m + p - 1)
    assert bubble_fraction(p, m, v) == pytest.approx(expected)
    # the full model, with communication made free, has exactly that bubble
    got = step_time(layout(pp=p, n_micro=m, virtual_stages=v), IDEAL, 8, **SECTIONS)
    assert got.bubble_fraction == pytest.approx(expected, rel=1e-6)


def test_mfu_is_the_efficiency_when_nothing_but_compute_remains():
    one = layout(pp=1, tp=1, n_micro=4)
    t = step_time(one, IDEAL, 8, **SECTIONS)
    assert t.mfu == pytest.approx(IDEAL.gemm_efficiency, rel=1e-6)
    # full recomputation repeats the layers' forward: a third of their forward + backward
    full = step_time(dataclasses.replace(one, checkpointing="full"), IDEAL, 8, **SECTIONS)
    m = CFG.model
    logits = 6 * m.d_model * m.vocab_size
    layers = flops_per_token(m) - logits
    assert full.mfu == pytest.approx(IDEAL.gemm_efficiency * (layers + logits) / (layers * 4 / 3 + logits), rel=1e-6)


def test_zero_communication_by_hand():
    # 2 dp ranks in one node, on the 175B model's last stage at tp = 8, pp = 8: P parameters, reduce-scatter 4P bytes and all-gather 4P bytes, each at
    # busbw factor (n-1)/n = 1/2 over the NVLink busbw
    dev = device_spec("h100", intra_gbps=100.0)
    lay = layout(dp=2, pp=8)
    params = 12 * 226_516_992 + 24_576 + 98_304_000
    no_overlap = dataclasses.replace(CFG, parallel=dataclasses.replace(CFG.parallel, dp_overlap=False))
    assert dp_exposed_s(*sections(no_overlap), lay, dev, 16, mb_s=1.0) == pytest.approx(2 * 4 * params * 0.5 / 100e9)
    # overlapped behind a long enough micro-batch, none of it is exposed
    assert dp_exposed_s(*sections(CFG), lay, dev, 16, mb_s=1.0) == 0.0
    # behind a short one, what exceeds backward (2/3) and forward (1/3) of it remains
    rs = ag = 4 * params * 0.5 / 100e9
    assert dp_exposed_s(*sections(CFG), lay, dev, 16, mb_s=0.003) == pytest.approx((rs - 0.002) + (ag - 0.001))


def test_sequence_parallel_traffic_and_its_overlap():
    dev = device_spec("h100", intra_gbps=100.0)
    lay = layout(pp=8, tp=8)
    no_overlap = dataclasses.replace(CFG, parallel=dataclasses.replace(CFG.parallel, tp_overlap=False))
    # the fused parallel block per layer: forward 1 all-gather + 1 reduce-scatter; backward the
    # input shard gathered again, the output gradient gathered, the input gradient
    # reduce-scattered: 5 collectives of s*b*h bf16 = 50,331,648 bytes at (t-1)/t over
    # 100 GB/s; 12 layers on a stage
    one = 2048 * 12288 * 2 * 7 / 8 / 100e9
    assert tp_exposed_s(*sections(no_overlap), lay, dev, compute_s=0.0) == pytest.approx(12 * 5 * one)
    full = dataclasses.replace(lay, checkpointing="full")  # recomputation repeats the forward's 2
    assert tp_exposed_s(*sections(no_overlap), full, dev, compute_s=0.0) == pytest.approx(12 * 7 * one)
    # the serial block (Megatron's): 4 forward, 6 backward
    serial = dataclasses.replace(no_overlap, model=dataclasses.replace(CFG.model, parallel_block=False))
    assert tp_exposed_s(*sections(serial), lay, dev, compute_s=0.0) == pytest.approx(12 * 10 * one)
    # overlapped in 2 chunks (the default) behind long GEMMs: only the first chunk shows
    assert CFG.parallel.tp_overlap and CFG.parallel.tp_overlap_chunks == 2
    assert tp_exposed_s(*sections(CFG), lay, dev, compute_s=1.0) == pytest.approx(12 * 5 * one / 2)
    # behind short ones, all that the GEMMs cannot cover
    assert tp_exposed_s(*sections(CFG), lay, dev, compute_s=0.01) == pytest.approx(12 * 5 * one - 0.01)
