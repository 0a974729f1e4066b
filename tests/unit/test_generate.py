"""Decoding with the key/value cache against full recomputation of the same model, the sampling
rules, and the one-line errors of `mshpc generate`."""

import dataclasses

import pytest
import torch
from support.ckpt_runs import sharded_checkpoint

from mshpc.cli import main
from mshpc.config import ModelConfig
from mshpc.errors import CheckpointError, ConfigError
from mshpc.generate import SampleOptions, decode, generate, load_model, next_token
from mshpc.model.attention import KVCache
from mshpc.model.gpt import GPT

BASE = ModelConfig(vocab_size=61, seq_len=32, n_layer=2, n_head=4, d_model=32, init_std=0.5, tie_embeddings=False)
CASES = {  # init_std 0.5, untied: greedy then wanders instead of repeating one token
    "serial": {},
    "parallel-block": {"parallel_block": True},
    "window-4": {"sliding_window": 4},
    "parallel-window-3-gqa": {"parallel_block": True, "sliding_window": 3, "n_kv_head": 2},
    "mqa-layernorm": {"n_kv_head": 1, "norm": "layernorm"},
}


def model(case: str) -> GPT:
    torch.manual_seed(0)
    return GPT(dataclasses.replace(BASE, **CASES[case])).eval()


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_with_the_cache_equals_full_recomputation(case):
    m = model(case)
    prompt = [3, 14, 15, 9, 2, 6]  # longer than the windows: the prefill masks too
    opts = SampleOptions(max_new_tokens=24, greedy=True)
    cached, full = decode(m, prompt, opts), decode(m, prompt, opts, cache=False)
    assert cached == full and len(cached) == 24
    assert len(set(cached)) > 3  # a sequence that moves, so a wrong position would show


