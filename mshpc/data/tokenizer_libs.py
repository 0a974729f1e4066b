"""The tokenizer libraries mshpc wraps, each imported only by the users of its kind: Hugging Face
`tokenizers` (the Rust engine `AutoTokenizer` runs), SentencePiece and tiktoken."""

from __future__ import annotations

import base64
import binascii
import functools
import json
from pathlib import Path
from typing import Any

import numpy as np

from mshpc.data import fast_bpe
from mshpc.data.tokenizer import EOS_TOKENS
from mshpc.errors import DataError

MAX_FILE_BYTES = 1 << 30  # a tokenizer file larger than this is not one (Llama 3's tokenizer.json: 9 MB)
# The split pattern of cl100k_base (tiktoken_ext/openai_public.py), which Llama 3 also uses: the
# pattern of a bare ranks file, which does not record its own.
CL100K_PATTERN = (r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}++|\p{N}{1,3}+| ?[^\s\p{L}\p{N}]++[\r\n]*+"""
                  r"""|\s++$|\s*[\r\n]|\s+(?!\S)|\s""")
TIKTOKEN_EOS = "<|endoftext|>"


def _checked(path: Path) -> Path:
    size = path.stat().st_size
    if size > MAX_FILE_BYTES:
        raise DataError(f"tokenizer file {path}: {size} bytes, more than any tokenizer's {MAX_FILE_BYTES}")
    return path


def _missing(package: str, path: Path) -> DataError:
    return DataError(f"tokenizer {path} needs the {package} package: pip install {package}")


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


class HFTokenizer:
    """A `tokenizers` tokenizer.json (BPE, WordPiece, Unigram...), with the end-of-document token of
    its tokenizer_config.json when there is one; encodes with its post-processor (its BOS rules)."""

    kind = "hf"

    def __init__(self, path: Path, config: Path, name: str) -> None:
        try:
            from tokenizers import Tokenizer as RustTokenizer
        except ImportError:
            raise _missing("tokenizers", path) from None
        try:
            self._tok = RustTokenizer.from_file(str(_checked(path)))
        except Exception as exc:  # the Rust side raises a bare Exception for every parse failure
            raise DataError(f"tokenizer {path}: not a tokenizers json file ({exc})") from None
        self.name, self._path = name, path
        self._config = config if config.is_file() else None
        settings = self._read_config()
        wanted = [_token_text(settings.get("eos_token")), *EOS_TOKENS]
        ids = [self._tok.token_to_id(t) for t in wanted if t is not None]
        known = [i for i in ids if i is not None]
        self._n_known = self._tok.get_vocab_size(with_added_tokens=True)
        # Without an end-of-text token of its own, the vocabulary gets one extra id for it.
        self.eos_id = known[0] if known else self._n_known
        self.vocab_size = max(self._n_known, self.eos_id + 1)

    def _read_config(self) -> dict[str, Any]:
        if self._config is None:
            return {}
        try:
            settings = json.loads(_checked(self._config).read_text())
        except (ValueError, OSError) as exc:
            raise DataError(f"tokenizer config {self._config}: unreadable ({exc})") from None
        return settings if isinstance(settings, dict) else {}

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self._tok.encode(text).ids, dtype=np.uint32)

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        return fast_bpe.encode_batch(self._fast, self._tok, texts)

    @functools.cached_property
    def _fast(self) -> fast_bpe.FastBPE | None:
        """A byte-level BPE's faster engine where it gives these same ids (fast_bpe.py); built on the
        first batch, as only `prepare` encodes batches."""
        return fast_bpe.build(self._tok)

    def decode(self, ids: list[int]) -> str:
        return str(self._tok.decode([i for i in ids if i < self._n_known]))

    def files(self) -> dict[str, Path]:
        found = {"tokenizer.json": self._path}
        if self._config is not None:
            found["tokenizer_config.json"] = self._config
        return found


class SentencePieceTokenizer:
    """A SentencePiece `.model`, encoding as `SentencePieceProcessor.encode` does (no BOS, no EOS)."""

    kind = "sentencepiece"

    def __init__(self, path: Path, name: str) -> None:
        try:
            import sentencepiece
        except ImportError:
            raise _missing("sentencepiece", path) from None
        self._sp = sentencepiece.SentencePieceProcessor()
        try:
            self._sp.Load(str(_checked(path)))
        except (OSError, RuntimeError) as exc:
            raise DataError(f"tokenizer {path}: not a SentencePiece model ({exc})") from None
        self.name, self._path = name, path
        self._n_known = self._sp.get_piece_size()
        eos = self._sp.eos_id()
        self.eos_id = eos if eos >= 0 else self._n_known
        self.vocab_size = max(self._n_known, self.eos_id + 1)

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self._sp.encode(text), dtype=np.uint32)

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        return [np.asarray(ids, dtype=np.uint32) for ids in self._sp.encode(texts, num_threads=1)]

    def decode(self, ids: list[int]) -> str:
        return str(self._sp.decode([i for i in ids if i < self._n_known]))

    def files(self) -> dict[str, Path]:
        return {"tokenizer.model": self._path}


def read_ranks(path: Path) -> dict[bytes, int]:
    """A tiktoken ranks file (a line of base64 token bytes and its rank per token), read here
    rather than by tiktoken.load, which keeps a cache keyed by the path."""
    ranks: dict[bytes, int] = {}
    with open(_checked(path), "rb") as f:
        for number, line in enumerate(f, 1):
            parts = line.split()
            if not parts:
                continue
            try:
                token, rank = base64.b64decode(parts[0], validate=True), int(parts[1])
            except (IndexError, ValueError, binascii.Error):
                raise DataError(f"tokenizer {path}:{number}: not a tiktoken ranks line "
                                "(base64 token, space, rank)") from None
            ranks[token] = rank
    if not ranks:
        raise DataError(f"tokenizer {path}: an empty tiktoken ranks file")
    return ranks


class TiktokenTokenizer:
    """A local tiktoken ranks file with cl100k_base's split pattern and `<|endoftext|>` as the
    next id; text is encoded as `Encoding.encode_ordinary` does (special-token text stays text)."""

    kind = "tiktoken"

    def __init__(self, path: Path, name: str) -> None:
        try:
            import tiktoken
        except ImportError:
            raise _missing("tiktoken", path) from None
        ranks = read_ranks(path)
        self.eos_id = max(ranks.values()) + 1
        self.vocab_size = self.eos_id + 1
        try:
            self._enc = tiktoken.Encoding(path.stem, pat_str=CL100K_PATTERN, mergeable_ranks=ranks,
                                          special_tokens={TIKTOKEN_EOS: self.eos_id})
        except ValueError as exc:
            raise DataError(f"tokenizer {path}: tiktoken refuses it ({exc})") from None
        self.name, self._path = name, path

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self._enc.encode_ordinary(text), dtype=np.uint32)

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        return [np.asarray(ids, dtype=np.uint32) for ids in self._enc.encode_ordinary_batch(texts, num_threads=1)]

    def decode(self, ids: list[int]) -> str:
        return self._enc.decode([i for i in ids if i < self.eos_id], errors="replace")

    def files(self) -> dict[str, Path]:
        return {"ranks.tiktoken": self._path}
