"""parallel.layout: auto through the real CLI: 2 gloo ranks train with the layout the plan chose
and rank 0 names it in one line; a model that fits nowhere stops with the plan's reason."""

import json

import yaml

from mshpc.config import load_config
from mshpc.plan.auto_layout import choice_line, choose_layout, cpu_spec, host_memory_bytes
from support.cli_runner import REPO, SMALL, mshpc, read_metrics, train_args

# written as tp=2 on one dp rank; the plan moves the 2 ranks to dp (no tp traffic, same compute)
WRITTEN = ["parallel.layout=auto", "parallel.dp=1", "parallel.tp=2", "train.micro_batch=4",
           "train.grad_accum=2", "train.steps=3"]


def test_auto_trains_with_the_plans_layout_and_logs_it(tmp_path, corpus_cache):
    out = mshpc(*train_args(tmp_path, corpus_cache, *WRITTEN, name="auto"), "--nproc", "2")
    assert out.returncode == 0, out.stderr[-3000:]
    cfg = load_config(REPO / "configs/tiny.yaml", [*SMALL, *WRITTEN])
    dev = cpu_spec(host_memory_bytes(), 2, 1, act_bytes=4)  # SMALL sets train.cpu_threads=1; CPU is fp32
    choice = choose_layout(2, dev, 2, model_cfg=cfg.model, parallel=cfg.parallel, train=cfg.train, optim=cfg.optim,
                           plan_cfg=cfg.plan)
    best = choice.best.layout
    assert (best.dp, best.tp, best.pp) == (2, 1, 1)  # not the written tp=2
    logged = [line for line in (out.stdout + out.stderr).splitlines() if "parallel.layout auto" in line]
    assert len(logged) == 1 and logged[0].endswith(choice_line(choice, 2, dev, plan_cfg=cfg.plan)), logged
    resolved = yaml.safe_load((tmp_path / "auto/config.yaml").read_text())
    p, t = resolved["parallel"], resolved["train"]
    assert (p["dp"], p["tp"], p["pp"], p["virtual_stages"], t["micro_batch"], t["grad_accum"],
            p["activation_checkpointing"]) == (best.dp, best.tp, best.pp, best.virtual_stages, best.micro_batch,
                                               best.n_micro, best.checkpointing)
    assert t["micro_batch"] * t["grad_accum"] * p["dp"] == 8  # the written global batch
    assert [r["step"] for r in read_metrics(tmp_path / "auto")] == [1, 2, 3]
    # the mesh the ranks built is the plan's: each timings file opens on its rank's coordinates
    coords = sorted((h["dp"], h["tp"], h["pp"]) for h in (
        json.loads(f.read_text().splitlines()[0]) for f in (tmp_path / "auto/timings").iterdir()))
    assert coords == [(0, 0, 0), (1, 0, 0)]


def test_a_model_that_fits_nowhere_stops_with_the_plans_reason(tmp_path, corpus_cache):
    huge = ["parallel.layout=auto", "model.d_model=16384", "model.n_head=128", "model.n_layer=64"]
    out = mshpc(*train_args(tmp_path, corpus_cache, *huge, name="huge"), "--nproc", "1")
    assert out.returncode == 2, out.stderr[-3000:]
    last = out.stderr.strip().splitlines()[-1]
    assert "ConfigError: parallel.layout=auto: none of the" in last and "of 1 ranks" in last, last
    assert "the leanest (dp 1 tp 1 pp 1" in last
