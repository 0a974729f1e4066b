"""parallel.layout: auto: the plan's fastest fitting layout for a world, the tie rule, the refusals."""

import dataclasses

import pytest
import torch
from support.cli_runner import REPO

from mshpc.config import load_config, resolve_world, validate
from mshpc.errors import ConfigError
from mshpc.plan.auto_layout import (
    TIE,
    choose_layout,
    cpu_spec,
    fit_layout,
    gpu_spec,
    rank_fitting,
    simplicity,
)
from mshpc.plan.devices import DEVICES
from mshpc.plan.layout import Layout
from mshpc.plan.memory import GIB
from mshpc.plan.report import plan

TINY = REPO / "configs/tiny.yaml"
M125 = REPO / "configs/gpt-125m.yaml"
H100 = DEVICES["h100"]


def sections(cfg):
    return dict(model_cfg=cfg.model, parallel=cfg.parallel, train=cfg.train, optim=cfg.optim, plan_cfg=cfg.plan)


def plan_sections(cfg):
    return dict(model_cfg=cfg.model, parallel=cfg.parallel, train=cfg.train, plan_cfg=cfg.plan)


def test_the_choice_is_the_fastest_layout_that_fits_and_the_runner_up_the_next():
    cfg = load_config(M125, ["parallel.layout=auto", "train.micro_batch=16", "train.grad_accum=1"])  # batch 16
    dev = dataclasses.replace(H100, memory_gib=5.0)  # the fastest layout needs 5.7 GiB
    every = plan(8, dev, 8, **plan_sections(cfg))
    assert not every[-1].fits and not min(every, key=lambda p: p.time.total_s).fits
    choice = choose_layout(8, dev, 8, **sections(cfg))
    assert choice.best.fits and choice.best.memory.total <= 5.0 * GIB
    fitting = sorted((p for p in every if p.fits), key=lambda p: p.time.total_s)
    assert choice.best.time.total_s == pytest.approx(fitting[0].time.total_s, rel=TIE)
    assert choice.runner_up is not None and choice.runner_up.fits
    assert choice.runner_up.layout != choice.best.layout
    assert choice.fitting == len(fitting) < choice.weighed == len(every)


def test_a_bigger_device_gets_a_layout_at_least_as_fast():
    cfg = load_config(M125, ["parallel.layout=auto", "train.micro_batch=16"])
    small = choose_layout(8, dataclasses.replace(H100, memory_gib=5.0), 8, **sections(cfg)).best
    big = choose_layout(8, H100, 8, **sections(cfg)).best
    assert big.time.total_s <= small.time.total_s
    assert small.layout != big.layout  # the small device really constrained the choice


def test_fit_layout_keeps_the_global_batch_and_fills_the_world():
    cfg = load_config(TINY, ["parallel.layout=auto", "parallel.dp=1", "parallel.tp=2",
                             "train.micro_batch=4", "train.grad_accum=4"])  # global batch 16
    for world in (1, 2, 4, 8):
        parallel, train, line = fit_layout(world, H100, 8, **sections(cfg))
        fitted = dataclasses.replace(cfg, parallel=parallel, train=train)
        p = fitted.parallel
        assert p.dp * p.tp * p.pp == world
        assert fitted.global_batch == 16
        assert validate(fitted) is fitted and resolve_world(fitted, world) == fitted
        assert fitted.parallel.layout == "auto"  # the resolved config reloads to the same choice
        assert f"dp {p.dp} tp {p.tp} pp {p.pp} v {p.virtual_stages} mb {fitted.train.micro_batch}" in line
        assert "runner-up" in line and "\n" not in line


def test_nothing_fits_is_one_line_with_the_plans_reason():
    cfg = load_config(REPO / "configs/gpt-175b.yaml", ["parallel.layout=auto"])
    with pytest.raises(ConfigError) as err:
        choose_layout(8, H100, 8, **sections(cfg))
    msg = str(err.value)
    assert "\n" not in msg
    assert msg.startswith("parallel.layout=auto: none of the") and "of 8 ranks" in msg
    assert "fits in 72.0 of 80 GiB (H100; plan.memory_headroom 10% kept free) per rank" in msg
    assert "the leanest (dp " in msg
    assert "recompute full" in msg  # the leanest layout recomputes everything, and still needs more


def test_a_world_that_divides_no_batch_is_refused():
    cfg = load_config(TINY, ["parallel.layout=auto"])  # global batch 16, 4 heads, 4 layers
    with pytest.raises(ConfigError, match=r"parallel.layout=auto on 3 ranks: no layout of 3 GPUs divides the "
                                          r"global batch of 16"):
        choose_layout(3, H100, 8, **sections(cfg))


def test_layouts_the_engine_refuses_are_never_chosen():
    # tp=2 is the only way to use 2 ranks at a global batch of 1 and 3 layers, and tp=2 does not
    # divide seq_len=33: the plan enumerates it, config validation refuses it
    cfg = load_config(TINY, ["parallel.layout=auto", "parallel.dp=1", "train.micro_batch=1",
                             "model.n_layer=3", "model.seq_len=33"])
    assert plan(2, H100, 8, **plan_sections(cfg))
    with pytest.raises(ConfigError, match="no layout of 2 ranks that the engine accepts"):
        choose_layout(2, H100, 8, **sections(cfg))
    # a model with MLP biases takes no tp, so 2 ranks go to dp even where tp would be predicted faster
    biased = load_config(TINY, ["parallel.layout=auto", "model.mlp_bias=true"])
    assert choose_layout(2, H100, 8, **sections(biased)).best.layout.tp == 1


