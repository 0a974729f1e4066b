"""Corpus preparation: input checks, determinism, atomic publication, the embedded default corpus."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from mshpc.config import DataConfig
from mshpc.data.prepare import PrepareOptions, _build, dataset_path, ensure_default_corpus, prepare_corpus
from mshpc.data.records import Job, Reading
from mshpc.data.shards import TokenDataset
from mshpc.data.tokenize_pool import Task, tokenize_all
from mshpc.data.tokenizer import ByteTokenizer
from mshpc.errors import DataError


def test_missing_input_is_named(corpus: Path, tmp_path: Path) -> None:
    with pytest.raises(DataError, match=r"input .*nope\.txt does not exist"):
        prepare_corpus([corpus, tmp_path / "nope.txt"], tmp_path / "ds")
    assert not (tmp_path / "ds").exists()


def test_empty_corpus_is_rejected_and_leaves_nothing(tmp_path: Path) -> None:
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "blob.bin").write_bytes(b"\x00\x01")
    (tmp_path / "in" / "empty.txt").write_bytes(b"")
    with pytest.raises(DataError, match="no documents in"):
        prepare_corpus([tmp_path / "in"], tmp_path / "out" / "ds")
    assert list((tmp_path / "out").iterdir()) == []  # the temp folder is gone too


def test_named_binary_file_is_an_error(tmp_path: Path) -> None:
    (tmp_path / "data.txt").write_bytes("café".encode("latin-1"))
    with pytest.raises(DataError, match=r"data\.txt: not UTF-8 text"):
        prepare_corpus([tmp_path / "data.txt"], tmp_path / "ds")


def test_existing_output_is_not_overwritten(corpus: Path, tmp_path: Path) -> None:
    (tmp_path / "ds").mkdir()
    with pytest.raises(DataError, match="already exists"):
        prepare_corpus([corpus], tmp_path / "ds")


def test_preparation_is_deterministic(corpus: Path, tmp_path: Path) -> None:
    a = json.loads((prepare_corpus([corpus], tmp_path / "a", PrepareOptions(shard_tokens=9)) / "index.json").read_text())
    b = json.loads((prepare_corpus([corpus], tmp_path / "b", PrepareOptions(shard_tokens=9)) / "index.json").read_text())
    assert a == b


def test_racer_that_publishes_first_wins(corpus: Path, tmp_path: Path) -> None:
    out = prepare_corpus([corpus], tmp_path / "ds")
    before = (out / "index.json").read_bytes()
    # A second preparation that finds the target already published keeps it and discards its own.
    task = Task(ByteTokenizer(), Reading(), np.dtype("<u2"), digests=False)
    other = tokenize_all([Job("test", 1, 10, texts=("other text",))], task, 1)
    assert _build(other, out, ByteTokenizer(), 100, "test") == out
    assert (out / "index.json").read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus", "ds"]


def test_dataset_path_checks_the_config(corpus: Path, tmp_path: Path) -> None:
    out = prepare_corpus([corpus], tmp_path / "ds")
    assert dataset_path(DataConfig(path=str(out))) == out
    with pytest.raises(DataError, match=r"data\.path=.*missing does not exist"):
        dataset_path(DataConfig(path=str(tmp_path / "missing")))
    with pytest.raises(DataError, match=r"data\.tokenizer='tok\.json' needs data\.path"):
        dataset_path(DataConfig(tokenizer="tok.json", cache_dir=str(tmp_path)))


def test_default_corpus_is_prepared_once_then_reused(tmp_path: Path) -> None:
    path = ensure_default_corpus(tmp_path / "cache")
    assert path.parent == tmp_path / "cache" and path.name.startswith("stdlib-byte-3.")
    ds = TokenDataset.open(path)
    assert ds.n_docs > 500 and ds.n_tokens > 5_000_000 and ds.tokenizer == "byte"
    stamp = (path / "index.json").stat().st_mtime_ns
    assert dataset_path(DataConfig(cache_dir=str(tmp_path / "cache"))) == path
    assert (path / "index.json").stat().st_mtime_ns == stamp
    # A broken cache entry is prepared again rather than trusted.
    (path / "index.json").write_text("{}")
    assert ensure_default_corpus(tmp_path / "cache") == path
    assert TokenDataset.open(path).n_tokens == ds.n_tokens
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == [path.name]