@pytest.mark.parametrize("case", ["window-4", "parallel-window-3-gqa"])
def test_cached_logits_equal_the_full_forwards_at_every_position(case):
    m = model(case)
    ids = torch.randint(0, BASE.vocab_size, (1, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = m(ids)[0]  # (20, vocab)
        caches = [KVCache() for _ in m.layers]
        steps = [m(ids[:, :5], caches=caches)[0]] + [m(ids[:, i:i + 1], caches=caches)[0] for i in range(5, 20)]
    torch.testing.assert_close(torch.cat(steps), full, rtol=1e-5, atol=1e-5)
    window = m.cfg.sliding_window
    assert all(c.length == 20 and c.k is not None and c.k.shape[1] == window for c in caches)  # only W keys kept


def test_sampling_rules():
    logits = torch.tensor([0.0, 3.0, 1.0, 2.9])
    gen = torch.Generator().manual_seed(0)
    assert next_token(logits, SampleOptions(greedy=True), gen) == 1
    assert {next_token(logits, SampleOptions(top_k=1), gen) for _ in range(20)} == {1}
    # p=0.5: token 1 alone (0.47) does not reach it, tokens 1 and 3 (0.90) do
    assert {next_token(logits, SampleOptions(top_p=0.5), gen) for _ in range(50)} == {1, 3}
    assert {next_token(logits, SampleOptions(temperature=100.0), gen) for _ in range(200)} == {0, 1, 2, 3}


def test_same_seed_same_sample_and_the_padded_vocabulary_is_never_drawn():
    m, opts = model("serial"), SampleOptions(max_new_tokens=20, temperature=2.0, seed=7)
    first = decode(m, [1, 2, 3], opts, vocab=10)
    assert first == decode(m, [1, 2, 3], opts, vocab=10) and max(first) < 10
    assert first != decode(m, [1, 2, 3], dataclasses.replace(opts, seed=8), vocab=10)


def test_generation_stops_at_the_end_of_document_id():
    m = model("serial")
    free = decode(m, [1, 2], SampleOptions(max_new_tokens=10, greedy=True))
    stopped = decode(m, [1, 2], SampleOptions(max_new_tokens=10, greedy=True), stop_id=free[2])
    assert stopped == free[:free.index(free[2]) + 1]


@pytest.mark.parametrize("opts,message", [
    (SampleOptions(temperature=0.0), "--temperature=0.0 must be > 0 (use --greedy"),
    (SampleOptions(top_p=1.5), "--top-p=1.5 must be in (0, 1]"),
    (SampleOptions(top_k=0), "--top-k=0 must be >= 1"),
    (SampleOptions(max_new_tokens=0), "--max-new-tokens=0 must be >= 1"),
])
def test_bad_options_are_one_line_errors(opts, message, tmp_path):
    with pytest.raises(ConfigError) as info:
        generate(tmp_path, "hello", opts)
    assert message in str(info.value) and "\n" not in str(info.value)


def test_empty_prompt_missing_checkpoint_and_too_long_a_request(tmp_path):
    with pytest.raises(ConfigError, match="--prompt is empty"):
        generate(tmp_path, "", SampleOptions())
    with pytest.raises(CheckpointError, match="does not exist"):
        generate(tmp_path / "nope", "hi", SampleOptions())
    with pytest.raises(CheckpointError, match="neither a run directory"):
        generate(tmp_path, "hi", SampleOptions())
    with pytest.raises(ConfigError, match="exceeds model.seq_len=32 \\(choose at most 22\\)"):
        decode(model("serial"), list(range(10)), SampleOptions(max_new_tokens=23))


@pytest.mark.parametrize("args,words", [
    (["nope", "--prompt", "x"], "CheckpointError: nope does not exist"),
    ([".", "--prompt", "x", "--temperature", "-1"], "ConfigError: --temperature=-1.0 must be > 0"),
    ([".", "--prompt", ""], "ConfigError: --prompt is empty"),
])
def test_cli_bad_input_is_one_line_and_exit_2(args, words, capsys, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    assert main(["generate", *args]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and words in lines[0], lines


def test_generate_from_a_run_directory_with_a_bpe_tokenizer(tmp_path):
    """End to end without training: a run directory holding config.yaml and a checkpoint of the
    `model/` weights, written as a save writes them; the BPE file's text comes back around the
    model's greedy tokens."""
    pytest.importorskip("tokenizers")
    from support.bpe import train_bpe
    from support.ckpt_runs import sharded_checkpoint

    from mshpc.config import dump_yaml, load_config
    from mshpc.data.tokenizer import build_tokenizer

    train_bpe(tmp_path / "bpe.json", ["<|endoftext|>"])
    cfg = load_config(None, ["model.vocab_size=320", "model.seq_len=32", "model.n_layer=2", "model.n_head=4",
                             "model.n_kv_head=2", "model.d_model=32", "model.init_std=0.5",
                             f"data.tokenizer={tmp_path / 'bpe.json'}"])
    run = tmp_path / "run"
    (run / "checkpoints" / "step-0000003").mkdir(parents=True)
    (run / "config.yaml").write_text(dump_yaml(cfg))
    torch.manual_seed(0)
    m = GPT(cfg.model).eval()
    sharded_checkpoint(run / "checkpoints" / "step-0000003", {}, 1,
                       whole={f"model/{n}": (p.detach(), 0) for n, p in m.named_parameters()})
    tok = build_tokenizer(cfg.data.tokenizer)
    opts = SampleOptions(max_new_tokens=8, greedy=True)
    text, tokens_per_s = generate(run, "hello world", opts)
    prompt = tok.encode("hello world").tolist()
    assert text == tok.decode(prompt + decode(m, prompt, opts, stop_id=tok.eos_id, vocab=tok.vocab_size))
    assert text.startswith(" hello world") and tokens_per_s > 0  # ByteLevel's prefix space


def test_load_model_reads_the_model_copy_and_names_a_weight_the_config_does_not_fit(tmp_path):
    saved = model("parallel-window-3-gqa")
    sharded_checkpoint(tmp_path, {}, n_shards=1, whole={f"model/{n}": (p.detach(), 0) for n, p in saved.named_parameters()})
    loaded = load_model(tmp_path, saved.cfg)
    assert not loaded.training
    assert all(torch.equal(p, dict(saved.named_parameters())[n]) for n, p in loaded.named_parameters())
    with pytest.raises(CheckpointError, match=r"model/layers\.0\.attn\.qkv\.weight is \[64, 32\] but the run's config has \[96, 32\]"):
        load_model(tmp_path, dataclasses.replace(saved.cfg, n_kv_head=4))
