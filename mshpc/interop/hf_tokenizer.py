"""The tokenizer files of an export, so that `AutoTokenizer.from_pretrained(OUT_DIR)` gives the
ids the model was trained on.

mshpc's byte tokenizer (data/tokenizer.py: byte b is id b, 256 ends a document) is GPT-2's
byte-level BPE with no merges: every byte its own token, under GPT-2's byte -> printable
character table, with `<|endoftext|>` added as id 256. A `tokenizers` BPE file is copied as it is.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from mshpc.data.tokenizer import EOS_TOKENS, ByteTokenizer

BYTE_EOS = "<|endoftext|>"


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's table (Radford et al. 2019, encoder.py): printable bytes stand for themselves,
    the others are moved to code points from 256 up, so every byte is a visible character."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


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


def _bpe_eos(tokenizer: dict[str, Any]) -> tuple[str | None, int | None]:
    """The end-of-document token data/tokenizer.py would pick from this tokenizer.json and its
    id, or (None, None)."""
    ids = {**tokenizer.get("model", {}).get("vocab", {}),
           **{t["content"]: t["id"] for t in tokenizer.get("added_tokens", [])}}
    found = next((t for t in EOS_TOKENS if t in ids), None)
    return found, None if found is None else int(ids[found])


def write_tokenizer(spec: str, out_dir: Path, max_len: int) -> tuple[int | None, str]:
    """Write the tokenizer named by data.tokenizer `spec` into `out_dir`; return its
    end-of-document id (None if it has none of its own) and a line saying what was written."""
    eos: str | None
    eos_id: int | None
    if spec == "byte":
        tokenizer, eos, eos_id = byte_tokenizer_json(), BYTE_EOS, ByteTokenizer.eos_id
        (out_dir / "tokenizer.json").write_text(json.dumps(tokenizer, ensure_ascii=False) + "\n")
        line = "tokenizer: mshpc's byte tokenizer as byte-level BPE without merges (tokenizer.json)"
    elif Path(spec).is_file():
        shutil.copyfile(spec, out_dir / "tokenizer.json")
        tokenizer = json.loads(Path(spec).read_text())
        eos, eos_id = _bpe_eos(tokenizer)
        line = f"tokenizer: {spec} (copied as tokenizer.json)"
        if eos is None:
            line += "; it has no end-of-text token, so mshpc's extra end-of-document id is unknown to it"
    else:
        return None, f"tokenizer: not exported ({spec} is not here); copy its tokenizer.json in by hand"
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": max_len, "eos_token": eos,
              "bos_token": None, "add_bos_token": False, "clean_up_tokenization_spaces": False}
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return eos_id, line
