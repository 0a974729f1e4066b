"""Corpus preparation: records and text files -> a token dataset folder, published atomically.

The inputs (data/records.py) are read in bounded pieces, tokenized by worker processes
(data/tokenize_pool.py; `--workers`, default the cores) and written in input order, so a corpus
always prepares to the same bytes, whatever the worker count. The dataset keeps its tokenizer's
files in `tokenizer/` (data/tokenizer_dir.py): training adopts it, generation and export use it.

A held-out validation split goes into `val/` inside the dataset folder, a dataset of the same
format. It is split by document, never by window (a window must not see the first half of a
document whose second half is scored): `--val-fraction F` holds out each document whose sha256
falls in the first F of the hash range (so identical documents land on the same side, and adding
files never moves the others), and `--val INPUT...` holds out given inputs; a training document
identical to one of those is left out of training.
"""

from __future__ import annotations

import logging
import os
import platform
import shutil
import sysconfig
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from mshpc.config import DataConfig
from mshpc.data.prepare_progress import PrepareProgress
from mshpc.data.records import FORMATS, Reading, input_files, read_jobs, total_bytes
from mshpc.data.shards import INDEX_FILE, ShardWriter, TokenDataset, token_dtype
from mshpc.data.tokenize_pool import Task, Tokenized, TokenizePool, tokenize_all
from mshpc.data.tokenizer import ByteTokenizer, Tokenizer, build_tokenizer
from mshpc.data.tokenizer_dir import TOKENIZER_DIR, save_tokenizer_dir
from mshpc.errors import DataError

log = logging.getLogger(__name__)

DEFAULT_SHARD_TOKENS = 16_000_000
VAL_DIR = "val"  # the held-out split, a dataset folder inside the training one
# The embedded corpus's held-out share: about 17 of the stdlib's ~1,760 files, ~300k tokens,
# thousands of validation windows at any seq_len mshpc's configs use.
DEFAULT_VAL_FRACTION = 0.01


def default_workers() -> int:
    """The cores this process may run on: `mshpc prepare`'s default worker count."""
    return len(os.sched_getaffinity(0))


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


@dataclass
class ValSplit:
    """Which documents are held out: a `fraction` of them by hash, plus the documents of the --val
    inputs (`named`, their tokenized stream `held`), whose copies in training are left out."""

    fraction: float = 0.0
    named: str = ""  # the --val inputs, for messages; "" without them
    held: Iterable[Tokenized] = ()

    @property
    def wanted(self) -> bool:
        return self.fraction > 0 or bool(self.named)


def _shares(digests: bytes) -> np.ndarray:
    """Each document's place in [0, 1), from its sha256: uniform, and the same on every machine."""
    return np.frombuffer(digests, dtype=">u8").reshape(-1, 4)[:, 0] / 2.0**64


def _write_held(split: ValSplit, val: ShardWriter, progress: PrepareProgress) -> np.ndarray:
    """Write the --val inputs' documents into `val`; their sha256 digests, sorted ("S32"): the only
    thing kept per document, and only of the held-out inputs."""
    digests = []
    for part in split.held:
        progress.update(len(part.lengths), part.input_bytes)
        val.add(part.ids, part.lengths)
        digests.append(np.frombuffer(part.digests, dtype="S32"))
    if val.n_docs == 0:
        raise DataError(f"no documents in --val {split.named}")
    return np.unique(np.concatenate(digests))


def _write_split(results: Iterable[Tokenized], train: ShardWriter, val: ShardWriter | None,
                 split: ValSplit, progress: PrepareProgress) -> tuple[int, int]:
    """Write the held-out inputs into `val`, then the results into `train` or `val`; returns how
    many training documents were dropped as copies of a held-out input's, and the bad records skipped."""
    held = _write_held(split, val, progress) if split.named and val is not None else np.empty(0, "S32")
    dropped = skipped = 0
    for part in results:
        progress.update(len(part.lengths), part.input_bytes)
        skipped += part.skipped
        if part.first_bad is not None and skipped == part.skipped:
            log.warning("skipping bad records, the first: %s", part.first_bad)
        if val is None:
            train.add(part.ids, part.lengths)
            continue
        # 0 train, 1 val (a copy of a held-out document has its hash, so it lands there too), 2 dropped
        side = np.where(_shares(part.digests) < split.fraction, 1, 0)
        side[np.isin(np.frombuffer(part.digests, dtype="S32"), held)] = 2
        dropped += int((side == 2).sum())
        for writer, which in ((train, 0), (val, 1)):
            keep = side == which
            mask = np.repeat(keep, part.lengths)
            writer.add(part.ids[mask], part.lengths[keep])
    return dropped, skipped


def _check_written(writer: ShardWriter, val: ShardWriter | None, source: str, split: ValSplit) -> None:
    if writer.n_tokens == 0 and val is not None and val.n_tokens:
        raise DataError(f"every document of {source} was held out for validation (lower "
                        "--val-fraction, or give --val inputs that are not all the inputs)")
    if writer.n_tokens == 0:
        raise DataError(f"no documents in {source} (give {FORMATS}; empty records and files are skipped)")
    if val is not None and val.n_tokens == 0:
        raise DataError(f"no document of {source} fell in the validation split (--val-fraction "
                        f"{split.fraction:g} of {writer.n_docs} documents; raise it, or give --val inputs)")


