import subprocess
import sys
from pathlib import Path

import pytest

from mshpc.config import Config, dump_yaml, load_config, resolve_world
from mshpc.errors import ConfigError
from support.cli_runner import mshpc

REPO = Path(__file__).resolve().parents[2]
CONFIGS = sorted((REPO / "configs").glob("*.yaml"))


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_shipped_configs_load_and_round_trip(path, tmp_path):
    cfg = load_config(path)
    resolved = tmp_path / "config.yaml"
    resolved.write_text(dump_yaml(cfg))
    assert load_config(resolved) == cfg


def test_paper_175b_shape():
    m = load_config(REPO / "configs/gpt-175b.yaml").model
    assert (m.n_layer, m.d_model, m.n_head, m.seq_len) == (96, 12288, 96, 2048)


def test_dotted_overrides_apply_with_yaml_types():
    cfg = load_config(REPO / "configs/tiny.yaml", ["model.n_layer=2", "optim.lr=3e-4",
                                                     "model.sliding_window=32", "model.parallel_block=false"])
    assert cfg.model.n_layer == 2 and cfg.optim.lr == 3e-4
    assert cfg.model.sliding_window == 32 and cfg.model.parallel_block is False


def test_on_off_choices_survive_yaml_booleans(tmp_path):
    # YAML 1.1 reads a bare on/off as true/false; a field whose choices are "on"/"off" takes them
    for raw, want in (("on", "on"), ("off", "off"), ("auto", "auto")):
        cfg = load_config(REPO / "configs/tiny.yaml", [f"model.fused_kernels={raw}"])
        assert cfg.model.fused_kernels == want
        (tmp_path / "c.yaml").write_text(dump_yaml(cfg))
        assert load_config(tmp_path / "c.yaml") == cfg
    with pytest.raises(ConfigError, match="model.fused_kernels='always' is not a valid choice"):
        load_config(None, ["model.fused_kernels=always"])


BAD = [
    (["model.mlp_bias=true", "parallel.tp=2"], "model.mlp_bias=true is not available with parallel.tp=2"),
    (["model.mlp=swiglu", "model.mlp_bias=true"], "model.mlp_bias=true is not available with model.mlp=swiglu"),
    (["model.n_layers=4"], "unknown config key 'model.n_layers' (did you mean 'n_layer'?"),
    (["modle.n_layer=4"], "unknown config key 'modle' (did you mean 'model'?"),
    (["train.steps=ten"], "train.steps='ten' has the wrong type (expected int)"),
    (["train.steps=1.5"], "train.steps=1.5 has the wrong type (expected int)"),
    (["model.parallel_block=3"], "model.parallel_block=3 has the wrong type (expected bool)"),
    (["optim.name=sgd"], "optim.name='sgd' is not a valid choice (choose 'adamw' or 'lamb')"),
    (["train.steps=0"], "train.steps=0 must be >= 1"),
    (["model.n_head=3"], "model.n_head=3 does not divide model.d_model=256"),
    (["model.n_head=8", "parallel.tp=3"], "parallel.tp=3 does not divide model.n_head=8 (choose 1, 2, 4 or 8)"),
    (["parallel.pp=3"], "parallel.pp*parallel.virtual_stages=3 does not divide model.n_layer=4"),
    (["model.n_kv_head=3"], "model.n_kv_head=3 does not divide model.n_head=4"),
    # 12 heads and 6 kv heads at tp=4: 6 kv heads can be neither split 4 ways nor copied evenly
    (["model.n_head=12", "model.d_model=384", "model.n_kv_head=6", "parallel.tp=4"],
     "parallel.tp=4 and model.n_kv_head=6: one must divide the other"),
    (["model.n_kv_head=1", "parallel.tp=2", "optim.name=lamb"],
     "optim.name='lamb' with model.n_kv_head=1 < parallel.tp=2 (replicated kv heads) is not available"),
    (["parallel.pp=2", "parallel.virtual_stages=2", "train.grad_accum=3"],
     "interleaved 1F1B needs train.grad_accum=3 divisible by parallel.pp=2 (choose a multiple of 2"),
    (["parallel.virtual_stages=2"], "parallel.virtual_stages=2 needs parallel.pp > 1"),
    (["parallel.pp_schedule=zb"], "parallel.pp_schedule='zb' is not a valid choice (choose '1f1b' or 'gpipe')"),
    (["optim.min_lr=1.0"], "optim.min_lr=1.0 must be <= optim.lr"),
    (["model.sliding_window=0"], "model.sliding_window=0 must be >= 1 or null"),
    (["model=3"], "override 'model' names a section"),
    (["optim.lr"], "override 'optim.lr' must look like section.key=value"),
    (["diagnose.straggler_threshold=1.1"], "diagnose.straggler_threshold=1.1 must be between 0 and 1"),
    (["diagnose.mfu_window_steps=0"], "diagnose.mfu_window_steps=0 must be >= 1"),
    (["run.loggers=[jsonl,tb]"], "run.loggers[1]='tb' is not a valid choice (choose 'jsonl' or 'tensorboard' or 'wandb')"),
    (["run.loggers=jsonl"], "run.loggers='jsonl' must be a list"),
    (["run.loggers=[wandb]"], "run.loggers=['wandb'] must include 'jsonl'"),
    (["run.loggers=[jsonl,jsonl]"], "names a logger twice"),
    (["eval.batches=0"], "eval.batches=0 must be >= 1"),
]


