"""The token dataset format: memory-mappable shards of one token stream, described by index.json.

A dataset is a folder:

    index.json            {"format": "mshpc-tokens", "version": 1, "tokenizer": "byte",
                           "vocab_size": 257, "eos_id": 256, "dtype": "uint16",
                           "n_tokens": T, "n_docs": D,
                           "shards": [{"file": "shard-00000.bin", "docs_file": "shard-00000.docs.npy",
                                       "n_tokens": t, "n_docs": d,
                                       "sha256": "<hex of .bin>", "docs_sha256": "<hex of .docs.npy>"}]}
    shard-NNNNN.bin       the shard's tokens: raw little-endian `dtype`, no header (memory-mappable)
    shard-NNNNN.docs.npy  int64 offsets, relative to the shard, of the documents that start in it
                          (np.load(allow_pickle=False))

The shards in order form one stream in which every document is followed by `eos_id`. Every shard
but the last holds exactly the shard size chosen at prepare time, so a document may continue into
the next shard. `dtype` is "uint16" when vocab_size <= 65535, else "uint32". Nothing is pickled.

Training reads windows with pread, not through a memory map: a shard truncated under a running
job then gives a short read and a DataError naming it (a user error, exit 2), where a read
through a map past the file's new end kills the rank with SIGBUS, which looks like a node fault.
"""

from __future__ import annotations

import hashlib
import json
import os
import weakref
from pathlib import Path
from typing import Any

import numpy as np

from mshpc.data.tokenizer import Tokenizer
from mshpc.errors import DataError

FORMAT = "mshpc-tokens"
VERSION = 1
INDEX_FILE = "index.json"
_REPREPARE = "re-run mshpc prepare"

_INDEX_KEYS = {"format": str, "version": int, "tokenizer": str, "vocab_size": int, "eos_id": int,
               "dtype": str, "n_tokens": int, "n_docs": int, "shards": list}
_SHARD_KEYS = {"file": str, "docs_file": str, "n_tokens": int, "n_docs": int, "sha256": str,
               "docs_sha256": str}


def token_dtype(vocab_size: int) -> np.dtype:
    """The little-endian dtype that stores ids below `vocab_size`."""
    return np.dtype("<u2") if vocab_size <= 65535 else np.dtype("<u4")


def _fsync_write(path: Path, data: bytes | memoryview) -> None:
    # fsync before the folder is published, so a crash cannot leave a renamed folder of holes.
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _sha256_file(path: Path) -> str:
    digest = hashlib.sha256()  # by blocks: hashlib.file_digest is Python 3.11+, we support 3.10
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def write_shard(out_dir: Path, number: int, tokens: np.ndarray,
                doc_starts: np.ndarray) -> dict[str, Any]:
    """Write shard `number` (final-dtype tokens, shard-relative doc starts); return its index entry."""
    assert tokens.dtype.byteorder in "<|=" and len(tokens) > 0, (tokens.dtype, len(tokens))
    stem = f"shard-{number:05d}"
    data = np.ascontiguousarray(tokens).data.cast("B")
    _fsync_write(out_dir / f"{stem}.bin", data)
    docs_path = out_dir / f"{stem}.docs.npy"
    with open(docs_path, "wb") as f:
        np.save(f, np.asarray(doc_starts, dtype="<i8"), allow_pickle=False)
        f.flush()
        os.fsync(f.fileno())
    return {"file": f"{stem}.bin", "docs_file": docs_path.name, "n_tokens": int(len(tokens)),
            "n_docs": int(len(doc_starts)), "sha256": hashlib.sha256(data).hexdigest(),
            "docs_sha256": _sha256_file(docs_path)}


