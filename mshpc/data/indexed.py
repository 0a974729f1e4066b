"""Megatron's indexed datasets (the MMIDIDX format of megatron/core/datasets/indexed_dataset.py),
read directly as a training source: the `.bin`'s tokens in file order, token for token, with the
document boundaries of its `.idx`.

    .idx   b"MMIDIDX\\x00\\x00", version <Q = 1, dtype code <B, sequence count S <Q, document
           count D <Q, then int32 sequence lengths [S], int64 byte pointers [S], int64 document
           indices [D] (sequence numbers, from 0: a document is sequences [d[k], d[k + 1])),
           then (multimodal only) int8 modes [S]
    .bin   the sequences' tokens back to back, of the dtype the code names

As Megatron's GPTDataset does, nothing is added between documents: `preprocess_data.py
--append-eod` wrote each document's end-of-document token into the `.bin`. Every count and
pointer is checked against the files' sizes before anything is allocated; tokens are read with
pread (data/shards.py's ShardFile), never through a map.
"""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np

from mshpc.data.shards import ShardFile
from mshpc.errors import DataError

HEADER = b"MMIDIDX\x00\x00"
_FIXED = struct.Struct("<9sQBQQ")  # header, version, dtype code, sequence count, document count
# Megatron's DType codes that hold token ids
DTYPES: dict[int, np.dtype] = {1: np.dtype("<u1"), 3: np.dtype("<i2"), 4: np.dtype("<i4"), 5: np.dtype("<i8"), 8: np.dtype("<u2")}


def indexed_prefix(path: Path) -> Path | None:
    """The .bin/.idx prefix `path` names (the prefix itself, or either file), or None."""
    prefix = path.with_suffix("") if path.suffix in (".bin", ".idx") else path
    if prefix.with_suffix(".bin").is_file() and prefix.with_suffix(".idx").is_file():
        return prefix
    return None


def _read_index(idx: Path) -> tuple[np.dtype, np.ndarray, int]:
    """(token dtype, each document's first token, total tokens) from the .idx, checked."""
    size = idx.stat().st_size
    with open(idx, "rb") as f:
        head = f.read(_FIXED.size)
        if len(head) < _FIXED.size or head[:9] != HEADER:
            raise DataError(f"{idx}: not a Megatron MMIDIDX index (header {head[:9]!r})")
        _, version, code, n_seq, n_doc = _FIXED.unpack(head)
        if version != 1 or code not in DTYPES:
            raise DataError(f"{idx}: version {version}, dtype code {code}: not an index of token ids mshpc reads "
                            f"(version 1; codes {sorted(DTYPES)})")
        if n_doc < 2 or _FIXED.size + 12 * n_seq + 8 * n_doc > size:
            raise DataError(f"{idx}: {n_seq} sequences and {n_doc - 1} documents do not fit its {size} bytes")
        lengths = np.fromfile(f, dtype="<i4", count=n_seq).astype(np.int64)
        pointers = np.fromfile(f, dtype="<i8", count=n_seq)
        docs = np.fromfile(f, dtype="<i8", count=n_doc)
    dtype = DTYPES[code]
    bounds = np.concatenate([[0], np.cumsum(lengths)])
    if (lengths < 0).any() or not np.array_equal(pointers, bounds[:-1] * dtype.itemsize):
        raise DataError(f"{idx}: sequence lengths and pointers disagree (not back to back)")
    if docs[0] != 0 or docs[-1] != n_seq or (np.diff(docs) < 0).any():
        raise DataError(f"{idx}: document indices are not sequence numbers from 0 to {n_seq}")
    return dtype, bounds[docs], int(bounds[-1])


class IndexedTokens:
    """A Megatron .bin/.idx pair as a token stream; `part` "val" is its last `val_fraction` of the
    documents (Megatron's --split), "train" the rest. `eos_id` and `vocab_size` are the run
    tokenizer's (the pair does not record one)."""

    def __init__(self, prefix: Path, part: str, val_fraction: float, eos_id: int, vocab_size: int) -> None:
        self.path = prefix
        self.eos_id, self.vocab_size = eos_id, vocab_size
        file_dtype, starts, total = _read_index(prefix.with_suffix(".idx"))
        n_docs = len(starts) - 1
        first_val = round((1 - val_fraction) * n_docs)
        lo, hi = (0, first_val) if part == "train" else (first_val, n_docs)
        if lo >= hi or starts[lo] == starts[hi]:
            raise DataError(f"{prefix}: no documents in its {part} part (indexed_val_fraction {val_fraction:g} of "
                            f"{n_docs} documents)")
        self._base = int(starts[lo])
        self._starts = starts[lo:hi] - self._base
        self.n_tokens = int(starts[hi]) - self._base
        self.n_docs = hi - lo
        self._file = ShardFile(prefix.with_suffix(".bin"), int(total), file_dtype)
        self._signed = file_dtype.kind == "i"
        self.dtype = np.dtype("<u2") if file_dtype.itemsize <= 2 and not self._signed else np.dtype("<u4")

    def tokens(self, start: int, length: int) -> np.ndarray:
        """Tokens [start, start + length) of this part, as `dtype`."""
        assert 0 <= start and start + length <= self.n_tokens, (start, length, self.n_tokens)
        raw = np.empty(length, dtype=self._file.dtype)
        self._file.read_into(raw, self._base + start)
        if self._signed and len(raw) and raw.min() < 0:
            raise DataError(f"{self._file.path}: a negative token id near token {self._base + start}")
        return raw.astype(self.dtype, copy=False)

    def doc_starts(self) -> np.ndarray:
        """Stream positions (int64) at which this part's documents start."""
        return self._starts.copy()

    def close(self) -> None:
        pass
