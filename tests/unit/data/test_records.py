"""Every input kind prepare reads, built here with the libraries people write them with: the
dataset must hold exactly their documents, in order; bad input is one line and leaves nothing."""

from __future__ import annotations

import gzip
import io
import json
import os
from pathlib import Path

import numpy as np
import pytest

from mshpc.data import records, tokenize_pool
from mshpc.data.prepare import PrepareOptions, prepare_corpus
from mshpc.data.prepare_progress import PrepareProgress
from mshpc.data.records import Reading
from mshpc.data.shards import TokenDataset
from mshpc.errors import DataError

TEXTS = ["first record", "déjà vu — ünïcode", "line\nbreaks\ninside", "x" * 3000, "last"]


def documents(path: Path) -> list[str]:
    """The documents a dataset holds, decoded from its byte tokens (each ends in 256)."""
    ds = TokenDataset.open(path)
    stream, starts = ds.tokens(0, ds.n_tokens), [*ds.doc_starts().tolist(), ds.n_tokens]
    docs = [stream[a:b] for a, b in zip(starts, starts[1:], strict=False)]
    assert all(d[-1] == 256 for d in docs)
    return [bytes(d[:-1].astype(np.uint8)).decode() for d in docs]


def jsonl(texts: list[str], extra: dict | None = None) -> bytes:
    return "".join(json.dumps({"id": i, "text": t, **(extra or {})}) + "\n" for i, t in enumerate(texts)).encode()


def test_jsonl_plain_gz_and_zst_hold_their_records(tmp_path: Path) -> None:
    import zstandard

    (tmp_path / "a.jsonl").write_bytes(jsonl(TEXTS))
    (tmp_path / "b.jsonl.gz").write_bytes(gzip.compress(jsonl(TEXTS[:2])))
    (tmp_path / "c.ndjson.zst").write_bytes(zstandard.ZstdCompressor().compress(jsonl(TEXTS[2:])))
    out = prepare_corpus([tmp_path / "a.jsonl", tmp_path / "b.jsonl.gz", tmp_path / "c.ndjson.zst"], tmp_path / "ds")
    assert documents(out) == TEXTS + TEXTS[:2] + TEXTS[2:]


def test_parquet_row_groups_and_a_saved_dataset_hold_their_records(tmp_path: Path) -> None:
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"body": TEXTS, "n": list(range(len(TEXTS)))}), tmp_path / "t.parquet", row_group_size=2)
    assert pq.ParquetFile(tmp_path / "t.parquet").num_row_groups == 3
    datasets.Dataset.from_dict({"text": TEXTS[::-1]}).save_to_disk(str(tmp_path / "saved"))
    dd = datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": TEXTS[:3]}),
                               "test": datasets.Dataset.from_dict({"text": ["held"]})})
    dd.save_to_disk(str(tmp_path / "dict"))
    out = prepare_corpus([tmp_path / "t.parquet"], tmp_path / "pq", PrepareOptions(reading=Reading("body")))
    assert documents(out) == TEXTS
    out = prepare_corpus([tmp_path / "saved", tmp_path / "dict"], tmp_path / "hf")
    assert documents(out) == TEXTS[::-1] + TEXTS[:3]


def test_a_folder_mixes_text_files_and_records_in_sorted_order(tmp_path: Path) -> None:
    (tmp_path / "in" / "sub").mkdir(parents=True)
    (tmp_path / "in" / "a.txt").write_text("a text file")
    (tmp_path / "in" / "b.jsonl").write_bytes(jsonl(TEXTS[:2]))
    (tmp_path / "in" / "sub" / "c.md").write_text("# c")
    assert documents(prepare_corpus([tmp_path / "in"], tmp_path / "ds")) == ["a text file", *TEXTS[:2], "# c"]


