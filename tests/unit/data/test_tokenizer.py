"""Tokenizers: bytes, BPE json files, and the errors that list the choices."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest

from mshpc.data.prepare import PrepareOptions, prepare_corpus
from mshpc.data.shards import TokenDataset
from mshpc.data.tokenizer import ByteTokenizer, build_tokenizer
from mshpc.errors import DataError
from support.bpe import train_bpe

HAVE_TOKENIZERS = importlib.util.find_spec("tokenizers") is not None


def test_byte_tokenizer_maps_each_byte_to_its_value() -> None:
    tok = build_tokenizer("byte")
    assert isinstance(tok, ByteTokenizer)
    assert (tok.name, tok.vocab_size, tok.eos_id) == ("byte", 257, 256)
    text = "añ\n"
    np.testing.assert_array_equal(tok.encode(text), list(text.encode()))


def test_unknown_spec_lists_the_choices(tmp_path: Path) -> None:
    for spec in ("gpt2", str(tmp_path / "missing.json")):
        with pytest.raises(DataError, match="is unknown or missing \\(choose 'byte', a tokenizer.json"):
            build_tokenizer(spec)


@pytest.mark.skipif(HAVE_TOKENIZERS, reason="tokenizers is installed, so it cannot be missing")
def test_bpe_without_tokenizers_says_how_to_install(tmp_path: Path) -> None:
    (tmp_path / "tok.json").write_text("{}")
    with pytest.raises(DataError, match="pip install tokenizers"):
        build_tokenizer(str(tmp_path / "tok.json"))


@pytest.mark.skipif(not HAVE_TOKENIZERS, reason="needs the tokenizers package")
def test_bpe_file_prepares_a_dataset(corpus: Path, tmp_path: Path) -> None:
    hf = train_bpe(tmp_path / "bpe.json", ["<|endoftext|>"])
    tok = build_tokenizer(str(tmp_path / "bpe.json"))
    assert tok.eos_id == hf.token_to_id("<|endoftext|>") and tok.vocab_size == hf.get_vocab_size()
    ds = TokenDataset.open(prepare_corpus([corpus], tmp_path / "ds", PrepareOptions(tokenizer=str(tmp_path / "bpe.json"))))
    assert ds.eos_id == tok.eos_id and ds.tokenizer == str(tmp_path / "bpe.json")
    stream = ds.tokens(0, ds.n_tokens)
    first = stream[: ds.doc_starts()[1] - 1]
    assert hf.decode(first.tolist()).strip() == "hello world"


@pytest.mark.skipif(not HAVE_TOKENIZERS, reason="needs the tokenizers package")
def test_bpe_without_an_eos_token_gets_one_more_id(tmp_path: Path) -> None:
    hf = train_bpe(tmp_path / "bpe.json", [])
    tok = build_tokenizer(str(tmp_path / "bpe.json"))
    assert tok.eos_id == hf.get_vocab_size() and tok.vocab_size == tok.eos_id + 1


def test_byte_decode_inverts_encode_and_skips_the_end_of_document_id() -> None:
    tok = ByteTokenizer()
    text = "añ\n€"
    assert tok.decode([*tok.encode(text).tolist(), 256]) == text


@pytest.mark.skipif(not HAVE_TOKENIZERS, reason="needs the tokenizers package")
def test_bpe_decode_inverts_encode_and_skips_ids_past_its_vocabulary(tmp_path: Path) -> None:
    train_bpe(tmp_path / "bpe.json", [])  # no end-of-text token: its id is one past the vocabulary
    tok = build_tokenizer(str(tmp_path / "bpe.json"))
    ids = tok.encode("hello world").tolist()
    assert len(ids) < len("hello world")  # merged: really BPE
    # ByteLevel pre-tokenizing adds a space before the first word, as GPT-2 does
    assert tok.decode([*ids, tok.eos_id]) == " hello world"
