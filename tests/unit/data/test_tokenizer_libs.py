"""The tokenizers people use, made here (nothing downloaded): mshpc's ids must be the ids of each
one's own library: transformers' AutoTokenizer, SentencePieceProcessor, tiktoken.Encoding."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from mshpc.data.prepare import PrepareOptions, prepare_corpus
from mshpc.data.shards import TokenDataset
from mshpc.data.tokenizer import build_tokenizer, document_ids
from mshpc.data.tokenizer_dir import fingerprint, load_tokenizer_dir, save_tokenizer_dir
from mshpc.data.tokenizer_train import train_tokenizer
from mshpc.errors import DataError

SAMPLES = ["hello world", "def f(x):\n    return x + 1\n", "déjà vu — ünïcode 123", "  spaces  ", "<|endoftext|> in text"]
CORPUS = [f"hello world {i} def f(x): return x + {i} ünïcode" for i in range(200)]


@pytest.fixture(scope="module")
def bpe_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A byte-level BPE trained by `mshpc tokenizer train` on a JSONL corpus."""
    root = tmp_path_factory.mktemp("bpe")
    (root / "c.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in CORPUS))
    return train_tokenizer([root / "c.jsonl"], root / "tok", 400)


def test_mshpc_tokenizer_train_gives_autotokenizer_ids(bpe_folder: Path) -> None:
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(bpe_folder)
    ours = build_tokenizer(str(bpe_folder))
    assert ours.kind == "hf" and ours.eos_id == hf.eos_token_id == 0 and ours.vocab_size == len(hf) == 400
    for text in SAMPLES:
        assert ours.encode(text).tolist() == hf(text)["input_ids"]
    # prepare's batches: the ASCII ones through the fast engine (data/fast_bpe.py), the others not
    assert ours._fast is not None  # type: ignore[attr-defined]
    assert [a.tolist() for a in ours.encode_batch(SAMPLES)] == [hf(t)["input_ids"] for t in SAMPLES]
    assert ours.decode(ours.encode(SAMPLES[2]).tolist()) == SAMPLES[2]


def test_a_llama3_style_folder_keeps_its_begin_of_text_rule(bpe_folder: Path, tmp_path: Path) -> None:
    """A folder whose post-processor adds BOS (Llama 3's), saved by transformers' save_pretrained."""
    from tokenizers import Tokenizer, processors
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    rust = Tokenizer.from_file(str(bpe_folder / "tokenizer.json"))
    rust.add_special_tokens(["<|begin_of_text|>", "<|end_of_text|>"])
    bos = rust.token_to_id("<|begin_of_text|>")
    rust.post_processor = processors.TemplateProcessing(single="<|begin_of_text|> $A", pair="<|begin_of_text|> $A $B",
                                                        special_tokens=[("<|begin_of_text|>", bos)])
    PreTrainedTokenizerFast(tokenizer_object=rust, bos_token="<|begin_of_text|>",
                            eos_token="<|end_of_text|>").save_pretrained(tmp_path / "llama")
    hf = AutoTokenizer.from_pretrained(tmp_path / "llama")
    ours = build_tokenizer(str(tmp_path / "llama"))
    assert ours.eos_id == hf.eos_token_id == rust.token_to_id("<|end_of_text|>")
    for text in SAMPLES:
        assert ours.encode(text).tolist() == hf(text)["input_ids"] and ours.encode(text)[0] == bos
    assert document_ids(ours, "hi").tolist() == [*hf("hi")["input_ids"], ours.eos_id]


def test_sentencepiece_ids_are_sentencepieces(tmp_path: Path) -> None:
    import sentencepiece

    (tmp_path / "c.txt").write_text("\n".join(CORPUS))
    sentencepiece.SentencePieceTrainer.train(input=str(tmp_path / "c.txt"), model_prefix=str(tmp_path / "sp"),
                                             vocab_size=50, minloglevel=2)
    sp = sentencepiece.SentencePieceProcessor(model_file=str(tmp_path / "sp.model"))
    ours = build_tokenizer(str(tmp_path / "sp.model"))
    assert (ours.kind, ours.eos_id, ours.vocab_size) == ("sentencepiece", sp.eos_id(), sp.get_piece_size())
    for text in SAMPLES:
        assert ours.encode(text).tolist() == sp.encode(text)
    assert ours.decode(ours.encode("hello world").tolist()) == sp.decode(sp.encode("hello world"))


def test_tiktoken_ids_are_tiktokens(tmp_path: Path) -> None:
    import base64

    import tiktoken

    from mshpc.data.tokenizer_libs import CL100K_PATTERN

    ranks = {bytes([b]): b for b in range(256)}
    for piece in (b"he", b"ll", b"hell", b"hello", b" w", b" wor", b"or", b"ld", b" world", b"\xc3\xa9"):
        ranks[piece] = len(ranks)
    # the format tiktoken.load.dump_tiktoken_bpe writes (it needs blobfile): base64 token, rank
    lines = [f"{base64.b64encode(token).decode()} {rank}\n" for token, rank in ranks.items()]
    (tmp_path / "mine.tiktoken").write_text("".join(lines))
    enc = tiktoken.Encoding("mine", pat_str=CL100K_PATTERN, mergeable_ranks=ranks, special_tokens={})
    ours = build_tokenizer(str(tmp_path / "mine.tiktoken"))
    assert (ours.kind, ours.eos_id, ours.vocab_size) == ("tiktoken", len(ranks), len(ranks) + 1)
    for text in SAMPLES:
        assert ours.encode(text).tolist() == enc.encode_ordinary(text)
    assert ours.encode("hello world").tolist() == [ranks[b"hello"], ranks[b" world"]]
    assert ours.decode([*ours.encode("déjà").tolist(), ours.eos_id]) == "déjà"


def test_a_dataset_keeps_its_tokenizer_and_a_tampered_copy_is_refused(bpe_folder: Path, tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text(SAMPLES[1])
    ds = TokenDataset.open(prepare_corpus([tmp_path / "a.txt"], tmp_path / "ds", PrepareOptions(tokenizer=str(bpe_folder))))
    assert ds.tokenizer_dir is not None
    kept = load_tokenizer_dir(ds.tokenizer_dir)
    assert fingerprint(kept) == fingerprint(build_tokenizer(str(bpe_folder)))
    np.testing.assert_array_equal(ds.tokens(0, ds.n_tokens), document_ids(kept, SAMPLES[1]))
    copy = save_tokenizer_dir(kept, tmp_path / "copy")
    (copy / "tokenizer.json").write_text((copy / "tokenizer.json").read_text().replace('"hello"', '"hullo"'))
    with pytest.raises(DataError, match=r"copy/tokenizer\.json: missing, or its sha256 is not the one"):
        load_tokenizer_dir(copy)


def test_unknown_tokenizers_and_a_small_vocab_are_one_line(tmp_path: Path) -> None:
    (tmp_path / "x.bin").write_bytes(b"\0")
    with pytest.raises(DataError, match=r"tokenizer '.*x\.bin' is unknown or missing \(choose 'byte'"):
        build_tokenizer(str(tmp_path / "x.bin"))
    with pytest.raises(DataError, match=r"--vocab 100 must be >= 257"):
        train_tokenizer([tmp_path / "x.bin"], tmp_path / "tok", 100)
