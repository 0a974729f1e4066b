"""The tokenizer files of an export, so that `AutoTokenizer.from_pretrained(OUT_DIR)` gives the
ids the model was trained on.

mshpc's byte tokenizer (data/tokenizer.py: byte b is id b, 256 ends a document) is GPT-2's
byte-level BPE with no merges: every byte its own token, under GPT-2's byte -> printable
character table, with `<|endoftext|>` added as id 256. A Hugging Face tokenizer (the run keeps its
files, data/tokenizer_dir.py) is copied with its own tokenizer_config.json. SentencePiece and
tiktoken tokenizers are converted by transformers' own converters and checked against their
libraries' ids (interop/hf_tokenizer_convert.py).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from mshpc.data.byte_level import bytes_to_unicode
from mshpc.data.tokenizer import ByteTokenizer, Tokenizer
from mshpc.errors import InteropError

BYTE_EOS = "<|endoftext|>"


def byte_tokenizer_json() -> dict[str, Any]:
    """tokenizer.json of mshpc's byte tokenizer, in the `tokenizers` library's format."""
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}
    vocab = {ch: b for b, ch in bytes_to_unicode().items()}
    eos = {"id": ByteTokenizer.eos_id, "content": BYTE_EOS, "single_word": False, "lstrip": False,
           "rstrip": False, "normalized": False, "special": True}
    return {"version": "1.0", "truncation": None, "padding": None, "added_tokens": [eos],
            "normalizer": None, "pre_tokenizer": byte_level, "post_processor": None, "decoder": byte_level,
            "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                      "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False,
                      "ignore_merges": False, "vocab": vocab, "merges": []}}


def _hf_config(tokenizer: Tokenizer, max_len: int) -> dict[str, Any]:
    """The tokenizer_config.json of a Hugging Face tokenizer: its own (so AutoTokenizer applies its
    own rules, as on the folder it came from), else a plain fast tokenizer ending in its eos."""
    path = tokenizer.files().get("tokenizer_config.json")
    if path is not None:
        config = json.loads(path.read_text())
        if isinstance(config, dict):
            return config
    tokens = json.loads(tokenizer.files()["tokenizer.json"].read_text())
    ids = {**tokens.get("model", {}).get("vocab", {}), **{t["content"]: t["id"] for t in tokens.get("added_tokens", [])}}
    eos = next((t for t, i in ids.items() if i == tokenizer.eos_id), None)
    return {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": max_len, "eos_token": eos,
            "bos_token": None, "add_bos_token": False, "clean_up_tokenization_spaces": False}


def write_tokenizer(tokenizer: Tokenizer, out_dir: Path, max_len: int) -> tuple[int | None, str]:
    """Write the run's `tokenizer` into `out_dir` so that AutoTokenizer gives its ids; return its
    end-of-document id (None where the tokenizer has no token of its own for it) and a line."""
    if tokenizer.kind == "byte":
        (out_dir / "tokenizer.json").write_text(json.dumps(byte_tokenizer_json(), ensure_ascii=False) + "\n")
        config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": max_len, "eos_token": BYTE_EOS,
                  "bos_token": None, "add_bos_token": False, "clean_up_tokenization_spaces": False}
        (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
        return ByteTokenizer.eos_id, "tokenizer: mshpc's byte tokenizer as byte-level BPE without merges (tokenizer.json)"
    if tokenizer.kind == "hf":
        shutil.copyfile(tokenizer.files()["tokenizer.json"], out_dir / "tokenizer.json")
        config = _hf_config(tokenizer, max_len)
        (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
        own = config.get("eos_token") is not None or tokenizer.eos_id < tokenizer.vocab_size - 1
        line = f"tokenizer: the run's ({tokenizer.name}; tokenizer.json, tokenizer_config.json)"
        if not own:
            line += "; it has no end-of-text token, so mshpc's extra end-of-document id is unknown to it"
        return (tokenizer.eos_id if own else None), line
    return _write_converted(tokenizer, out_dir, max_len)


def _write_converted(tokenizer: Tokenizer, out_dir: Path, max_len: int) -> tuple[int | None, str]:
    """A SentencePiece or tiktoken tokenizer as transformers' converter writes it, once AutoTokenizer
    on `out_dir` gives its ids on every probe; an InteropError naming the first difference otherwise."""
    from mshpc.interop import hf_tokenizer_convert as convert

    transformers = convert.transformers_module()
    if tokenizer.kind == "sentencepiece":
        backend, specials = convert.sentencepiece_backend(tokenizer.files()["tokenizer.model"])
        converter = "SpmConverter"
    else:
        backend, specials = convert.tiktoken_backend(tokenizer.files()["ranks.tiktoken"], tokenizer.eos_id)
        converter = "TikTokenConverter"
    backend.save(str(out_dir / "tokenizer.json"))
    # special-token text stays text, as in the data (see hf_tokenizer_convert's doc)
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": max_len, **specials,
              "split_special_tokens": True, "clean_up_tokenization_spaces": False}
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    auto = transformers.AutoTokenizer.from_pretrained(out_dir)
    known = backend.get_vocab_size(with_added_tokens=False)
    where = f"{tokenizer.kind} tokenizer {tokenizer.name}"
    diff = convert.first_difference(tokenizer, auto, convert.probe_texts(tokenizer, known))
    if diff is not None:
        raise InteropError(f"{where}: transformers' {converter} reads text otherwise {diff}; not exporting a "
                           "tokenizer that would give other ids than the model trained on")
    own = auto.eos_token_id == tokenizer.eos_id
    line = f"tokenizer: the run's {tokenizer.kind} tokenizer by transformers' {converter} (tokenizer.json, same ids)"
    if not own:
        line += "; it has no end-of-text token, so mshpc's extra end-of-document id is unknown to it"
    special = convert.first_difference(tokenizer, auto, convert.special_probes(list(specials.values())))
    if special is not None:
        line += f"; text that spells a special token differs {special}"
    return (tokenizer.eos_id if own else None), line
