"""The fast engine for byte-level BPEs (data/fast_bpe.py) must give the `tokenizers` engine's ids
on every text it takes, and not be used where it cannot."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from mshpc.data import fast_bpe
from mshpc.data.byte_level import bytes_to_unicode
from mshpc.data.tokenizer import build_tokenizer
from mshpc.data.tokenizer_train import train_tokenizer
from mshpc.interop.hf_tokenizer import byte_tokenizer_json

pytest.importorskip("tiktoken")
tokenizers = pytest.importorskip("tokenizers")

WORDS = ["the", "cat", "isn't", "they're", "we'll", "I'd", "3.14", "x+=1", "def", "f(x):", "\t", "\n\n", "  ",
         "don't", "'s", "<|endoftext", "|>", "ünï", "日本", "--", "...", "0x1F", "ABC", "aBc1"]


def _texts(n: int, seed: int) -> list[str]:
    """Texts of words, spaces and every ASCII character (controls included), some not ASCII."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        parts = [rng.choice(WORDS) if rng.random() < 0.6 else chr(rng.randrange(128))
                 for _ in range(rng.randrange(1, 80))]
        out.append("".join(p + rng.choice(["", " ", "  ", "\n", " \t"]) for p in parts))
    return out + ["", " ", "<|endoftext|>", "a<|endoftext|>b"]


@pytest.fixture(scope="module")
def bpe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A byte-level BPE trained by `mshpc tokenizer train` on texts like the ones checked."""
    root = tmp_path_factory.mktemp("fast-bpe")
    (root / "c.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in _texts(400, seed=0)))
    return train_tokenizer([root / "c.jsonl"], root / "tok", 600)


def test_the_fast_engine_gives_the_tokenizers_ids(bpe: Path) -> None:
    ours = build_tokenizer(str(bpe))
    rust = tokenizers.Tokenizer.from_file(str(bpe / "tokenizer.json"))
    fast = fast_bpe.build(rust)
    assert fast is not None
    texts = _texts(2000, seed=1)
    taken = [t for t in texts if fast.takes(t)]
    assert 300 < len(taken) < len(texts)  # both engines are exercised
    assert not fast.takes("a<|endoftext|>b") and not fast.takes("ünï") and fast.takes("a\x00\x1f\x7f b")
    for text in taken:
        assert fast.encode(text) == rust.encode(text).ids, repr(text)
    assert [a.tolist() for a in ours.encode_batch(texts)] == [e.ids for e in rust.encode_batch_fast(texts)]
    assert [a.tolist() for a in ours.encode_batch(texts)] == [ours.encode(t).tolist() for t in texts]


def _handmade(vocab: list[str], merges: list[tuple[str, str]]) -> tokenizers.Tokenizer:
    """A byte-level BPE over every byte plus `vocab` (in id order), with `merges`."""
    config = byte_tokenizer_json()
    config["pre_tokenizer"]["use_regex"] = True  # GPT-2's splitting (mshpc's byte tokenizer does not split)
    table = config["model"]["vocab"]
    for token in vocab:
        table[token] = len(table) + 1  # 256 is the end-of-text token
    config["model"]["merges"] = [list(m) for m in merges]
    return tokenizers.Tokenizer.from_str(json.dumps(config))


def test_a_token_the_merges_never_make_is_left_out() -> None:
    # "abc" is in the vocabulary, made by ab + c; but b + c merges first, and a + bc is no merge:
    # `tokenizers` makes [a, bc] of "abc", tiktoken's table would make [abc] if it held it.
    rust = _handmade(["bc", "ab", "abc"], [("b", "c"), ("a", "b"), ("ab", "c")])
    fast = fast_bpe.build(rust)
    assert fast is not None
    for text in ["abc", "abcabc ab abd xbc", "zabc"]:
        assert fast.encode(text) == rust.encode(text).ids
    assert rust.encode("abc").ids == [rust.token_to_id("a"), rust.token_to_id("bc")]


def test_merges_whose_ids_are_out_of_order_keep_the_tokenizers_engine() -> None:
    assert fast_bpe.build(_handmade(["ab", "cd"], [("a", "b"), ("c", "d")])) is not None
    assert fast_bpe.build(_handmade(["ab", "cd"], [("c", "d"), ("a", "b")])) is None


@pytest.mark.parametrize("change", ["normalizer", "prefix_space", "template", "no_regex", "missing_byte"])
def test_a_pipeline_other_than_gpt2s_keeps_the_tokenizers_engine(change: str) -> None:
    config = byte_tokenizer_json()
    if change == "normalizer":
        config["normalizer"] = {"type": "Lowercase"}
    elif change == "prefix_space":
        config["pre_tokenizer"] = {**config["pre_tokenizer"], "use_regex": True, "add_prefix_space": True}
    elif change == "template":
        config["post_processor"] = {"type": "TemplateProcessing", "single": [{"SpecialToken": {"id": "<|endoftext|>",
                                    "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}], "pair": [],
                                    "special_tokens": {"<|endoftext|>": {"id": "<|endoftext|>", "ids": [256],
                                                                         "tokens": ["<|endoftext|>"]}}}
    elif change == "missing_byte":
        del config["model"]["vocab"][bytes_to_unicode()[0x41]]
    if change != "no_regex":  # byte_tokenizer_json's own ByteLevel does not split: not GPT-2's pipeline
        config["pre_tokenizer"] = {**config["pre_tokenizer"], "use_regex": True}
    assert fast_bpe.build(tokenizers.Tokenizer.from_str(json.dumps(config))) is None
    if change == "no_regex":
        config["pre_tokenizer"]["use_regex"] = True
        assert fast_bpe.build(tokenizers.Tokenizer.from_str(json.dumps(config))) is not None


def test_a_splitting_pattern_that_reads_ascii_otherwise_keeps_the_tokenizers_engine(
        bpe: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    rust = tokenizers.Tokenizer.from_file(str(bpe / "tokenizer.json"))
    # GPT-2's pattern without its rule that leaves a space to the next word: the probe of ASCII
    # pairs reads differently on the two engines.
    pattern = fast_bpe.GPT2_PATTERN.replace(r"|\s+(?!\S)", "")
    assert pattern != fast_bpe.GPT2_PATTERN
    monkeypatch.setattr(fast_bpe, "GPT2_PATTERN", pattern)
    assert fast_bpe.build(rust) is None