class ShardWriter:
    """Cuts a stream of documents (each ending in eos) into shards of `shard_tokens` and indexes them.

    It holds one shard's tokens in a buffer allocated once, and each shard's document starts until
    the shard is written: its memory is that of a shard, whatever the corpus size."""

    def __init__(self, out_dir: Path, tokenizer: Tokenizer, shard_tokens: int,
                 tokenizer_dir: str | None = None) -> None:
        assert shard_tokens >= 1, shard_tokens
        self.out_dir = out_dir
        self.tokenizer = tokenizer
        self.tokenizer_dir = tokenizer_dir
        self.shard_tokens = shard_tokens
        self.dtype = token_dtype(tokenizer.vocab_size)
        self.n_tokens = 0
        self.n_docs = 0
        # untouched pages of np.empty take no memory, so a small dataset pays only for its tokens
        self._buffer = np.empty(shard_tokens, dtype=self.dtype)
        self._filled = 0
        self._doc_starts: list[np.ndarray] = []  # of the buffered shard, relative to it
        self._shards: list[dict[str, Any]] = []

    def add(self, ids: np.ndarray, lengths: np.ndarray) -> None:
        """Append documents: `ids` back to back (each ending in eos), `lengths` of each."""
        if not len(lengths):
            return
        assert int(lengths.sum()) == len(ids), (int(lengths.sum()), len(ids))
        starts = np.cumsum(lengths) - lengths  # of each document in `ids`
        self.n_tokens += len(ids)
        self.n_docs += len(lengths)
        done = 0
        while done < len(ids):
            take = min(len(ids) - done, self.shard_tokens - self._filled)
            self._buffer[self._filled:self._filled + take] = ids[done:done + take]
            lo, hi = np.searchsorted(starts, [done, done + take])
            self._doc_starts.append(starts[lo:hi] - done + self._filled)
            self._filled += take
            done += take
            if self._filled == self.shard_tokens:
                self._write_shard()

    def _write_shard(self) -> None:
        starts = np.concatenate(self._doc_starts) if self._doc_starts else np.empty(0, np.int64)
        self._shards.append(write_shard(self.out_dir, len(self._shards), self._buffer[:self._filled], starts))
        self._filled = 0
        self._doc_starts = []

    def finish(self) -> None:
        """Write the last partial shard and index.json."""
        assert self.n_tokens > 0, "an empty dataset is rejected before it is written"
        if self._filled:
            self._write_shard()
        index = {"format": FORMAT, "version": VERSION, "tokenizer": self.tokenizer.name,
                 "vocab_size": self.tokenizer.vocab_size, "eos_id": self.tokenizer.eos_id,
                 "dtype": "uint16" if self.dtype.itemsize == 2 else "uint32",
                 "n_tokens": self.n_tokens, "n_docs": self.n_docs, "shards": self._shards}
        if self.tokenizer_dir is not None:
            index["tokenizer_dir"] = self.tokenizer_dir
        _fsync_write(self.out_dir / INDEX_FILE, json.dumps(index, indent=1).encode())


def _require(obj: Any, keys: dict[str, type], where: str) -> None:
    if not isinstance(obj, dict):
        raise DataError(f"{where}: expected a JSON object; {_REPREPARE}")
    for key, kind in keys.items():
        value = obj.get(key)
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            raise DataError(f"{where}: key {key!r} is missing or not a {kind.__name__}; {_REPREPARE}")


def read_index(path: Path) -> dict[str, Any]:
    """The checked index.json of the dataset folder `path`."""
    index_path = Path(path) / INDEX_FILE
    if not index_path.is_file():
        what = "is not a folder" if not Path(path).is_dir() else f"has no {INDEX_FILE}"
        raise DataError(f"dataset {path} {what}; make one with mshpc prepare")
    try:
        index = json.loads(index_path.read_text())
    except (ValueError, OSError) as exc:
        raise DataError(f"{index_path}: unreadable ({exc}); {_REPREPARE}") from None
    _require(index, _INDEX_KEYS, str(index_path))
    if (index["format"], index["version"]) != (FORMAT, VERSION):
        raise DataError(f"{index_path}: format {index['format']} v{index['version']} is not "
                        f"{FORMAT} v{VERSION}; {_REPREPARE}")
    if index["dtype"] not in ("uint16", "uint32"):
        raise DataError(f"{index_path}: dtype {index['dtype']!r} is not uint16 or uint32; {_REPREPARE}")
    for i, entry in enumerate(index["shards"]):
        _require(entry, _SHARD_KEYS, f"{index_path} shard {i}")
        if entry["n_tokens"] < 1 or any(Path(entry[k]).name != entry[k] for k in ("file", "docs_file")):
            raise DataError(f"{index_path} shard {i}: bad n_tokens or file name; {_REPREPARE}")
    if index.get("tokenizer_dir", "tokenizer") != "tokenizer":
        raise DataError(f"{index_path}: tokenizer_dir must be 'tokenizer'; {_REPREPARE}")
    totals = [sum(e[k] for e in index["shards"]) for k in ("n_tokens", "n_docs")]
    if totals != [index["n_tokens"], index["n_docs"]] or index["n_tokens"] < 1:
        raise DataError(f"{index_path}: shard totals {totals} disagree with n_tokens/n_docs; {_REPREPARE}")
    return index


def _check_sha(path: Path, expected: str) -> None:
    actual = _sha256_file(path)
    if actual != expected:
        raise DataError(f"{path}: checksum mismatch (index says {expected[:12]}.., file has "
                        f"{actual[:12]}..); {_REPREPARE}")


def _wrong_size(path: Path, size: int, n_tokens: int, dtype: np.dtype) -> DataError:
    return DataError(f"{path}: {size} bytes, index says {n_tokens} tokens = {n_tokens * dtype.itemsize} "
                     f"bytes (truncated or overwritten); {_REPREPARE}")