@pytest.mark.parametrize("overrides,message", BAD, ids=[b[0][-1] for b in BAD])
def test_bad_input_gives_one_line_error(overrides, message):
    with pytest.raises(ConfigError) as info:
        load_config(REPO / "configs/tiny.yaml", overrides)
    assert message in str(info.value)
    assert "\n" not in str(info.value)


def test_bad_yaml_file_and_missing_file(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "none.yaml")
    unknown = tmp_path / "unknown.yaml"
    unknown.write_text("model:\n  hidden: 3\n")
    with pytest.raises(ConfigError, match="unknown config key 'model.hidden'"):
        load_config(unknown)


def test_world_size_must_divide_by_model_parallel():
    cfg = load_config(None, ["model.n_head=4", "parallel.tp=2"])
    assert resolve_world(cfg, 4).parallel.dp == 2
    with pytest.raises(ConfigError, match=r"world size 3 is not divisible by parallel.tp\*parallel.pp=2"):
        resolve_world(cfg, 3)


def test_loggers_and_eval_load_and_round_trip(tmp_path):
    cfg = load_config(REPO / "configs/tiny.yaml", ["run.loggers=[jsonl, tensorboard, wandb]", "eval.interval_steps=5"])
    assert cfg.run.loggers == ("jsonl", "tensorboard", "wandb") and cfg.eval.interval_steps == 5
    (tmp_path / "c.yaml").write_text(dump_yaml(cfg))  # a YAML list, read back as the same tuple
    assert load_config(tmp_path / "c.yaml") == cfg
    assert load_config(None).run.loggers == ("jsonl",) and load_config(None).eval.interval_steps == 0


def test_global_batch():
    cfg = load_config(None, ["train.micro_batch=3", "train.grad_accum=2", "parallel.dp=4"])
    assert cfg.global_batch == 24 and cfg.world_size == 4 and isinstance(cfg, Config)


def test_cli_prints_one_line_and_exits_2():
    out = subprocess.run(
        [sys.executable, "-m", "mshpc", "train", str(REPO / "configs/tiny.yaml"), "--set", "model.n_layers=3"],
        capture_output=True, text=True, timeout=60,
    )
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "ConfigError: unknown config key 'model.n_layers'" in lines[0]


def _one_line_error(out) -> str:
    """The single stderr line of a command that stopped on a user error (exit 2)."""
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2 and len(lines) == 1, (out.returncode, out.stderr[-2000:])
    return lines[0]


def _config_files(tmp_path):
    """Config files no loader should take: (name, path or text, the words the error must say)."""
    (tmp_path / "empty.yaml").write_text("")
    (tmp_path / "comments.yaml").write_text("# only a comment\n")
    (tmp_path / "latin1.yaml").write_bytes("model:\n  norm: r\xe9msnorm\n".encode("latin-1"))
    (tmp_path / "twice.yaml").write_text("model:\n  n_layer: 2\ntrain:\n  steps: 1\nmodel:\n  n_layer: 8\n")
    (tmp_path / "twice_nested.yaml").write_text("train:\n  steps: 1\n  micro_batch: 2\n  steps: 50\n")
    (tmp_path / "a_dir.yaml").mkdir()
    return {
        "empty": (tmp_path / "empty.yaml", "empty.yaml' is empty"),
        "comments": (tmp_path / "comments.yaml", "comments.yaml' is empty"),
        "latin1": (tmp_path / "latin1.yaml", "latin1.yaml' is not UTF-8 text (byte 16: 0xe9)"),
        "twice": (tmp_path / "twice.yaml", "twice.yaml: key 'model' appears twice (lines 1 and 5)"),
        "twice_nested": (tmp_path / "twice_nested.yaml", "key 'steps' appears twice (lines 2 and 4)"),
        "directory": (tmp_path / "a_dir.yaml", "a_dir.yaml' is a directory, not a YAML file"),
    }


@pytest.mark.parametrize("case", ["empty", "comments", "latin1", "twice", "twice_nested", "directory"])
def test_config_files_that_cannot_be_configs_are_one_line_errors(case, tmp_path):
    path, words = _config_files(tmp_path)[case]
    # a few steps in tmp_path: before the fix, an empty file trained the defaults (and exited 0)
    out = mshpc("train", str(path), "--set", "train.steps=1", "--set", f"run.out_dir={tmp_path}", timeout_s=120)
    line = _one_line_error(out)
    assert line.startswith("mshpc: error: ConfigError: ") and words in line, line


def test_override_that_is_not_yaml_is_a_one_line_error(tmp_path):
    out = mshpc("train", str(REPO / "configs/tiny.yaml"), "--set", "parallel.tp=[1", timeout_s=120)
    line = _one_line_error(out)
    assert "ConfigError: override 'parallel.tp=[1': not valid YAML at line 1, column 3" in line, line
    out = mshpc("train", str(REPO / "configs/tiny.yaml"), "--set", "optim.lr={a: 1, a: 2}", timeout_s=120)
    assert "override 'optim.lr={a: 1, a: 2}': key 'a' appears twice" in _one_line_error(out)


def test_every_command_that_reads_a_config_shares_the_checks(tmp_path):
    files = _config_files(tmp_path)
    path, words = files["twice"]
    out = mshpc("plan", str(path), "--gpus", "8", timeout_s=120)
    assert words in _one_line_error(out)
    path, words = files["empty"]
    out = mshpc("preflight", str(path), timeout_s=120)
    assert words in _one_line_error(out)
