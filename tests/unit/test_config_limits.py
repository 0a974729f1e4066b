"""Absurd and hostile config values (issue #43, finding 11): each is one line naming the key,
never a traceback, never unbounded memory (a NaN passes every `<` check; an alias tree repeats
itself in every walk and message; a size can describe more memory than any machine has)."""

import resource
import time

import pytest

from mshpc.config import PARAMS_MAX, YAML_VALUES_MAX, load_config, model_params
from mshpc.errors import ConfigError
from mshpc.plan.report import memory_refusal

GIB = 2**30


@pytest.mark.parametrize("override, line", [
    ("optim.lr=nan", "optim.lr=nan must be a finite number"),
    ("parallel.bucket_mb=.nan", "parallel.bucket_mb=nan must be a finite number"),
    ("supervisor.heartbeat_interval_s=nan", "supervisor.heartbeat_interval_s=nan must be a finite number"),
    ("supervisor.timeout_floor_s=.inf", "supervisor.timeout_floor_s=inf must be a finite number"),
    ("supervisor.loss_limit=-.inf", "supervisor.loss_limit=-inf must be a finite number"),
    ("model.dropout=2", "model.dropout=2.0 must lie in [0, 1)"),
    ("model.dropout=1", "model.dropout=1.0 must lie in [0, 1)"),
    ("model.rope_theta=0", "model.rope_theta=0.0 must lie in (0, inf)"),
    ("model.norm_eps=-1e-5", "model.norm_eps=-1e-05 must lie in (0, inf)"),
    ("optim.beta2=1", "optim.beta2=1.0 must lie in [0, 1)"),
    ("optim.eps=0", "optim.eps=0.0 must lie in (0, inf)"),
    ("train.steps=" + "9" * 30, "train.steps=" + "9" * 30 + " is past the largest integer mshpc takes"),
    ("model.n_layer=1000000000", "the model has about 7.9e+14 parameters (model.n_layer=1000000000"),
    ("model.vocab_size=1000000000000", "the model has about 2.6e+14 parameters"),
    ("model.n_layer=" + "9" * 5000, "a value YAML cannot build (Exceeds the limit (4300 digits)"),
])
def test_an_absurd_value_is_one_line_naming_its_key(override, line):
    with pytest.raises(ConfigError) as err:
        load_config(None, [override])
    message = str(err.value)
    assert "\n" not in message and line in message and len(message) < 400, message


def test_the_shipped_configs_are_within_every_bound():
    for name in ("tiny", "gpt-125m", "gpt-1.3b", "gpt-175b", "llama3-8b", "llama3-70b"):
        cfg = load_config(f"configs/{name}.yaml")
        assert model_params(cfg.model) < PARAMS_MAX


BOMB = "a: &a [lol, lol, lol, lol, lol, lol, lol, lol, lol]\n" + "".join(
    f"{c}: &{c} [{', '.join([f'*{p}'] * 9)}]\n" for p, c in zip("abcdefgh", "bcdefghi")) + "model: {n_layer: *i}\n"


def test_an_alias_bomb_is_refused_cheaply(tmp_path):
    assert len(BOMB) < 420  # 9^9 = 387 million values in 417 bytes
    path = tmp_path / "bomb.yaml"
    path.write_text(BOMB)
    before, start = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, time.monotonic()
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert str(err.value) == (f"{path}: the YAML stands for more than {YAML_VALUES_MAX} values (aliases that "
                              "repeat aliases?); a config has a few hundred")
    assert time.monotonic() - start < 5 and resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 100_000


def test_a_large_value_in_a_message_is_cut_short(tmp_path):
    path = tmp_path / "big.yaml"
    path.write_text("model: {n_layer: [&a [" + ", ".join(["x" * 50] * 100) + "], *a, *a, *a, *a, *a, *a, *a]}\n")
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert str(err.value).startswith("model.n_layer=[[") and len(str(err.value)) < 300


def test_a_config_far_past_its_devices_memory_is_refused_before_allocation():
    tiny = load_config("configs/tiny.yaml")
    sections = dict(model_cfg=tiny.model, parallel=tiny.parallel, train=tiny.train)
    assert memory_refusal(4 * GIB, "a 4 GiB rank", 4, **sections) is None
    absurd = load_config("configs/tiny.yaml", ["train.micro_batch=1000000000"])
    line = memory_refusal(12 * GIB, "this host's memory / 2 ranks", 4, model_cfg=absurd.model,
                          parallel=absurd.parallel, train=absurd.train)
    assert line is not None and "\n" not in line
    assert line.startswith("this config needs about 7.21e+06 GiB per rank (")
    assert line.endswith("at train.micro_batch=1000000000) but this host's memory / 2 ranks has 12.0 GiB; is a size "
                         "mistyped? (`mshpc plan` lists layouts that fit)")