def _build(results: Iterable[Tokenized], out_dir: Path, tokenizer: Tokenizer, shard_tokens: int,
           source: str, split: ValSplit | None = None, progress: PrepareProgress | None = None) -> Path:
    """Write the tokenized `results` (and the held-out split) into a sibling temp folder with the
    tokenizer's files, then publish it as `out_dir`."""
    split = split or ValSplit()
    progress = progress or PrepareProgress(0, mode="none")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    # A unique sibling: same filesystem (so rename is atomic), and racers never share it.
    tmp = out_dir.parent / f".{out_dir.name}.tmp-{uuid.uuid4().hex[:12]}"
    tmp.mkdir()
    try:
        save_tokenizer_dir(tokenizer, tmp / TOKENIZER_DIR)
        writer = ShardWriter(tmp, tokenizer, shard_tokens, TOKENIZER_DIR)
        val = None
        if split.wanted:
            (tmp / VAL_DIR).mkdir()
            save_tokenizer_dir(tokenizer, tmp / VAL_DIR / TOKENIZER_DIR)
            val = ShardWriter(tmp / VAL_DIR, tokenizer, shard_tokens, TOKENIZER_DIR)
        dropped, skipped = _write_split(results, writer, val, split, progress)
        progress.close()
        _check_written(writer, val, source, split)
        if skipped:
            log.warning("skipped %d bad records (--skip-bad-records)", skipped)
        if val is not None:
            val.finish()
            log.info("held out %s: %d docs, %d tokens (%d training copies of them left out)",
                     val_path(out_dir), val.n_docs, val.n_tokens, dropped)
        writer.finish()
        log.info("prepared %s: %d docs, %d tokens", out_dir, writer.n_docs, writer.n_tokens)
        return _publish(tmp, out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


@dataclass(frozen=True)
class PrepareOptions:
    """How `mshpc prepare` reads, tokenizes and splits (its flags)."""

    tokenizer: str = "byte"
    shard_tokens: int = DEFAULT_SHARD_TOKENS
    val_fraction: float = 0.0
    val_inputs: tuple[Path, ...] = ()
    reading: Reading = Reading()
    workers: int = 1
    progress: str = "none"  # "auto": a bar on a terminal, lines elsewhere


def _check_options(out_dir: Path, opts: PrepareOptions) -> None:
    if out_dir.exists():
        raise DataError(f"output {out_dir} already exists (remove it or choose another folder)")
    if opts.shard_tokens < 1:
        raise DataError(f"shard_tokens={opts.shard_tokens} must be >= 1")
    if not 0 <= opts.val_fraction < 1:
        raise DataError(f"--val-fraction {opts.val_fraction:g} must be in [0, 1) (e.g. 0.01)")
    if opts.workers < 1:
        raise DataError(f"--workers {opts.workers} must be >= 1 (default: the {default_workers()} cores)")


def prepare_corpus(inputs: Sequence[Path], out_dir: Path, opts: PrepareOptions = PrepareOptions()) -> Path:
    """Tokenize the records and text files of `inputs` into a new dataset folder `out_dir`, holding
    out `opts.val_fraction` of the documents and the inputs `opts.val_inputs` into its `val/`."""
    out_dir = Path(out_dir)
    _check_options(out_dir, opts)
    tokenizer = build_tokenizer(opts.tokenizer)
    files, held_files = input_files(inputs), input_files(opts.val_inputs)
    named = ", ".join(map(str, opts.val_inputs))
    wanted = opts.val_fraction > 0 or bool(named)
    task = Task(tokenizer, opts.reading, token_dtype(tokenizer.vocab_size), digests=wanted)
    source = ", ".join(str(p) for p in inputs) or "(no inputs)"
    progress = PrepareProgress(total_bytes(files) + total_bytes(held_files), mode=opts.progress)
    # one pool for both: the held-out inputs are tokenized as fast as the corpus, first, so that
    # their copies in the corpus are known when it streams past
    with TokenizePool(task, opts.workers) as pool:
        split = ValSplit(opts.val_fraction, named, pool.map(read_jobs(held_files, opts.reading)))
        results = pool.map(read_jobs(files, opts.reading))
        return _build(results, out_dir, tokenizer, opts.shard_tokens, source, split, progress)


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
    files = [(f, "text", False) for f, _, _ in input_files([stdlib]) if f.suffix == ".py"]
    task = Task(ByteTokenizer(), Reading(), token_dtype(ByteTokenizer.vocab_size), digests=True)
    return _build(tokenize_all(read_jobs(files, Reading()), task, 1), target, ByteTokenizer(),
                  DEFAULT_SHARD_TOKENS, str(stdlib), ValSplit(DEFAULT_VAL_FRACTION))


def dataset_path(cfg: DataConfig) -> Path:
    """The dataset folder `cfg` names: `cfg.path`, or else the embedded corpus in `cfg.cache_dir`."""
    if cfg.path is None:
        if cfg.tokenizer not in ("auto", "byte"):
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
