"""Corpus preparation: text files and folders -> a token dataset folder, published atomically.

Folders are walked recursively in sorted order (so a corpus always prepares to the same bytes),
skipping hidden folders, `__pycache__`, `site-packages` and `node_modules`, and taking files whose
suffix is in TEXT_SUFFIXES. A file is a document when it is non-empty UTF-8 without NUL bytes;
other files found in folders are skipped, while a named input file that is not text is an error.

A held-out validation split goes into `val/` inside the dataset folder, a dataset of the same
format. It is split by document, never by window (a window must not see the first half of a
document whose second half is scored): `--val-fraction F` holds out each document whose sha256
falls in the first F of the hash range (so identical documents land on the same side, and adding
files never moves the others), and `--val INPUT...` holds out given files; a training document
identical to one of those is left out of training.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import shutil
import sysconfig
import uuid
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from mshpc.config import DataConfig
from mshpc.data.shards import INDEX_FILE, ShardWriter, TokenDataset
from mshpc.data.tokenizer import ByteTokenizer, Tokenizer, build_tokenizer
from mshpc.errors import DataError

log = logging.getLogger(__name__)

TEXT_SUFFIXES = frozenset({
    ".txt", ".md", ".rst", ".tex", ".json", ".jsonl", ".yaml", ".yml", ".toml", ".cfg", ".ini",
    ".csv", ".xml", ".html", ".css", ".py", ".pyi", ".c", ".h", ".cc", ".cpp", ".hpp", ".cu",
    ".rs", ".go", ".java", ".js", ".ts", ".sh",
})
SKIP_DIRS = frozenset({"__pycache__", "site-packages", "node_modules"})
DEFAULT_SHARD_TOKENS = 16_000_000
VAL_DIR = "val"  # the held-out split, a dataset folder inside the training one
# The embedded corpus's held-out share: about 17 of the stdlib's ~1,760 files, ~300k tokens,
# thousands of validation windows at any seq_len mshpc's configs use.
DEFAULT_VAL_FRACTION = 0.01


def _walk(folder: Path, suffixes: frozenset[str]) -> Iterator[Path]:
    """Files under `folder` with one of `suffixes`, depth first in sorted order."""
    for root, dirs, files in os.walk(folder):
        dirs[:] = sorted(d for d in dirs if not d.startswith(".") and d not in SKIP_DIRS)
        for name in sorted(files):
            if Path(name).suffix.lower() in suffixes:
                yield Path(root) / name


def _is_text(data: bytes) -> bool:
    if b"\x00" in data:
        return False
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def _candidates(inputs: Sequence[Path]) -> list[tuple[Path, bool]]:
    """(file, named explicitly) for every input, after checking that all inputs exist."""
    for path in map(Path, inputs):
        if not path.exists():
            raise DataError(f"input {path} does not exist (give text files or folders)")
    found: list[tuple[Path, bool]] = []
    for path in map(Path, inputs):
        if path.is_dir():
            found += [(f, False) for f in _walk(path, TEXT_SUFFIXES)]
        else:
            found.append((path, True))
    return found


def _documents(candidates: Iterable[tuple[Path, bool]]) -> Iterator[bytes]:
    """The bytes of each candidate that is text; folder members that are not are skipped."""
    skipped = 0
    for path, explicit in candidates:
        try:
            data = path.read_bytes()
        except OSError as exc:
            if explicit:
                raise DataError(f"input {path}: unreadable ({exc.strerror})") from None
            skipped += 1
            continue
        if _is_text(data):
            if data:
                yield data
        elif explicit:
            raise DataError(f"input {path}: not UTF-8 text (binary or another encoding)")
        else:
            skipped += 1
    if skipped:
        log.info("skipped %d unreadable or non-UTF-8 files", skipped)


def _publish(tmp: Path, out_dir: Path) -> Path:
    """Rename the finished `tmp` to `out_dir`; if a racer published `out_dir` first, keep theirs."""
    try:
        os.rename(tmp, out_dir)
    except OSError:
        if not (out_dir / INDEX_FILE).is_file():
            raise
        log.info("%s was prepared meanwhile by another process; keeping it", out_dir)
    return out_dir


def val_path(dataset: Path) -> Path:
    """The held-out split of the dataset folder `dataset` (it may not have one)."""
    return Path(dataset) / VAL_DIR


def _hash_share(digest: bytes) -> float:
    """A document's place in [0, 1), from its sha256: uniform, and the same on every machine."""
    return int.from_bytes(digest[:8], "big") / 2**64


@dataclass
class ValSplit:
    """Which documents are held out: a `fraction` of them by hash, plus `docs` (the --val files)."""

    fraction: float = 0.0
    docs: list[bytes] = field(default_factory=list)

    @property
    def wanted(self) -> bool:
        return self.fraction > 0 or bool(self.docs)


def _write_split(docs: Iterable[bytes], train: ShardWriter, val: ShardWriter | None,
                 split: ValSplit, tokenizer: Tokenizer) -> int:
    """Tokenize the held-out documents into `val` and `docs` into `train` or `val`; returns how
    many training documents were dropped as copies of a held-out one."""
    held = set()
    for doc in split.docs:
        held.add(hashlib.sha256(doc).digest())
        assert val is not None
        val.add(tokenizer.encode(doc))
    dropped = 0
    for doc in docs:
        digest = hashlib.sha256(doc).digest() if val is not None else b""
        if digest in held:
            dropped += 1
        elif val is not None and _hash_share(digest) < split.fraction:
            held.add(digest)  # a later copy of it must not land in training
            val.add(tokenizer.encode(doc))
        else:
            train.add(tokenizer.encode(doc))
    return dropped


