"""The shard format: round trips, multi-shard streams, and the checks that reject broken data."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

from mshpc.data.prepare import PrepareOptions, prepare_corpus
from mshpc.data.shards import TokenDataset
from mshpc.errors import DataError


def expected_stream(docs: list[bytes], eos: int = 256) -> np.ndarray:
    """The token stream the byte tokenizer makes of `docs`: each followed by eos."""
    return np.concatenate([np.append(np.frombuffer(d, np.uint8).astype(np.int64), eos) for d in docs])


def test_round_trip_decodes_to_the_documents(corpus: Path, corpus_docs: list[bytes],
                                             tmp_path: Path) -> None:
    ds = TokenDataset.open(prepare_corpus([corpus], tmp_path / "ds"))
    want = expected_stream(corpus_docs)
    assert (ds.n_tokens, ds.n_docs, ds.vocab_size, ds.eos_id) == (len(want), 3, 257, 256)
    stream = ds.tokens(0, ds.n_tokens)
    assert stream.dtype == np.uint16
    np.testing.assert_array_equal(stream, want)
    ends = np.flatnonzero(stream == 256)
    assert ends[-1] == len(stream) - 1
    docs = [bytes(stream[a:b].astype(np.uint8)) for a, b in zip(np.r_[0, ends[:-1] + 1], ends)]
    assert docs == corpus_docs
    lengths = [len(d) + 1 for d in corpus_docs]
    np.testing.assert_array_equal(ds.doc_starts(), np.cumsum([0] + lengths[:-1]))


def test_tiny_shards_form_the_same_stream(corpus: Path, tmp_path: Path) -> None:
    one = TokenDataset.open(prepare_corpus([corpus], tmp_path / "one"))
    many = TokenDataset.open(prepare_corpus([corpus], tmp_path / "many", PrepareOptions(shard_tokens=7)))
    index = json.loads((tmp_path / "many" / "index.json").read_text())
    assert len(index["shards"]) == -(-one.n_tokens // 7)
    assert all(s["n_tokens"] == 7 for s in index["shards"][:-1])
    full = one.tokens(0, one.n_tokens)
    for start in range(0, one.n_tokens, 3):
        for length in (0, 1, 6, 7, 8, 20):
            length = min(length, one.n_tokens - start)
            np.testing.assert_array_equal(many.tokens(start, length), full[start:start + length])
    np.testing.assert_array_equal(many.doc_starts(), one.doc_starts())


def _flip_byte(path: Path, at: int) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= 0xFF
    path.write_bytes(bytes(data))


def test_corrupted_shard_fails_its_checksum(corpus: Path, tmp_path: Path) -> None:
    out = prepare_corpus([corpus], tmp_path / "ds", PrepareOptions(shard_tokens=7))
    _flip_byte(out / "shard-00003.bin", 4)
    with pytest.raises(DataError, match=r"shard-00003\.bin: checksum mismatch .*re-run mshpc prepare"):
        TokenDataset.open(out)
    TokenDataset.open(out, verify=False)  # sizes still match: only the checksum can tell


def test_corrupted_doc_offsets_fail_their_checksum(corpus: Path, tmp_path: Path) -> None:
    out = prepare_corpus([corpus], tmp_path / "ds")
    path = out / "shard-00000.docs.npy"
    _flip_byte(path, path.stat().st_size - 1)
    with pytest.raises(DataError, match=r"shard-00000\.docs\.npy: checksum mismatch"):
        TokenDataset.open(out)


def test_truncated_shard_is_rejected_without_verify(corpus: Path, tmp_path: Path) -> None:
    out = prepare_corpus([corpus], tmp_path / "ds", PrepareOptions(shard_tokens=7))
    path = out / "shard-00001.bin"
    path.write_bytes(path.read_bytes()[:-2])
    with pytest.raises(DataError, match=r"shard-00001\.bin: 12 bytes, index says 7 tokens = 14 bytes"):
        TokenDataset.open(out, verify=False)


def test_a_shard_truncated_while_open_is_a_data_error_not_sigbus(corpus: Path, tmp_path: Path) -> None:
    # through a memory map this read would kill the process with SIGBUS (a "node fault")
    ds = TokenDataset.open(prepare_corpus([corpus], tmp_path / "ds", PrepareOptions(shard_tokens=7)))
    before = ds.tokens(0, 20)
    for size in (0, 4):
        os.truncate(tmp_path / "ds" / "shard-00001.bin", size)
        with pytest.raises(DataError, match=rf"shard-00001\.bin: {size} bytes, index says 7 tokens = 14 bytes"):
            ds.tokens(3, 5)  # crosses into shard 1
        with pytest.raises(DataError, match=r"shard-00001\.bin"):
            ds.tokens(8, 1)  # wholly inside what is left of it: the size is checked first
    np.testing.assert_array_equal(ds.tokens(0, 7), before[:7])  # the sound shards still read


def test_missing_shard_file_is_named(corpus: Path, tmp_path: Path) -> None:
    out = prepare_corpus([corpus], tmp_path / "ds", PrepareOptions(shard_tokens=7))
    (out / "shard-00002.bin").unlink()
    with pytest.raises(DataError, match=r"shard-00002\.bin: missing"):
        TokenDataset.open(out)


def test_missing_folder_or_index_is_rejected(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="is not a folder; make one with mshpc prepare"):
        TokenDataset.open(tmp_path / "nowhere")
    with pytest.raises(DataError, match="has no index.json"):
        TokenDataset.open(tmp_path)


def test_malformed_index_is_rejected(corpus: Path, tmp_path: Path) -> None:
    out = prepare_corpus([corpus], tmp_path / "ds")
    index_path = out / "index.json"
    good = json.loads(index_path.read_text())
    for bad, message in [({**good, "version": 99}, "v99 is not mshpc-tokens v1"),
                         ({**good, "n_tokens": good["n_tokens"] + 1}, "disagree"),
                         ({k: v for k, v in good.items() if k != "eos_id"}, "'eos_id' is missing")]:
        index_path.write_text(json.dumps(bad))
        with pytest.raises(DataError, match=message):
            TokenDataset.open(out)
    index_path.write_text("{not json")
    with pytest.raises(DataError, match="unreadable"):
        TokenDataset.open(out)


def test_closed_dataset_refuses_reads(corpus: Path, tmp_path: Path) -> None:
    ds = TokenDataset.open(prepare_corpus([corpus], tmp_path / "ds"))
    ds.close()
    with pytest.raises(DataError, match="is closed"):
        ds.tokens(0, 4)