@pytest.mark.parametrize("line, message", [
    (b'{"text": "ok"', r"bad\.jsonl:3: not valid JSON"),
    (b'{"body": "no text"}', r"bad\.jsonl:3: no field 'text' \(fields: body; choose one with --text-field\)"),
    (b'{"text": 7}', r"bad\.jsonl:3: field 'text' is a JSON int, not a string"),
    (b'["a list"]', r"bad\.jsonl:3: a JSON list, not an object"),
])
def test_a_bad_record_names_file_and_line_and_leaves_nothing(tmp_path: Path, line: bytes, message: str) -> None:
    (tmp_path / "bad.jsonl").write_bytes(jsonl(TEXTS[:2]) + line + b"\n" + jsonl(TEXTS[2:]))
    with pytest.raises(DataError, match=message) as err:
        prepare_corpus([tmp_path / "bad.jsonl"], tmp_path / "out" / "ds", PrepareOptions(workers=2))
    assert "\n" not in str(err.value) and "--skip-bad-records" in str(err.value)
    assert list((tmp_path / "out").iterdir()) == []
    out = prepare_corpus([tmp_path / "bad.jsonl"], tmp_path / "ds",
                         PrepareOptions(reading=Reading(skip_bad=True), workers=2))
    assert documents(out) == TEXTS


def test_unknown_formats_and_a_missing_column_are_one_line(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    (tmp_path / "data.csv.bz2").write_bytes(b"BZh9")
    with pytest.raises(DataError, match=r"data\.csv\.bz2: unknown format '\.bz2' \(choose JSONL"):
        prepare_corpus([tmp_path / "data.csv.bz2"], tmp_path / "ds")
    pq.write_table(pa.table({"body": TEXTS}), tmp_path / "t.parquet")
    with pytest.raises(DataError, match=r"t\.parquet: no column 'text' \(columns: body; choose one with --text-field"):
        prepare_corpus([tmp_path / "t.parquet"], tmp_path / "ds")
    assert not (tmp_path / "ds").exists()


def test_output_is_the_same_bytes_for_any_worker_count(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(records, "BLOCK_BYTES", 256)  # many jobs, so that workers interleave
    seen = tmp_path / "tokenized-by"  # which process tokenized which input (forked workers append)

    def tokenize(job: records.Job, task: tokenize_pool.Task) -> tokenize_pool.Tokenized:
        with open(seen, "a") as f:
            f.write(f"{os.getpid()} {Path(job.where).name}\n")
        return real_tokenize(job, task)

    real_tokenize = tokenize_pool.tokenize
    monkeypatch.setattr(tokenize_pool, "tokenize", tokenize)
    rng = np.random.default_rng(0)
    texts = ["".join(rng.choice(list("abc de\n"), size=int(rng.integers(1, 200)))) for _ in range(300)]
    (tmp_path / "c.jsonl").write_bytes(jsonl(texts))
    copy = max(texts, key=len)
    held = ["held out, and never in training", copy]
    (tmp_path / "held.jsonl").write_bytes(jsonl(held * 20))
    made = []
    for n in (1, 2, 3):
        seen.unlink(missing_ok=True)
        made.append(prepare_corpus([tmp_path / "c.jsonl"], tmp_path / f"w{n}", PrepareOptions(
            workers=n, shard_tokens=1000, val_fraction=0.1, val_inputs=(tmp_path / "held.jsonl",))))
        pids = {line.split()[0] for line in seen.read_text().splitlines() if line.endswith(" held.jsonl")}
        assert pids and (str(os.getpid()) in pids) == (n == 1)  # --val inputs go through the workers too
    files = [sorted(p.relative_to(m) for p in m.rglob("*") if p.is_file()) for m in made]
    assert files[0] == files[1] == files[2]
    for name in files[0]:
        assert (made[0] / name).read_bytes() == (made[1] / name).read_bytes() == (made[2] / name).read_bytes()
    val = documents(made[0] / "val")
    assert val.count(copy) == 20 and copy not in documents(made[0])  # a held-out text's copy left out of training
    assert sorted(documents(made[0]) + val) == sorted([t for t in texts if t and t != copy] + held * 20)


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_is_a_bar_on_a_terminal_and_lines_elsewhere(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("mshpc.data.prepare_progress.LINE_INTERVAL_S", 0.0)
    monkeypatch.setattr("mshpc.data.prepare_progress.REDRAW_S", 0.0)
    for stream, marker in ((Terminal(), "\r["), (io.StringIO(), "mshpc: prepare: ")):
        progress = PrepareProgress(2_000_000, stream)
        progress.update(3, 1_000_000)
        progress.close()
        text = stream.getvalue()
        assert text.startswith(marker) and "3 docs" in text and "MB/s" in text and "ETA" in text
        assert text.endswith("MB/s)\n")
    assert "\r" not in stream.getvalue()