def _build(docs: Iterable[bytes], out_dir: Path, tokenizer: Tokenizer, shard_tokens: int,
           source: str, split: ValSplit | None = None) -> Path:
    """Tokenize `docs` (and the held-out split) into a sibling temp folder, then publish it as
    `out_dir`."""
    split = split or ValSplit()
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    # A unique sibling: same filesystem (so rename is atomic), and racers never share it.
    tmp = out_dir.parent / f".{out_dir.name}.tmp-{uuid.uuid4().hex[:12]}"
    tmp.mkdir()
    try:
        writer = ShardWriter(tmp, tokenizer, shard_tokens)
        val = None
        if split.wanted:
            (tmp / VAL_DIR).mkdir()
            val = ShardWriter(tmp / VAL_DIR, tokenizer, shard_tokens)
        dropped = _write_split(docs, writer, val, split, tokenizer)
        if writer.n_tokens == 0 and val is not None and val.n_tokens:
            raise DataError(f"every document of {source} was held out for validation (lower "
                            "--val-fraction, or give --val files that are not all the inputs)")
        if writer.n_tokens == 0:
            raise DataError(f"no text documents in {source} (folders are searched for UTF-8 "
                            f"files named {', '.join(sorted(TEXT_SUFFIXES))})")
        if val is not None:
            if val.n_tokens == 0:
                raise DataError(f"no document of {source} fell in the validation split (--val-fraction "
                                f"{split.fraction:g} of {writer.n_docs} documents; raise it, or give --val files)")
            val.finish()
            log.info("held out %s: %d docs, %d tokens (%d training copies of them left out)",
                     val_path(out_dir), val.n_docs, val.n_tokens, dropped)
        writer.finish()
        log.info("prepared %s: %d docs, %d tokens", out_dir, writer.n_docs, writer.n_tokens)
        return _publish(tmp, out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def prepare_corpus(inputs: Sequence[Path], out_dir: Path, tokenizer_spec: str = "byte",
                   shard_tokens: int = DEFAULT_SHARD_TOKENS, val_fraction: float = 0.0,
                   val_inputs: Sequence[Path] = ()) -> Path:
    """Tokenize the text files and folders `inputs` into a new dataset folder `out_dir`, holding
    out `val_fraction` of the documents and the files and folders `val_inputs` into its `val/`."""
    out_dir = Path(out_dir)
    if out_dir.exists():
        raise DataError(f"output {out_dir} already exists (remove it or choose another folder)")
    if shard_tokens < 1:
        raise DataError(f"shard_tokens={shard_tokens} must be >= 1")
    if not 0 <= val_fraction < 1:
        raise DataError(f"--val-fraction {val_fraction:g} must be in [0, 1) (e.g. 0.01)")
    tokenizer = build_tokenizer(tokenizer_spec)
    candidates = _candidates(inputs)
    held = list(_documents(_candidates(val_inputs))) if val_inputs else []
    if val_inputs and not held:
        raise DataError(f"no text documents in --val {', '.join(map(str, val_inputs))}")
    source = ", ".join(str(p) for p in inputs) or "(no inputs)"
    return _build(_documents(candidates), out_dir, tokenizer, shard_tokens, source,
                  ValSplit(val_fraction, held))


def _discard(path: Path) -> None:
    """Remove a broken dataset folder; renamed away first so no reader sees it half deleted."""
    trash = path.parent / f".{path.name}.trash-{uuid.uuid4().hex[:12]}"
    try:
        os.rename(path, trash)
    except FileNotFoundError:
        return  # another process discarded it first
    shutil.rmtree(trash, ignore_errors=True)


def ensure_default_corpus(cache_dir: Path) -> Path:
    """The byte-tokenized Python stdlib source (*.py) under `cache_dir` with its held-out split,
    prepared on first use."""
    target = Path(cache_dir) / f"stdlib-byte-{platform.python_version()}"
    if target.exists():
        try:
            TokenDataset.open(target, verify=False).close()
            if not val_path(target).is_dir():  # prepared before the split existed: once more
                raise DataError("no validation split")
            TokenDataset.open(val_path(target), verify=False).close()
            return target
        except DataError as exc:
            log.warning("%s is unusable (%s); preparing it again", target, exc)
            _discard(target)
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = ((f, False) for f in _walk(stdlib, frozenset({".py"})))
    return _build(_documents(files), target, ByteTokenizer(), DEFAULT_SHARD_TOKENS, str(stdlib),
                  ValSplit(DEFAULT_VAL_FRACTION))


def dataset_path(cfg: DataConfig) -> Path:
    """The dataset folder `cfg` names: `cfg.path`, or else the embedded corpus in `cfg.cache_dir`."""
    if cfg.path is None:
        if cfg.tokenizer != "byte":
            raise DataError(f"data.tokenizer={cfg.tokenizer!r} needs data.path: the embedded corpus is "
                            "byte-tokenized (make a dataset with mshpc prepare)")
        return ensure_default_corpus(Path(cfg.cache_dir))
    path = Path(cfg.path)
    if not path.is_dir():
        raise DataError(f"data.path={cfg.path} does not exist (make it with mshpc prepare, or leave "
                        "data.path unset for the embedded stdlib corpus)")
    return path


def val_dataset_path(cfg: DataConfig) -> Path:
    """The held-out split of the dataset `cfg` names; a DataError says how to make one."""
    path = val_path(dataset_path(cfg))
    if not (path / INDEX_FILE).is_file():
        raise DataError(f"eval.interval_steps > 0 needs a validation split, and {path} has none "
                        f"(re-run mshpc prepare with --val-fraction F or --val FILES, or set "
                        f"eval.interval_steps=0)")
    return path
