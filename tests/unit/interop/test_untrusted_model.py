"""A model folder from elsewhere is data (issue #43, findings 1 and 11): a crafted config.json or
safetensors index is refused in one line, and nothing outside the folder is read into the model.
(What an export writes as the tokenizer comes from the run's checked tokenizer/ folder:
mshpc/data/tokenizer_dir.py, tests/unit/data.)"""

import json
import warnings

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from mshpc.config import load_config
from mshpc.errors import InteropError
from mshpc.interop.hf_import import import_config, initial_model

SHAPE = dict(vocab_size=97, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=48,
             max_position_embeddings=32, num_key_value_heads=2)


def saved_llama(path, shard_bytes=None):
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**SHAPE))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model.save_pretrained(path, **({"max_shard_size": shard_bytes} if shard_bytes else {}))
    return path


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return saved_llama(tmp_path_factory.mktemp("hf") / "llama")


def with_config(tmp_path, llama_dir, text, link=False):
    """A folder of `llama_dir`'s weights (a copy, or with `link` a symbolic link to them) and `text` as config.json."""
    hf = tmp_path / "hf"
    hf.mkdir()
    weights = hf / "model.safetensors"
    if link:
        weights.symlink_to(llama_dir / "model.safetensors")
    else:
        weights.write_bytes((llama_dir / "model.safetensors").read_bytes())
    (hf / "config.json").write_text(text)
    return hf


def config_text(llama_dir, **changes):
    data = json.loads((llama_dir / "config.json").read_text())
    data.update(changes)
    return json.dumps(data)


@pytest.mark.parametrize("text, why", [
    (lambda d: config_text(d, num_attention_heads=0), "num_attention_heads=0 is not a whole number from 1"),
    (lambda d: config_text(d).replace('"hidden_size": 32', '"hidden_size": NaN'),
     "not JSON (ValueError: NaN is not a JSON number)"),
    (lambda d: config_text(d).replace('"vocab_size": 97', '"vocab_size": Infinity'), "Infinity is not a JSON number"),
    (lambda d: config_text(d).replace('"vocab_size": 97', '"vocab_size": 1e400'), "vocab_size=inf is not a whole"),
    (lambda d: config_text(d, num_hidden_layers=2.5), "num_hidden_layers=2.5 is not a whole number"),
    (lambda d: config_text(d, architectures="LlamaForCausalLM"), "architecture None is not supported"),
    (lambda d: config_text(d, architectures=[["x"]]), "architecture ['x'] is not supported"),
    (lambda d: config_text(d, rope_parameters=[1]), "rope_parameters=[1] is not an object"),
    (lambda d: config_text(d, rope_parameters={"rope_type": "default", "rope_theta": "big"}),
     "no number 'rope_theta' (got 'big')"),
    (lambda d: config_text(d, num_key_value_heads="2"), "num_key_value_heads='2' is not a whole number"),
    (lambda d: config_text(d, tie_word_embeddings="yes"), "tie_word_embeddings='yes' is not true or false"),
    (lambda d: config_text(d, hidden_act=["silu"]), "hidden_act=['silu'] is not implemented"),
    (lambda d: config_text(d, num_key_value_heads=3), "model.n_kv_head=3 does not divide model.n_head=4"),
    (lambda d: "[" * 100_000 + "]" * 100_000, "not JSON (RecursionError"),
    (lambda d: "[1, 2]", "not a JSON object"),
])
def test_a_bad_config_json_is_one_line(tmp_path, llama_dir, text, why):
    hf = with_config(tmp_path, llama_dir, text(llama_dir))
    with pytest.raises(InteropError) as err:
        import_config(hf, tmp_path / "out.yaml")
    assert "\n" not in str(err.value) and why in str(err.value), str(err.value)
    assert not (tmp_path / "out.yaml").exists()


def test_safetensors_shapes_are_checked_against_config_json_before_reading(tmp_path, llama_dir):
    hf = with_config(tmp_path, llama_dir, config_text(llama_dir, intermediate_size=64))  # the files hold 48
    cfg = import_config(hf, tmp_path / "out.yaml")
    loaded = load_config(tmp_path / "out.yaml")
    with pytest.raises(InteropError) as err:
        initial_model(loaded.model, loaded.train.init_from)
    assert str(err.value) == (f"{hf}: model.layers.0.mlp.gate_proj.weight is [48, 32] in its safetensors, but its "
                              "config.json implies [64, 32]"), cfg


def test_a_weight_file_that_is_a_link_is_refused(tmp_path, llama_dir):
    hf = with_config(tmp_path, llama_dir, config_text(llama_dir), link=True)
    with pytest.raises(InteropError, match=r"model\.safetensors: not a readable safetensors file \(.*a symbolic "
                                           r"link \(not followed\)"):
        import_config(hf, tmp_path / "out.yaml")


@pytest.mark.parametrize("file", ["../outside.safetensors", "/etc/passwd", "sub/model.safetensors", 7])
def test_an_index_naming_a_file_outside_the_folder_is_refused(tmp_path, file):
    hf = saved_llama(tmp_path / "hf", shard_bytes=20_000)
    index_path = hf / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    name = sorted(index["weight_map"])[0]
    index["weight_map"][name] = file
    index_path.write_text(json.dumps(index))
    (tmp_path / "outside.safetensors").write_bytes(next(hf.glob("model-*.safetensors")).read_bytes())
    with pytest.raises(InteropError) as err:
        import_config(hf, tmp_path / "out.yaml")
    assert str(err.value) == (f"{index_path}: tensor {name!r} is in {file!r}, not a .safetensors file of this "
                              "folder")