class ShardFile:
    """One shard's tokens, read with pread (see the module doc). The descriptor closes when the
    last holder lets go, so a read in flight outlives a concurrent `TokenDataset.close()`."""

    def __init__(self, path: Path, n_tokens: int, dtype: np.dtype) -> None:
        self.path, self.n_tokens, self.dtype = path, n_tokens, dtype
        self._fd = os.open(path, os.O_RDONLY)
        weakref.finalize(self, os.close, self._fd)
        self._check_size()

    def __len__(self) -> int:
        return self.n_tokens

    def _check_size(self) -> None:
        size = os.fstat(self._fd).st_size
        if size != self.n_tokens * self.dtype.itemsize:
            raise _wrong_size(self.path, size, self.n_tokens, self.dtype)

    def read_into(self, out: np.ndarray, start: int) -> None:
        """Tokens [start, start + len(out)) into `out`. The size is checked first (one fstat), so a
        shard cut short under the job fails on its next read, whatever part that read wants."""
        self._check_size()
        view, offset = out.view(np.uint8).data, start * self.dtype.itemsize
        while view:
            got = os.preadv(self._fd, [view], offset)
            if got == 0:  # cut short between the check and this read
                raise _wrong_size(self.path, os.fstat(self._fd).st_size, self.n_tokens, self.dtype)
            view, offset = view[got:], offset + got


def _open_shard(folder: Path, entry: dict[str, Any], dtype: np.dtype, verify: bool) -> ShardFile:
    path = folder / entry["file"]
    if not path.is_file():
        raise DataError(f"{path}: missing; {_REPREPARE}")
    shard = ShardFile(path, entry["n_tokens"], dtype)
    if verify:
        _check_sha(path, entry["sha256"])
    return shard


def _load_docs(folder: Path, entry: dict[str, Any], verify: bool) -> np.ndarray:
    path = folder / entry["docs_file"]
    if not path.is_file():
        raise DataError(f"{path}: missing; {_REPREPARE}")
    if verify:
        _check_sha(path, entry["docs_sha256"])
    try:
        docs = np.load(path, allow_pickle=False)
    except (ValueError, OSError) as exc:
        raise DataError(f"{path}: unreadable ({exc}); {_REPREPARE}") from None
    ok = docs.dtype == np.int64 and docs.shape == (entry["n_docs"],)
    if not ok or (len(docs) and (docs[0] < 0 or docs[-1] >= entry["n_tokens"] or np.any(np.diff(docs) <= 0))):
        raise DataError(f"{path}: document offsets do not match the index; {_REPREPARE}")
    return docs


class TokenDataset:
    """A prepared dataset whose shards are read as one concatenated token stream."""

    def __init__(self, path: Path, index: dict[str, Any], shards: list[ShardFile],
                 docs: list[np.ndarray]) -> None:
        self.path = path
        self.tokenizer: str = index["tokenizer"]
        # the tokenizer's own files (data/tokenizer_dir.py); None in datasets made before them
        self.tokenizer_dir: Path | None = path / index["tokenizer_dir"] if "tokenizer_dir" in index else None
        self.vocab_size: int = index["vocab_size"]
        self.eos_id: int = index["eos_id"]
        self.n_tokens: int = index["n_tokens"]
        self.n_docs: int = index["n_docs"]
        self.dtype = token_dtype(self.vocab_size)
        self._shards = shards
        self._docs = docs
        # Shard k holds stream positions [_offsets[k], _offsets[k + 1]).
        self._offsets = np.cumsum([0] + [len(s) for s in shards])

    @classmethod
    def open(cls, path: Path, verify: bool = True) -> TokenDataset:
        """Open the dataset folder `path`, checking its index, file sizes and (if `verify`) sha256 sums."""
        path = Path(path)
        index = read_index(path)
        dtype = np.dtype("<u2") if index["dtype"] == "uint16" else np.dtype("<u4")
        if dtype != token_dtype(index["vocab_size"]):
            raise DataError(f"{path / INDEX_FILE}: dtype {index['dtype']} does not fit vocab_size "
                            f"{index['vocab_size']}; {_REPREPARE}")
        shards = [_open_shard(path, e, dtype, verify) for e in index["shards"]]
        docs = [_load_docs(path, e, verify) for e in index["shards"]]
        return cls(path, index, shards, docs)

    def tokens(self, start: int, length: int) -> np.ndarray:
        """A copy of stream positions [start, start + length), read across shard boundaries."""
        end = start + length
        assert 0 <= start <= end <= self.n_tokens, (start, length, self.n_tokens)
        shards = self._shards  # one read: a concurrent close() must not empty the list mid-loop
        if not shards:
            raise DataError(f"dataset {self.path} is closed")
        out = np.empty(length, dtype=self.dtype)
        k = int(np.searchsorted(self._offsets, start, side="right")) - 1
        pos = start
        while pos < end:
            base = int(self._offsets[k])
            hi = min(end, int(self._offsets[k + 1]))
            shards[k].read_into(out[pos - start:hi - start], pos - base)
            pos, k = hi, k + 1
        return out

    def doc_starts(self) -> np.ndarray:
        """Stream positions (int64) at which the documents start."""
        return np.concatenate([d + off for d, off in zip(self._docs, self._offsets[:-1], strict=True)])

    def close(self) -> None:
        """Let go of the shards (a read in flight finishes); later reads raise DataError."""
        self._shards = []
