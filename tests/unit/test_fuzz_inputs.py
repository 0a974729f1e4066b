"""Generated input for every reader of untrusted data (issue #43): configs (YAML text and dotted
overrides), checkpoint manifests and their entries, Hugging Face config.json, heartbeat and relay
messages, the per-node reader's hello. Each input is either accepted or refused with mshpc's
one-line error; any other exception, a multi-line or an unbounded message fails the test (and an
accepted config with a non-finite number). The inputs are the same every run (derandomized, no
example database), so a failure is reproducible; Hypothesis shrinks it to its smallest input."""

import dataclasses
import json
import math
import shutil
import tempfile
import typing
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mshpc.checkpoint.manifest import FORMAT, VERSION, TensorEntry, entry_from_json, parse_manifest
from mshpc.config import Config, load_config
from mshpc.data.node_reader import _hello
from mshpc.errors import MshpcError
from mshpc.interop.hf_arch import model_config
from mshpc.interop.hf_import import checked_model, read_hf_config
from mshpc.launch.monitor import FIELDS, beat_entry, parse_message, valid
from mshpc.launch.node_relay import is_dump_request

# Hypothesis costs a few milliseconds per example here, and a recursive strategy ten times that:
# each example draws a batch of flat inputs instead, BATCH x EXAMPLES of them per reader
# (800 per reader, 6,400 in all: about 15 CPU-s).
EXAMPLES, BATCH = 100, 8
FUZZ = settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
MESSAGE_MAX = 600  # an error line's length, bounded whatever the input's


@pytest.fixture(scope="module")
def scratch():
    """A folder in memory (/dev/shm where there is one): a thousand rewrites of a file on a busy
    disk took 20 ms each here."""
    shm = Path("/dev/shm")
    folder = Path(tempfile.mkdtemp(prefix="mshpc-fuzz-", dir=shm if shm.is_dir() else None))
    yield folder
    shutil.rmtree(folder)


def one_line(exc: MshpcError) -> None:
    text = str(exc)
    assert "\n" not in text and 0 < len(text) <= MESSAGE_MAX, text[:2000]


def refused_or(call, *args):
    """call(*args), or None when it refuses with a one-line MshpcError; any other exception fails."""
    try:
        return call(*args)
    except MshpcError as exc:
        one_line(exc)
        return None


# JSON-like values of every kind a file can hold: the edges numbers have, strings, nesting
scalars = st.one_of(st.none(), st.booleans(), st.integers(min_value=-2**70, max_value=2**70),
                    st.sampled_from([0, 1, -1, 2**31, 2**62, 2**63, 10**20]),
                    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=20),
                    st.sampled_from([math.nan, math.inf, -math.inf, 0.0, -0.0, 1e308, 5e-324, 0.5, 2.0]))
# the same edges as YAML writes them, for dotted overrides
yaml_edges = st.sampled_from([".nan", "nan", ".inf", "-.inf", "1e400", "-1", "0", "1e9", "2", "0.5", "null", "[]",
                              "{}", "9" * 30, "'x'"])
values = scalars | st.lists(scalars, max_size=3) | st.dictionaries(st.text(max_size=6), scalars, max_size=3)


def batches(strategy):
    return st.lists(strategy, min_size=BATCH, max_size=BATCH)


# ---------------------------------------------------------------- configs


def _fields(cls: type) -> list[str]:
    return [f.name for f in dataclasses.fields(cls)]


SECTIONS = {name: _fields(cls) for name, cls in typing.get_type_hints(Config).items()}
section_names = st.sampled_from(sorted(SECTIONS)) | st.text(max_size=8)


@st.composite
def config_trees(draw):
    """A config tree of real section and key names (mostly) holding values of any kind."""
    tree = {}
    for section in draw(st.lists(section_names, max_size=3, unique=True)):
        keys = SECTIONS.get(section, ["x"])
        tree[section] = {draw(st.sampled_from(keys) | st.text(max_size=6)): draw(values)
                         for _ in range(draw(st.integers(0, 4)))}
    return tree


