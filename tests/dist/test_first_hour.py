"""A new user's first hour through the real CLI (issue #42): configs/tiny.yaml as `make run` trains
it (2 local ranks, no checkpoint setting of its own) keeps a checkpoint that `mshpc generate` and
`mshpc export` read, and says what it did; resuming into another model, or from another run's
shared checkpoint.dir, is refused in one line and changes nothing; a resume at another layout
appends to metrics.jsonl and `mshpc diagnose` reads it."""

import shutil

import pytest
import torch
from support.cli_runner import mshpc, read_metrics, train_args
from support.hf_models import MAX_RELATIVE_DIFF, hf_logits, mshpc_logits, relative_diff

from mshpc.checkpoint.model_copy import read_model_copy
from mshpc.checkpoint.paths import committed_steps, latest_step, step_dir
from mshpc.events import read_events
from mshpc.interop.hf_export import check_shapes, export_hf, run_config
from mshpc.model.gpt import GPT
from mshpc.run_dir import read_attempts

STEPS = 4
# checkpoint.* as tiny.yaml leaves it: the defaults save at the end of the run
FIRST = [f"train.steps={STEPS}", "eval.interval_steps=2", "eval.batches=1", "supervisor.max_restarts=0"]


@pytest.fixture(scope="module")
def first(tmp_path_factory, corpus_cache):
    tmp = tmp_path_factory.mktemp("first-hour")
    out = mshpc(*train_args(tmp, corpus_cache, *FIRST, name="tiny"), "--nproc", "2")
    assert out.returncode == 0, out.stderr[-3000:]
    return {"dir": tmp / "tiny", "tmp": tmp, "out": out}


def test_a_default_run_keeps_a_checkpoint_that_generates_and_exports(first, tmp_path):
    run_dir = first["dir"]
    root = run_dir / "checkpoints"
    assert committed_steps(root) == [STEPS] and latest_step(root) == STEPS  # saved at the end, by default
    out = mshpc("generate", str(run_dir), "--prompt", "def ", "--greedy", "--max-new-tokens", "8")
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.startswith("def ") and len(out.stdout) > len("def \n")
    lines = export_hf(run_dir, tmp_path / "hf")  # tiny.yaml: LayerNorm + GeLU + parallel block
    assert "as GPTNeoXForCausalLM" in lines[0]
    _, cfg = run_config(run_dir, None)
    model = GPT(cfg.model)
    folder = step_dir(root, STEPS)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(check_shapes(read_model_copy(folder), cfg.model, folder)[name])
    idx = torch.randint(0, cfg.model.vocab_size, (2, cfg.model.seq_len), generator=torch.Generator().manual_seed(0))
    assert relative_diff(hf_logits(tmp_path / "hf", idx), mshpc_logits(model, idx)) <= MAX_RELATIVE_DIFF


def test_the_console_shows_validation_and_ends_with_a_summary(first):
    console = first["out"].stdout + first["out"].stderr
    assert any(" val_loss " in line and line.startswith("step 2/4") for line in console.splitlines())
    assert "step 4/4 loss " in console and " lr " in console and " elapsed " in console
    assert f"finished steps 1-{STEPS} of {STEPS}: " in console
    assert f"checkpoints: {first['dir'] / 'checkpoints'} (latest step {STEPS}, 1 kept)" in console
    assert f"report: `mshpc diagnose {first['dir']}`" in console


def test_resume_into_another_model_shape_is_refused_in_one_line(first, corpus_cache):
    run_dir = first["dir"]
    before = (run_dir / "config.yaml").read_bytes()
    out = mshpc(*train_args(first["tmp"], corpus_cache, *FIRST, "model.n_layer=1", name="tiny"), "--nproc", "1")
    assert out.returncode == 2, out.stderr[-2000:]
    last = out.stderr.strip().splitlines()[-1]
    assert last == (f"mshpc: error: ResumeMismatchError: train.resume: checkpoint {step_dir(run_dir / 'checkpoints', STEPS)} "
                    "holds another model (model.n_layer=2 there, 1 here); loading it would drop or misplace weights: "
                    "start fresh with --set train.resume=never or a new run.name, or resume step-0000004 with its own "
                    "settings")
    assert "damaged" not in out.stderr  # a mismatch is not corruption: no older checkpoint is tried
    assert (run_dir / "config.yaml").read_bytes() == before  # a run that did not load writes nothing there
    assert committed_steps(run_dir / "checkpoints") == [STEPS]


def test_finding7_two_runs_sharing_checkpoint_dir_are_refused(first, corpus_cache):
    """Issue #43, finding 7: another run pointed at this run's checkpoint.dir neither resumes from
    its weights nor prunes its checkpoints (the config hash is compared, the fields named)."""
    shared = first["dir"] / "checkpoints"
    for resume in ("auto", "never"):
        out = mshpc(*train_args(first["tmp"], corpus_cache, *FIRST, f"checkpoint.dir={shared}",
                                f"train.resume={resume}", name="other"), "--nproc", "1")
        assert out.returncode == 2, out.stderr[-2000:]
        last = out.stderr.strip().splitlines()[-1]
        assert last.startswith(f"mshpc: error: ResumeMismatchError: train.resume{'=never' if resume == 'never' else ''}: "
                               f"checkpoint.dir={shared} holds run 'tiny''s checkpoints (step-0000004"), last
        assert ("this config differs in " in last and "run.name: tiny -> other" in last) or resume == "never", last
    assert committed_steps(shared) == [STEPS]
    assert not (first["tmp"] / "other" / "metrics.jsonl").exists()


def test_a_resume_at_another_layout_appends_metrics_and_diagnoses(first, corpus_cache):
    tmp = first["tmp"] / "relaid"
    shutil.copytree(first["dir"], tmp / "tiny", symlinks=True)
    out = mshpc(*train_args(tmp, corpus_cache, *FIRST, f"train.steps={STEPS + 2}", name="tiny"), "--nproc", "1")
    assert out.returncode == 0, out.stderr[-3000:]
    assert "resuming step-0000004 with changed settings: " in out.stderr and "parallel.dp: 2 -> 1" in out.stderr
    run_dir = tmp / "tiny"
    assert [a["start_step"] for a in read_attempts(run_dir / "metrics.jsonl")] == [0, STEPS]  # nothing truncated
    assert [r["step"] for r in read_metrics(run_dir) if "loss" in r] == list(range(1, STEPS + 3))
    starts = [e for e in read_events(run_dir) if e["kind"] == "train_start"]
    assert [(e["attempt"], e["start_step"], e["world"]) for e in starts] == [(1, 0, 2), (2, STEPS, 1)]
    report = mshpc("diagnose", str(run_dir))
    assert report.returncode == 0, report.stderr[-3000:]
    assert ("resumed at another layout: the per-rank view is of the last one (dp=1, tp=1, pp=1); 1 rank(s) "
            "trained only at an earlier one, left out") in report.stdout
    assert (run_dir / "report" / "mesh.png").is_file()
