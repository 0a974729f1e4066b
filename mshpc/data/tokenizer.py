"""Tokenizers that turn document text into token ids: raw bytes (the default), or the tokenizers
people use, each through its own library (data/tokenizer_libs.py): a Hugging Face tokenizer (a
`tokenizer.json`, or a model folder with its `tokenizer_config.json`), SentencePiece (`.model`)
and tiktoken (a local `.tiktoken` ranks file; nothing is downloaded).

`encode` gives the library's own ids for a text, with its own rules for special tokens (a Llama 3
folder's begin-of-text, for instance), so they equal what `AutoTokenizer`, `SentencePieceProcessor`
or `tiktoken.Encoding` give; a document is those ids followed by the end-of-document id
(`document_ids`), as Megatron's `preprocess_data.py --append-eod` writes them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

import numpy as np

from mshpc.errors import DataError

# Tried in order; the first one a vocabulary has becomes the end-of-document id.
EOS_TOKENS = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>")
CHOICES = ("'byte', a tokenizer.json, a Hugging Face model folder, a SentencePiece .model, "
           "a .tiktoken ranks file, or a tokenizer/ folder that mshpc wrote")


class Tokenizer(Protocol):
    """What preparation, training, generation and export need from a tokenizer."""

    kind: str  # "byte", "hf", "sentencepiece" or "tiktoken"
    name: str  # what it was built from (a path, or "byte")
    vocab_size: int  # ids are below this (the end-of-document id included)
    eos_id: int

    def encode(self, text: str) -> np.ndarray:
        """Token ids of `text` (unsigned integers) by the library's own rules, without the
        end-of-document id that `document_ids` adds."""
        ...

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        """`encode` of each text, in one call into the library."""
        ...

    def decode(self, ids: list[int]) -> str:
        """The text of token ids (what `mshpc generate` prints); ids it has no text for are skipped."""
        ...

    def files(self) -> dict[str, Path]:
        """The files that define it, by the name they take in a tokenizer/ folder (tokenizer_dir.py)."""
        ...


class ByteTokenizer:
    """Every byte of the UTF-8 text is its own token (ids 0..255); 256 marks the end of a document."""

    kind = "byte"
    name = "byte"
    vocab_size = 257
    eos_id = 256

    def encode(self, text: str) -> np.ndarray:
        """The UTF-8 bytes of `text` as uint16 ids."""
        return np.frombuffer(text.encode("utf-8", errors="surrogatepass"), dtype=np.uint8).astype(np.uint16)

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        return [self.encode(t) for t in texts]

    def decode(self, ids: list[int]) -> str:
        """The bytes of `ids` as UTF-8 (a sequence cut inside a character shows U+FFFD)."""
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")

    def files(self) -> dict[str, Path]:
        return {}


def document_ids(tokenizer: Tokenizer, text: str) -> np.ndarray:
    """One document as the dataset stores it: its ids, then the end-of-document id (not twice
    where the tokenizer's own rules already end it with that id)."""
    ids = tokenizer.encode(text)
    if len(ids) and int(ids[-1]) == tokenizer.eos_id:
        return ids
    return np.append(ids, np.asarray(tokenizer.eos_id, dtype=ids.dtype if ids.dtype.itemsize >= 4 else np.uint32))


def _is_tiktoken_ranks(path: Path) -> bool:
    """Whether `path` reads as a tiktoken ranks file (lines of base64 and a rank), not a
    SentencePiece protobuf: Llama 3's `original/tokenizer.model` is one."""
    with open(path, "rb") as f:
        head = f.readline(4096).split()
    return len(head) == 2 and head[1].isdigit() and all(c in b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"
                                                        b"0123456789+/=" for c in head[0])


def build_tokenizer(spec: str) -> Tokenizer:
    """The tokenizer named by `spec` (see CHOICES); a DataError naming the choices otherwise."""
    from mshpc.data import tokenizer_libs as libs
    from mshpc.data.tokenizer_dir import MANIFEST, load_tokenizer_dir

    if spec == "byte":
        return ByteTokenizer()
    path = Path(spec)
    if path.is_dir():
        if (path / MANIFEST).is_file():
            return load_tokenizer_dir(path)
        if (path / "tokenizer.json").is_file():
            return libs.HFTokenizer(path / "tokenizer.json", path / "tokenizer_config.json", spec)
        if (path / "tokenizer.model").is_file():
            return build_tokenizer(str(path / "tokenizer.model"))
    elif path.is_file():
        if path.suffix == ".json":
            return libs.HFTokenizer(path, path.with_name("tokenizer_config.json"), spec)
        if path.suffix == ".tiktoken" or (path.suffix == ".model" and _is_tiktoken_ranks(path)):
            return libs.TiktokenTokenizer(path, spec)
        if path.suffix == ".model":
            return libs.SentencePieceTokenizer(path, spec)
    raise DataError(f"tokenizer {spec!r} is unknown or missing (choose {CHOICES})")