def _dump(tree) -> str:
    try:
        return yaml.safe_dump(tree, allow_unicode=True)
    except (yaml.YAMLError, ValueError, OverflowError):
        return json.dumps(tree, default=str)


@FUZZ
@given(batch=batches(st.tuples(config_trees(), st.text(max_size=30), st.integers(0, 400))))
def test_load_config_accepts_or_refuses_in_one_line(scratch, batch):
    for tree, noise, where in batch:
        text = _dump(tree)
        if noise:  # a damaged file too: noise spliced in somewhere
            text = text[:where] + noise + text[where:]
        path = scratch / "fuzz.yaml"
        path.write_bytes(text.encode("utf-8", "surrogatepass"))  # lone surrogates too: bytes YAML must refuse
        cfg = refused_or(load_config, path)
        assert cfg is None or all_finite(cfg)


def all_finite(section) -> bool:
    """Whether every number of an accepted config is finite (a NaN passes every `<` check)."""
    for f in dataclasses.fields(section):
        value = getattr(section, f.name)
        if dataclasses.is_dataclass(value) and not all_finite(value):
            return False
        if isinstance(value, float) and not math.isfinite(value):
            return False
    return True


KEYS = st.sampled_from([f"{s}.{k}" for s, keys in SECTIONS.items() for k in keys]) | st.text(max_size=12)


@FUZZ
@given(batch=batches(st.tuples(KEYS, yaml_edges | st.text(max_size=24) | values.map(lambda v: json.dumps(v, default=str)))))
def test_overrides_accept_or_refuse_in_one_line(batch):
    for key, value in batch:
        cfg = refused_or(load_config, None, [f"{key}={value}"])
        assert cfg is None or all_finite(cfg)


# ---------------------------------------------------------------- checkpoint manifests

GOOD_ENTRY = {"name": "master/layers.0.w", "global_shape": [4, 8], "dtype": "float32", "file": "shard-00000.h5",
              "dataset": "master/layers.0.w", "start": 0, "numel": 32, "crc32": 7, "offset": 4096}


@st.composite
def entries(draw):
    """A good entry with some fields replaced by anything, some dropped, some added."""
    raw = dict(GOOD_ENTRY)
    for key in draw(st.lists(st.sampled_from(sorted(GOOD_ENTRY)), max_size=4)):
        raw[key] = draw(values)
    for key in draw(st.lists(st.sampled_from(sorted(GOOD_ENTRY)), max_size=2)):
        raw.pop(key, None)
    return draw(st.just(raw) | values)


@FUZZ
@given(batch=batches(entries()))
def test_a_manifest_entry_is_an_entry_or_one_line(batch):
    for raw in batch:
        entry = refused_or(entry_from_json, raw)
        if entry is not None:
            assert isinstance(entry, TensorEntry) and entry.stop <= math.prod(entry.global_shape)
            assert entry.file.startswith("shard-") and "/" not in entry.file and entry.dataset == entry.name


HEADS = st.dictionaries(st.sampled_from(["step", "config_hash", "layout", "extras", "created_unix", "x"]), values,
                        max_size=5)


@FUZZ
@given(batch=batches(st.tuples(HEADS, st.lists(entries(), max_size=3) | values, st.binary(max_size=8),
                               st.integers(0, 300))))
def test_a_manifest_is_a_manifest_or_one_line(scratch, batch):
    for head, tensors, noise, where in batch:
        raw = {"format": FORMAT, "version": VERSION, "step": 1, "config_hash": "h", "layout": {"dp": 1}, **head,
               "tensors": tensors}
        text = json.dumps(raw, default=str)
        if noise:
            text = text[:where] + noise.decode("latin-1") + text[where:]
        refused_or(parse_manifest, scratch, text)


