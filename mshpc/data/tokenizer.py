"""Tokenizers that turn document bytes into token ids: raw bytes, or a HuggingFace BPE file."""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

import numpy as np

from mshpc.errors import DataError

# Tried in order; the first one the BPE vocabulary has becomes the end-of-document id.
EOS_TOKENS = ("<|endoftext|>", "</s>", "<eos>")


class Tokenizer(Protocol):
    """What corpus preparation needs from a tokenizer."""

    name: str
    vocab_size: int
    eos_id: int

    def encode(self, text: bytes) -> np.ndarray:
        """Token ids of `text` (an unsigned integer array), without the end-of-document id."""
        ...

    def decode(self, ids: list[int]) -> str:
        """The text of token ids (what `mshpc generate` prints); ids it has no text for are skipped."""
        ...


class ByteTokenizer:
    """Every byte is its own token (ids 0..255); 256 marks the end of a document."""

    name = "byte"
    vocab_size = 257
    eos_id = 256

    def encode(self, text: bytes) -> np.ndarray:
        """The bytes of `text` as uint16 ids."""
        return np.frombuffer(text, dtype=np.uint8).astype(np.uint16)

    def decode(self, ids: list[int]) -> str:
        """The bytes of `ids` as UTF-8 (a sequence cut inside a character shows U+FFFD)."""
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


class BPETokenizer:
    """A `tokenizers` json file (BPE or any model it holds); its name is the file's path."""

    def __init__(self, path: str) -> None:
        try:
            from tokenizers import Tokenizer as HFTokenizer  # optional: only BPE users need it
        except ImportError:
            raise DataError(f"tokenizer {path} needs the tokenizers package: "
                            "pip install tokenizers") from None
        try:
            self._tok = HFTokenizer.from_file(path)
        except Exception as exc:  # the Rust side raises a bare Exception for every parse failure
            raise DataError(f"tokenizer {path}: not a tokenizers json file ({exc})") from None
        self.name = path
        ids = [self._tok.token_to_id(t) for t in EOS_TOKENS]
        known = [i for i in ids if i is not None]
        n_vocab = self._tok.get_vocab_size(with_added_tokens=True)
        # Without an end-of-text token of its own, the vocabulary gets one extra id for it.
        self.eos_id = known[0] if known else n_vocab
        self.vocab_size = max(n_vocab, self.eos_id + 1)

    def encode(self, text: bytes) -> np.ndarray:
        """The BPE ids of `text` decoded as UTF-8, as uint32."""
        ids = self._tok.encode(text.decode("utf-8", errors="replace"), add_special_tokens=False).ids
        return np.asarray(ids, dtype=np.uint32)

    def decode(self, ids: list[int]) -> str:
        known = self._tok.get_vocab_size(with_added_tokens=True)  # the end-of-document id may lie past it
        return str(self._tok.decode([i for i in ids if i < known]))


def build_tokenizer(spec: str) -> Tokenizer:
    """The tokenizer named by `spec`: "byte", or the path of an existing `tokenizers` .json file."""
    if spec == "byte":
        return ByteTokenizer()
    if spec.endswith(".json") and Path(spec).is_file():
        return BPETokenizer(spec)
    raise DataError(
        f"tokenizer {spec!r} is unknown (choose 'byte' or the path of an existing tokenizers .json file)"
    )
