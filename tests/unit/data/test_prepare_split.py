"""The held-out validation split: by document (never by window), stable, and with no document on
both sides; the embedded corpus has one."""

from __future__ import annotations

import shutil

from pathlib import Path

import numpy as np
import pytest

from mshpc.config import DataConfig
from mshpc.data.prepare import PrepareOptions, ensure_default_corpus, prepare_corpus, val_dataset_path, val_path
from mshpc.data.shards import TokenDataset
from mshpc.errors import DataError


def documents(path: Path) -> list[bytes]:
    """The dataset's documents, decoded back from its token stream (byte tokens; eos ends each)."""
    ds = TokenDataset.open(path)
    stream = ds.tokens(0, ds.n_tokens)
    starts = [*ds.doc_starts().tolist(), ds.n_tokens]
    return [bytes(stream[lo:hi - 1].astype(np.uint8)) for lo, hi in zip(starts, starts[1:], strict=False)]


@pytest.fixture
def many_docs(tmp_path: Path) -> Path:
    """200 distinct documents, plus two copies of one of them."""
    root = tmp_path / "docs"
    root.mkdir()
    for i in range(200):
        (root / f"d{i:03d}.txt").write_text(f"document {i}: " + "x" * (i % 17) + "\n")
    (root / "copy-a.txt").write_text("the same text\n")
    (root / "copy-b.txt").write_text("the same text\n")
    return root


def test_fraction_splits_by_document_with_none_on_both_sides(many_docs: Path, tmp_path: Path) -> None:
    out = prepare_corpus([many_docs], tmp_path / "ds", PrepareOptions(val_fraction=0.2))
    train, val = documents(out), documents(val_path(out))
    assert not set(train) & set(val)  # identical copies land on the same side
    assert set(train) | set(val) == {p.read_bytes() for p in many_docs.iterdir()}
    assert 20 <= len(set(val)) <= 60  # about 0.2 of 201 distinct documents
    # stable: the same split again, and every held-out document stays held out at a larger fraction
    again = prepare_corpus([many_docs], tmp_path / "again", PrepareOptions(val_fraction=0.2))
    assert documents(val_path(again)) == val
    assert set(val) < set(documents(val_path(prepare_corpus([many_docs], tmp_path / "more", PrepareOptions(val_fraction=0.4)))))


def test_val_files_are_held_out_and_left_out_of_training(many_docs: Path, tmp_path: Path) -> None:
    held = many_docs / "d007.txt"
    out = prepare_corpus([many_docs], tmp_path / "ds", PrepareOptions(val_inputs=[held]))  # also among the inputs
    assert documents(val_path(out)) == [held.read_bytes()]
    assert held.read_bytes() not in documents(out) and len(documents(out)) == 201
    assert val_dataset_path(DataConfig(path=str(out))) == val_path(out)


def test_split_errors_are_one_line(many_docs: Path, tmp_path: Path) -> None:
    with pytest.raises(DataError, match=r"--val-fraction 1 must be in \[0, 1\)"):
        prepare_corpus([many_docs], tmp_path / "a", PrepareOptions(val_fraction=1.0))
    one = tmp_path / "one.txt"
    one.write_text("a single document\n")
    with pytest.raises(DataError, match="every document of .* was held out"):
        prepare_corpus([one], tmp_path / "b", PrepareOptions(val_inputs=[one]))
    with pytest.raises(DataError, match="no document of .* fell in the validation split"):
        prepare_corpus([one], tmp_path / "c", PrepareOptions(val_fraction=1e-12))
    plain = prepare_corpus([many_docs], tmp_path / "plain")
    assert not val_path(plain).exists()
    with pytest.raises(DataError, match=r"needs a validation split.*--val-fraction"):
        val_dataset_path(DataConfig(path=str(plain)))


def test_default_corpus_has_a_split_and_an_old_cache_gets_one(tmp_path: Path) -> None:
    path = ensure_default_corpus(tmp_path / "cache")
    val = TokenDataset.open(val_path(path))
    assert 5 <= val.n_docs <= 60 and val.n_tokens > 100_000  # ~1% of the stdlib's ~1,760 files
    # a cache prepared before the split existed is prepared again, with one
    shutil.rmtree(val_path(path))
    assert ensure_default_corpus(tmp_path / "cache") == path
    assert TokenDataset.open(val_path(path)).n_docs == val.n_docs
