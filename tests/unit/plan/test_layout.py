import json

import pytest

from mshpc.config import load_config
from mshpc.errors import ConfigError
from mshpc.plan.devices import device_spec
from mshpc.plan.layout import enumerate_layouts
from mshpc.plan.report import fit_warning
from support.cli_runner import REPO, mshpc

TINY = REPO / "configs/tiny.yaml"


def test_every_layout_is_one_the_config_accepts():
    cfg = load_config(TINY, ["train.grad_accum=4"])  # global batch 8 * 4 * 2 = 64
    layouts = enumerate_layouts(gpus=8, gpus_per_node=4, model_cfg=cfg.model, global_batch=cfg.global_batch)
    assert layouts
    for lay in layouts:
        assert lay.gpus == 8 and lay.dp * lay.micro_batch * lay.n_micro == 64
        assert lay.tp <= 4 and cfg.model.n_head % lay.tp == 0
        assert lay.virtual_stages == 1 or lay.n_micro % lay.pp == 0
        load_config(TINY, [f"parallel.dp={lay.dp}", f"parallel.tp={lay.tp}", f"parallel.pp={lay.pp}",
                           f"parallel.virtual_stages={lay.virtual_stages}", f"train.micro_batch={lay.micro_batch}",
                           f"train.grad_accum={lay.n_micro}",
                           f"parallel.activation_checkpointing={lay.checkpointing}"])  # validates
    shapes = {(lay.dp, lay.tp, lay.pp) for lay in layouts}
    assert shapes == {(8, 1, 1), (4, 2, 1), (2, 4, 1), (4, 1, 2), (2, 2, 2), (1, 4, 2), (2, 1, 4), (1, 2, 4)}


def test_no_layout_is_a_clear_error():
    cfg = load_config(TINY, ["train.micro_batch=1", "parallel.dp=1"])  # global batch 1
    with pytest.raises(ConfigError, match="no layout of 3 GPUs divides the global batch of 1"):
        enumerate_layouts(gpus=3, gpus_per_node=8, model_cfg=cfg.model, global_batch=cfg.global_batch)


def test_fit_warning():
    cfg = load_config(REPO / "configs/gpt-175b.yaml", ["parallel.tp=1", "parallel.pp=1"])
    warning = fit_warning(80 * 2**30, "NVIDIA H100 80GB HBM3", model_cfg=cfg.model, parallel=cfg.parallel,
                          train=cfg.train, plan_cfg=cfg.plan)
    assert warning is not None and "but NVIDIA H100 80GB HBM3 has 72.0 of 80.0 GiB to give" in warning
    tiny = load_config(TINY)
    assert fit_warning(80 * 2**30, "H100", model_cfg=tiny.model, parallel=tiny.parallel, train=tiny.train,
                       plan_cfg=tiny.plan) is None


def test_cli_table_and_json():
    out = mshpc("plan", str(REPO / "configs/gpt-175b.yaml"), "--gpus", "256", "--gpu", "a100",
                "--set", "train.grad_accum=768", "--top", "3")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].split()[:4] == ["dp", "tp", "pp", "v"] and len(lines) == 5
    assert "fit in 72.0 of 80 GiB (A100; plan.memory_headroom 10% kept free)" in lines[-1]
    out = mshpc("plan", str(REPO / "configs/gpt-175b.yaml"), "--gpus", "256", "--json",
                "--set", "train.grad_accum=768")
    rows = [json.loads(line) for line in out.stdout.splitlines()]
    assert all(r["dp"] * r["tp"] * r["pp"] == 256 for r in rows)
    fitting = [r["step_time_s"] for r in rows if r["fits"]]
    assert fitting == sorted(fitting) and rows[0]["fits"]


def test_cli_bad_gpu_is_one_line():
    out = mshpc("plan", str(TINY), "--gpus", "2", "--gpu", "v100")
    assert out.returncode == 2
    assert out.stderr.strip() == "mshpc: error: ConfigError: unknown GPU 'v100' (choose a100, h100, h200)"
    assert device_spec("H200").memory_gib == 141.0
