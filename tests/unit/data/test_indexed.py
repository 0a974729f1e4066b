"""Megatron .bin/.idx pairs, written by megatron-core's own IndexedDatasetBuilder, read token for
token with their document boundaries; a broken index is one line."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from mshpc.config import DataConfig
from mshpc.data.indexed import IndexedTokens, indexed_prefix
from mshpc.data.sampler import SequenceSampler
from mshpc.data.sources import open_sources, source_paths
from mshpc.data.window_reader import WindowReader
from mshpc.errors import DataError


@pytest.fixture(scope="module")
def megatron_pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[np.ndarray], int]:
    """A pair of 40 documents (the second of two sequences, as --split-sentences writes them),
    each ending in eod 999, in megatron-core's optimal dtype for a 1000-id vocabulary."""
    import torch
    from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder

    prefix = tmp_path_factory.mktemp("megatron") / "corpus_text_document"
    rng = np.random.default_rng(0)
    docs = [np.append(rng.integers(0, 999, size=int(rng.integers(1, 60))), 999) for _ in range(40)]
    builder = IndexedDatasetBuilder(str(prefix) + ".bin", dtype=DType.optimal_dtype(1000))
    for doc in docs:
        cut = max(1, len(doc) // 2)
        builder.add_document(torch.tensor(doc), [cut, len(doc) - cut] if cut < len(doc) else [cut])
    builder.finalize(str(prefix) + ".idx")
    return prefix, docs, 999


def test_the_pair_reads_token_for_token_with_its_documents(megatron_pair) -> None:
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    prefix, docs, eod = megatron_pair
    assert indexed_prefix(prefix) == indexed_prefix(prefix.with_suffix(".bin")) == prefix
    theirs = IndexedDataset(str(prefix))
    ours = IndexedTokens(prefix, "train", 0.0, eod, 1000)
    stream = np.concatenate(docs)
    assert ours.n_tokens == len(stream) == sum(len(theirs[i]) for i in range(len(theirs)))
    np.testing.assert_array_equal(ours.tokens(0, ours.n_tokens), stream)
    np.testing.assert_array_equal(ours.tokens(17, 50), stream[17:67])
    np.testing.assert_array_equal(ours.doc_starts(), np.cumsum([0, *map(len, docs[:-1])]))


def test_its_last_documents_are_the_held_out_split(megatron_pair) -> None:
    prefix, docs, eod = megatron_pair
    cfg = DataConfig(path=str(prefix), tokenizer="byte", indexed_val_fraction=0.1)
    train = open_sources(cfg, source_paths(cfg), "train").sources[0]
    val = open_sources(cfg, source_paths(cfg), "val").sources[0]
    np.testing.assert_array_equal(train.tokens(0, train.n_tokens), np.concatenate(docs[:36]))
    np.testing.assert_array_equal(val.tokens(0, val.n_tokens), np.concatenate(docs[36:]))


def test_a_broken_index_is_one_line(megatron_pair, tmp_path: Path) -> None:
    prefix, _, _ = megatron_pair
    bad = tmp_path / "bad"
    bad.with_suffix(".bin").write_bytes(prefix.with_suffix(".bin").read_bytes())
    idx = bytearray(prefix.with_suffix(".idx").read_bytes())
    idx[18:26] = (10**12).to_bytes(8, "little")  # a sequence count no file could hold
    bad.with_suffix(".idx").write_bytes(bytes(idx))
    with pytest.raises(DataError, match=r"bad\.idx: 1000000000000 sequences and .* do not fit its"):
        IndexedTokens(bad, "train", 0.0, 0, 1000)
    bad.with_suffix(".idx").write_bytes(b"not an index at all")
    with pytest.raises(DataError, match=r"bad\.idx: not a Megatron MMIDIDX index"):
        IndexedTokens(bad, "train", 0.0, 0, 1000)


def test_ids_past_the_models_vocabulary_stop_the_read_in_one_line(megatron_pair) -> None:
    """A pair records no tokenizer, so the reader's check is what catches a model too small for it."""
    prefix, docs, eod = megatron_pair
    source = IndexedTokens(prefix, "train", 0.0, eod, 1000)
    whole = SequenceSampler(source.n_tokens, source.n_tokens - 1, 1, 0, shuffle=False)  # one window: every id
    np.testing.assert_array_equal(WindowReader(source, whole, 1, eod, 1000).windows(0, 0)[0], np.concatenate(docs))
    with pytest.raises(DataError, match=rf"corpus_text_document: token id {eod} in window 0 is >= "
                                        r"model\.vocab_size=512 \(was it made with another tokenizer\?"):
        WindowReader(source, whole, 1, eod, 512).windows(0, 0)  # the row's largest id, eod 999, is named
