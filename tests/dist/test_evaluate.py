"""Validation through the real CLI and on real gloo ranks: the loss of one checkpoint is the same
at dp=1, dp=2, tp=2 and pp=2 (within fp rounding; bitwise the training run's own at its layout),
repeatable bit for bit, kept on schedule by a resumed run, and logged to TensorBoard with every
other metric (read back with TensorBoard's own reader)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from support.ckpt_runs import run
from support.cli_runner import REPO, SMALL, read_metrics
from support.rank_runner import run_ranks

from mshpc.loggers.tensorboard_log import tag

# validation after steps 2, 4, 6, 8 (checkpoints at 4, 8); a peak so that MFU is a number on CPU
EVAL = ["eval.interval_steps=2", "eval.batches=2", "train.peak_tflops=1.0"]


@pytest.fixture(scope="module")
def straight(tmp_path_factory, corpus_cache) -> Path:
    """dp=2, 8 steps, validation every 2, metrics also to TensorBoard."""
    tmp = tmp_path_factory.mktemp("eval-straight")
    run(tmp, corpus_cache, "straight", *EVAL, "run.loggers=[jsonl,tensorboard]")
    return tmp / "straight"


def val_rows(run_dir: Path) -> list[tuple[int, float, float]]:
    return [(r["step"], r["val_loss"], r["val_ppl"]) for r in read_metrics(run_dir) if "val_loss" in r]


def test_rows_carry_validation_on_schedule(straight: Path) -> None:
    rows = val_rows(straight)
    assert [r[0] for r in rows] == [2, 4, 6, 8]
    assert all(r[2] == pytest.approx(math.exp(r[1])) for r in rows)
    assert rows[-1][1] < rows[0][1]  # the model learns: held-out loss falls


def test_tensorboard_holds_every_metric(straight: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(straight / "tb"))
    acc.Reload()
    rows = read_metrics(straight)
    numbers = {k for r in rows for k, v in r.items() if k != "step" and isinstance(v, (int, float))}
    assert {"loss", "lr", "grad_norm", "tokens_per_s", "mfu", "val_loss", "val_ppl", "ckpt_blocking_s"} <= numbers
    assert {tag(k) for k in numbers} <= set(acc.Tags()["scalars"])
    for key in ("loss", "val_loss", "ckpt_blocking_s"):
        want = [(r["step"], r[key]) for r in rows if r.get(key) is not None]
        got = [(e.step, e.value) for e in acc.Scalars(tag(key))]
        assert got == [(s, pytest.approx(v, rel=1e-6)) for s, v in want], key
    assert "events/text_summary" in acc.Tags()["tensors"]  # the run's events (start, resumed) as text


def test_resumed_run_writes_the_same_validation_rows(straight: Path, tmp_path: Path, corpus_cache) -> None:
    # from the uninterrupted run's step-4 checkpoint: validation again after steps 6 and 8
    out = run(tmp_path, corpus_cache, "b", *EVAL, f"train.resume={straight / 'checkpoints' / 'step-0000004'}")
    assert "resumed from step 4" in out.stderr
    assert val_rows(tmp_path / "b") == val_rows(straight)[2:]


def _evaluate_checkpoint(rank: int, world: int, layouts: list[list[str]]) -> list[list[float]]:
    """Each layout's validation loss of the step-4 checkpoint, twice, on this rank."""
    from mshpc.checkpoint.train_checkpoint import TrainCheckpointer
    from mshpc.config import config_hash, load_config, resolve_world, to_dict
    from mshpc.data.prepare import val_dataset_path
    from mshpc.data.shards import TokenDataset
    from mshpc.evaluate import build_evaluator
    from mshpc.launch.runtime import Runtime
    from mshpc.mesh_shape import MeshShape
    from mshpc.optim.schedule import build_scheduler
    from mshpc.parallel.mesh import build_mesh
    from mshpc.train import build_model_step

    out = []
    for overrides in layouts:
        cfg = resolve_world(load_config(REPO / "configs/tiny.yaml", overrides), world)
        p = cfg.parallel
        mesh = build_mesh(MeshShape(pp=p.pp, dp=p.dp, tp=p.tp))
        engine, _ = build_model_step(cfg, mesh, Runtime(torch.device("cpu"), None, None))
        scheduler = build_scheduler(engine.optimizer, cfg.optim, cfg.train.steps)
        run_dir = Path(cfg.run.out_dir)
        ckpt = TrainCheckpointer(run_dir / "checkpoints", rank, engine, scheduler, run_dir=run_dir,
                                 config_hash=config_hash(cfg), config_record=to_dict(cfg), checkpoint=cfg.checkpoint,
                                 parallel=cfg.parallel,
                                 train=cfg.train, data=cfg.data, model_cfg=cfg.model)
        assert ckpt.resume() == 4
        val = TokenDataset.open(val_dataset_path(cfg.data))
        evaluator = build_evaluator(mesh, engine, val, torch.device("cpu"), None, eval_cfg=cfg.eval,
                                    model_cfg=cfg.model, parallel=cfg.parallel, train=cfg.train, data=cfg.data)
        out.append([evaluator.evaluate(), evaluator.evaluate()])
        evaluator.close()
        ckpt.close()
    return out


# each the straight run's global batch of 16 sequences; the 2-rank layouts share their ranks
TWO_RANKS = {
    "dp2": ["train.micro_batch=8"],
    "tp2": ["parallel.tp=2", "train.micro_batch=16"],
    "pp2": ["parallel.pp=2", "train.micro_batch=4", "train.grad_accum=4"],
}


def test_validation_of_one_checkpoint_is_the_same_at_every_layout(straight: Path, tmp_path: Path,
                                                                    corpus_cache) -> None:
    step4 = straight / "checkpoints" / "step-0000004"
    base = [*SMALL, *EVAL, f"data.cache_dir={corpus_cache}", f"run.out_dir={tmp_path}", f"train.resume={step4}"]
    two = run_ranks(_evaluate_checkpoint, 2, [[*base, *o] for o in TWO_RANKS.values()], timeout_s=120)
    [one] = run_ranks(_evaluate_checkpoint, 1, [[*base, "train.micro_batch=16"]], timeout_s=120)
    assert two[0] == two[1]  # the same numbers on every rank
    got = dict(zip(TWO_RANKS, two[0], strict=True)) | {"dp1": one[0]}
    want = dict((s, v) for s, v, _ in val_rows(straight))[4]  # the run's own, on the same weights
    for layout, (first, again) in got.items():
        assert first == again, layout  # bitwise repeatable
        if layout == "dp2":
            assert first == want  # the training run's layout and sums: the same bits
        else:
            assert first == pytest.approx(want, rel=1e-5), layout  # the same sums in another order