# ---------------------------------------------------------------- Hugging Face config.json

LLAMA = {"architectures": ["LlamaForCausalLM"], "vocab_size": 97, "hidden_size": 32, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 48, "max_position_embeddings": 32,
         "rope_theta": 10000.0, "rms_norm_eps": 1e-6, "hidden_act": "silu", "tie_word_embeddings": False,
         "head_dim": 8, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}


@st.composite
def hf_configs(draw):
    raw = dict(LLAMA)
    if draw(st.booleans()):
        raw.update(architectures=["GPTNeoXForCausalLM"], hidden_act="gelu_pytorch_tanh", rotary_pct=1.0)
    for key in draw(st.lists(st.sampled_from(sorted(LLAMA) + ["rotary_pct", "rope_scaling", "use_parallel_residual",
                                                              "layer_norm_eps", "initializer_range"]), max_size=4)):
        raw[key] = draw(values)
    return raw


@FUZZ
@given(batch=batches(hf_configs()))
def test_a_config_json_is_a_model_or_one_line(batch):
    for raw in batch:
        m = refused_or(model_config, raw, "hf")
        if m is not None:
            refused_or(checked_model, m, "hf")


@FUZZ
@given(batch=batches(st.tuples(hf_configs(), st.binary(max_size=12), st.integers(0, 400))))
def test_config_json_text_is_an_object_or_one_line(scratch, batch):
    for raw, noise, where in batch:
        text = json.dumps(raw, default=str, allow_nan=True).encode()
        (scratch / "config.json").write_bytes(text[:where] + noise + text[where:])
        data = refused_or(read_hf_config, scratch)
        assert data is None or isinstance(data, dict)


# ---------------------------------------------------------------- heartbeat and relay messages


@st.composite
def messages(draw):
    """A message of a known type whose fields are sometimes right, sometimes anything."""
    kind = draw(st.sampled_from(sorted(FIELDS)) | st.text(max_size=6))
    good = {"token": "t", "rank": 0, "host": "n", "pid": 1, "coords": None, "phase": "step", "step": 3,
            "phase_s": 0.5, "medians": {}, "counts": {}, "last": None, "start_step": 0, "t": 1.0, "error": "E",
            "message": "m", "user_error": False, "loss_diverged": False, "how": "ok", "code": 0, "stacks": "",
            "records": [], "v": 1, "msg": {"type": "beat"}, "beats": []}
    message = {"type": kind, **{k: good[k] for k in FIELDS.get(kind, {}) if k in good}}
    for key in draw(st.lists(st.sampled_from(sorted(good)), max_size=3)):
        message[key] = draw(values)
    return message


@FUZZ
@given(batch=batches(st.tuples(messages(), st.binary(max_size=16), st.integers(0, 200))))
def test_a_heartbeat_line_is_a_checked_message_or_ignored(batch):
    for message, noise, where in batch:
        line = json.dumps(message, default=str).encode()
        for raw in (line, line[:where] + noise + line[where:], noise):
            parsed = parse_message(raw)  # never raises: a peer's bytes cannot
            if parsed is not None:  # every field the supervisor reads is in shape
                assert all(check(parsed.get(k)) for k, check in FIELDS[parsed["type"]].items())
            assert isinstance(is_dump_request(raw), bool)
        assert valid(message) is None or valid(message)["type"] in FIELDS
        for entry in (message, *(message.get("beats") if isinstance(message.get("beats"), list) else [])):
            assert isinstance(beat_entry(entry), bool)


@FUZZ
@given(batch=batches(st.binary(max_size=64) | values.map(lambda v: json.dumps(v, default=str).encode())))
def test_a_node_reader_hello_is_a_rank_or_one_line(batch):
    for raw in batch:
        hello = refused_or(_hello, raw)
        assert hello is None or (type(hello["rank"]) is int and type(hello["dp"]) is int)