def _prediction(template, layout, seconds):
    time = dataclasses.replace(template.time, compute_s=seconds, bubble_s=0.0, tp_s=0.0, pp_s=0.0, dp_s=0.0,
                               optimizer_s=0.0)
    return dataclasses.replace(template, layout=layout, time=time)


@pytest.mark.parametrize("slower_by,simple_wins", [(0.0, True), (1e-12, True), (1e-6, False), (0.005, False)])
def test_equal_times_go_to_the_simpler_layout_and_any_faster_one_wins(slower_by, simple_wins):
    template = plan(2, H100, 8, **plan_sections(load_config(TINY)))[0]
    simple = Layout(2, 1, 1, 1, 8, 1, "none")
    complex_ = Layout(1, 2, 1, 1, 8, 2, "none")
    ranked = rank_fitting([_prediction(template, complex_, 1.0), _prediction(template, simple, 1.0 + slower_by)])
    assert (ranked[0].layout == simple) is simple_wins


def test_simplicity_order():
    base = Layout(1, 1, 1, 1, 4, 1, "none")
    worse = [dataclasses.replace(base, pp=2), dataclasses.replace(base, tp=2),
             dataclasses.replace(base, checkpointing="selective"), dataclasses.replace(base, micro_batch=2)]
    assert all(simplicity(base) < simplicity(w) for w in worse)
    assert simplicity(dataclasses.replace(base, tp=8)) < simplicity(dataclasses.replace(base, pp=2))


def test_equal_predictions_take_the_largest_micro_batch_without_recomputation():
    # on 2 CPU ranks the tiny model's dp layouts differ only in micro-batch: equal predicted times
    cfg = load_config(TINY, ["parallel.layout=auto"])
    dev = cpu_spec(16 * GIB, 2, 1, act_bytes=4)
    best = choose_layout(2, dev, 2, **sections(cfg)).best.layout
    assert (best.dp, best.tp, best.pp, best.micro_batch, best.n_micro, best.checkpointing) == (2, 1, 1, 8, 1, "none")


def test_device_figures():
    dev = cpu_spec(32 * GIB, 4, 2, act_bytes=4)
    assert dev.memory_gib == 8.0 and dev.act_bytes == 4 and dev.name.startswith("CPU")
    gpu = gpu_spec("NVIDIA H200", 140 * GIB, act_bytes=2)
    assert gpu.peak_tflops == DEVICES["h200"].peak_tflops and gpu.memory_gib == 140.0
    with pytest.raises(ConfigError, match=r"no rates for GPU 'Tesla V100' \(known: a100, h100, h200\)"):
        gpu_spec("Tesla V100", 32 * GIB, act_bytes=2)


def test_fp32_activations_count_double_on_cpu():
    cfg = load_config(TINY)
    lay = Layout(2, 1, 1, 1, 8, 1, "none")
    from mshpc.plan.memory import memory

    assert memory(cfg.model, lay, act_bytes=4).activations > 1.8 * memory(cfg.model, lay, act_bytes=2).activations


def test_manual_is_the_default_and_auto_is_a_choice():
    assert load_config(TINY).parallel.layout == "manual"
    with pytest.raises(ConfigError, match="parallel.layout='best' is not a valid choice"):
        load_config(TINY, ["parallel.layout=best"])


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_auto_on_a_missing_gpu_is_the_runtimes_one_line():
    from mshpc.config import TrainConfig
    from mshpc.launch.runtime import uses_cuda

    # fit_to_world asks before building the runtime: the same error, not set_device's traceback
    with pytest.raises(ConfigError, match="train.device='cuda' but no CUDA device is visible"):
        uses_cuda(TrainConfig(device="cuda"))
    assert uses_cuda(TrainConfig(device="auto")) is False


def test_plan_keeps_memory_headroom_and_auto_honours_it():
    # a device just larger than the fastest layout's need: a fit with nothing kept free, not with
    # the default headroom (10%: the CUDA context, NCCL's buffers, the allocator's fragmentation)
    cfg = load_config(M125, ["parallel.layout=auto", "train.micro_batch=16", "train.grad_accum=1"])
    fastest = min(plan(8, H100, 8, **plan_sections(cfg)), key=lambda p: p.time.total_s)
    dev = dataclasses.replace(H100, memory_gib=fastest.memory.total / GIB / 0.95)  # 95% full
    none_kept = load_config(M125, ["parallel.layout=auto", "train.micro_batch=16", "train.grad_accum=1",
                                   "plan.memory_headroom=0"])
    assert cfg.plan.memory_headroom == 0.1
    assert choose_layout(8, dev, 8, **sections(none_kept)).best.layout == fastest.layout
    kept = [p for p in plan(8, dev, 8, **plan_sections(cfg)) if p.layout == fastest.layout]
    assert not kept[0].fits
    chosen = choose_layout(8, dev, 8, **sections(cfg)).best
    assert chosen.layout != fastest.layout and chosen.memory.total <= 0.9 * dev.memory_gib * GIB
    _, _, line = fit_layout(8, dev, 8, **sections(cfg))
    assert f"{0.9 * dev.memory_gib:.1f} of {dev.memory_gib:g} GiB (H100; plan.memory_headroom 10% kept free)" in line
    with pytest.raises(ConfigError, match=r"plan.memory_headroom=1.0 must be in \[0, 1\)"):
        load_config(M125, ["plan.memory_headroom=1"])
