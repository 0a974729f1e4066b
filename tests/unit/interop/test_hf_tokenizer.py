"""SentencePiece and tiktoken tokenizers exported by transformers' own converters: AutoTokenizer on
the exported folder gives the ids of the tokenizer's own library (models and ranks made here,
nothing downloaded), and a conversion that would read text otherwise is refused in one line."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import pytest

from mshpc.data.tokenizer import build_tokenizer
from mshpc.errors import InteropError
from mshpc.interop.hf_tokenizer import write_tokenizer

CORPUS = [f"hello world {i}: def f(x): return x + {i}  # ünïcode déjà vu, 日本語 {i * 7}" for i in range(300)]
TEXTS = ["hello world", "def f(x):\n    return x + 1\n", "déjà vu — ünïcode 123", "  spaces  ", "\ttab\r\n",
         "ﬁ ＡＢＣ ① ½", "日本語 😀", "</s> <s> <unk> <|endoftext|> in text", "a  b   c", ""]


def _spm(root: Path, name: str, **options: object) -> Path:
    import sentencepiece

    (root / "c.txt").write_text("\n".join(CORPUS))
    sentencepiece.SentencePieceTrainer.train(input=str(root / "c.txt"), model_prefix=str(root / name),
                                             minloglevel=2, **options)
    return root / f"{name}.model"


def _autotokenizer(folder: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder)


@pytest.mark.parametrize("options", [dict(model_type="bpe", vocab_size=300, byte_fallback=True),
                                     dict(model_type="unigram", vocab_size=60)], ids=["bpe-byte-fallback", "unigram"])
def test_sentencepiece_exports_the_ids_sentencepiece_gives(tmp_path: Path, options: dict) -> None:
    import sentencepiece

    model = _spm(tmp_path, "sp", **options)
    sp = sentencepiece.SentencePieceProcessor(model_file=str(model))
    (tmp_path / "hf").mkdir()
    eos, line = write_tokenizer(build_tokenizer(str(model)), tmp_path / "hf", 64)
    hf = _autotokenizer(tmp_path / "hf")
    plain = [t for t in TEXTS if "<" not in t]
    assert [hf(t)["input_ids"] for t in plain] == [sp.encode(t) for t in plain]
    assert eos == hf.eos_token_id == sp.eos_id()
    assert hf.decode(sp.encode(CORPUS[3])) == sp.decode(sp.encode(CORPUS[3]))
    assert "by transformers' SpmConverter (tokenizer.json, same ids)" in line
    # text that spells a control piece: characters to SentencePiece and to BPE in tokenizers; a Unigram
    # model in tokenizers matches the piece itself, and the export's line says so
    if options["model_type"] == "bpe":
        assert hf(TEXTS[7])["input_ids"] == sp.encode(TEXTS[7]) and "differs" not in line
    else:
        assert "; text that spells a special token differs on 'a<unk>b <unk>' from token " in line


def _ranks_file(path: Path) -> dict[bytes, int]:
    """A tiktoken ranks file as tiktoken's own files are made: a byte-level BPE's tokens by merge order."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=400, show_progress=False,
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    byte_of = {ch: b for b, ch in bytes_to_unicode().items()}
    tokens = sorted(bpe.get_vocab().items(), key=lambda kv: kv[1])
    ranks = {bytes(byte_of[ch] for ch in token): rank for rank, (token, _) in enumerate(tokens)}
    path.write_text("".join(f"{base64.b64encode(t).decode()} {r}\n" for t, r in ranks.items()))
    return ranks


def test_tiktoken_exports_the_ids_tiktoken_gives(tmp_path: Path) -> None:
    import tiktoken

    from mshpc.data.tokenizer_libs import CL100K_PATTERN

    ranks = _ranks_file(tmp_path / "mine.tiktoken")
    enc = tiktoken.Encoding("mine", pat_str=CL100K_PATTERN, mergeable_ranks=ranks,
                            special_tokens={"<|endoftext|>": len(ranks)})
    (tmp_path / "hf").mkdir()
    eos, line = write_tokenizer(build_tokenizer(str(tmp_path / "mine.tiktoken")), tmp_path / "hf", 64)
    hf = _autotokenizer(tmp_path / "hf")
    for text in TEXTS + CORPUS[:3]:  # <|endoftext|> inside a document is text, as encode_ordinary reads it
        assert hf(text)["input_ids"] == enc.encode_ordinary(text), text
    assert eos == hf.eos_token_id == len(ranks) and hf.decode(enc.encode_ordinary(TEXTS[2])) == TEXTS[2]
    assert "by transformers' TikTokenConverter (tokenizer.json, same ids)" in line
    assert json.loads((tmp_path / "hf" / "tokenizer_config.json").read_text())["split_special_tokens"] is True


def test_a_conversion_that_reads_text_otherwise_is_refused_and_nothing_is_written(tmp_path: Path) -> None:
    from support.hf_models import NEOX_SERIAL

    from mshpc.interop.hf_export import write_hf
    from mshpc.model.gpt import GPT

    # pieces that end in the space marker: transformers' converter puts it in front of words
    model = _spm(tmp_path, "suffix", model_type="bpe", vocab_size=200, treat_whitespace_as_suffix=True)
    weights = {n: p.detach() for n, p in GPT(NEOX_SERIAL).named_parameters()}
    with pytest.raises(InteropError) as err:
        write_hf(tmp_path / "hf", NEOX_SERIAL, weights, build_tokenizer(str(model)))
    message = str(err.value)
    assert "\n" not in message and message.startswith(f"sentencepiece tokenizer {model}: transformers' SpmConverter "
                                                      "reads text otherwise on 'hello world' from token 0: ")
    assert message.endswith("not exporting a tokenizer that would give other ids than the model trained on")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.txt", "suffix.model", "suffix.vocab"]
