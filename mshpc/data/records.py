"""The inputs of `mshpc prepare`, read as a stream of jobs for the tokenizing workers: each record
a document, read in bounded pieces whatever the corpus size.

- JSONL (`.jsonl`, `.ndjson`, each also `.gz` or `.zst`): one JSON object a line, its text in
  `text_field`. Blocks of about BLOCK_BYTES of whole lines go to the workers, which parse them.
- Parquet (`.parquet`): the `text_field` column, one row group at a time (pyarrow).
- A Hugging Face dataset saved with `save_to_disk` (a folder with `state.json`; of a DatasetDict,
  its `train` split): the column from its Arrow files, one record batch at a time.
- Text files (TEXT_SUFFIXES, or a named file without a suffix): each file one document, as before.

Folders are walked recursively in sorted order (so a corpus always prepares to the same bytes),
skipping hidden folders, `__pycache__`, `site-packages` and `node_modules`.
"""

from __future__ import annotations

import gzip
import json
import logging
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from mshpc.errors import DataError

log = logging.getLogger(__name__)

TEXT_SUFFIXES = frozenset({
    ".txt", ".md", ".rst", ".tex", ".json", ".yaml", ".yml", ".toml", ".cfg", ".ini",
    ".csv", ".xml", ".html", ".css", ".py", ".pyi", ".c", ".h", ".cc", ".cpp", ".hpp", ".cu",
    ".rs", ".go", ".java", ".js", ".ts", ".sh",
})
JSONL_SUFFIXES = (".jsonl", ".ndjson", ".jsonl.gz", ".ndjson.gz", ".jsonl.zst", ".ndjson.zst")
SKIP_DIRS = frozenset({"__pycache__", "site-packages", "node_modules"})
BLOCK_BYTES = 4 << 20  # text per job: large enough to amortize a job, small enough to bound memory
FORMATS = ("JSONL (.jsonl, .ndjson, also .gz or .zst), Parquet (.parquet), a save_to_disk folder, "
           f"or text files ({', '.join(sorted(TEXT_SUFFIXES))})")


@dataclass(frozen=True)
class Job:
    """A piece of input for one worker: raw JSONL lines (`lines`) or document texts (`texts`).
    `where` and `first` (line or row number of the first record) name a bad record."""

    where: str
    first: int
    input_bytes: int  # of the input file consumed (compressed bytes where it is compressed)
    lines: bytes = b""
    texts: tuple[str, ...] = ()
    skipped: int = 0  # bad records already skipped while reading (null Arrow values)


@dataclass(frozen=True)
class Reading:
    """How records are read: the field that holds the text, and whether a bad record stops."""

    text_field: str = "text"
    skip_bad: bool = False


def _kind(path: Path) -> str:
    name = path.name.lower()
    if path.is_dir():
        return "hf" if (path / "state.json").is_file() or (path / "dataset_dict.json").is_file() else "folder"
    if name.endswith(JSONL_SUFFIXES):
        return "jsonl"
    if name.endswith(".parquet"):
        return "parquet"
    if path.suffix.lower() in TEXT_SUFFIXES or not path.suffix:
        return "text"
    return "unknown"


def _walk(folder: Path) -> Iterator[Path]:
    """Inputs under `folder`, depth first in sorted order."""
    for root, dirs, files in os.walk(folder):
        dirs[:] = sorted(d for d in dirs if not d.startswith(".") and d not in SKIP_DIRS)
        for name in sorted(files):
            if _kind(Path(root) / name) in ("jsonl", "parquet", "text"):
                yield Path(root) / name


def input_files(inputs: Sequence[Path]) -> list[tuple[Path, str, bool]]:
    """(path, kind, named explicitly) of every input, after checking that all exist and that every
    named one has a format mshpc reads."""
    found: list[tuple[Path, str, bool]] = []
    for path in map(Path, inputs):
        if not path.exists():
            raise DataError(f"input {path} does not exist (give {FORMATS}, or folders of them)")
        kind = _kind(path)
        if kind == "unknown":
            raise DataError(f"input {path}: unknown format {path.suffix!r} (choose {FORMATS})")
        if kind == "folder":
            found += [(f, _kind(f), False) for f in _walk(path)]
        else:
            found.append((path, kind, True))
    return found


def total_bytes(files: Sequence[tuple[Path, str, bool]]) -> int:
    """The input size a progress display counts down (a saved dataset's Arrow files)."""
    return sum(sum(p.stat().st_size for p in _arrow_files(f)) if k == "hf" else f.stat().st_size
               for f, k, _ in files)


def _is_text(data: bytes) -> bool:
    if b"\x00" in data:
        return False
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def _text_jobs(files: Sequence[tuple[Path, bool]]) -> Iterator[Job]:
    """Text files, a document each, batched into jobs of about BLOCK_BYTES; folder members that are
    not UTF-8 text are skipped, a named one is an error."""
    texts: list[str] = []
    size = skipped = 0
    for path, explicit in files:
        try:
            data = path.read_bytes()
        except OSError as exc:
            if explicit:
                raise DataError(f"input {path}: unreadable ({exc.strerror})") from None
            skipped += 1
            continue
        if not _is_text(data):
            if explicit:
                raise DataError(f"input {path}: not UTF-8 text (binary or another encoding)")
            skipped += 1
            continue
        if data:
            texts.append(data.decode("utf-8"))
        size += len(data)
        if size >= BLOCK_BYTES:
            yield Job(str(path), 1, size, texts=tuple(texts))
            texts, size = [], 0
    if texts or size:
        yield Job("text files", 1, size, texts=tuple(texts))
    if skipped:
        log.info("skipped %d unreadable or non-UTF-8 files", skipped)


def _open_jsonl(path: Path) -> tuple[Any, BinaryIO]:
    """(the decompressed stream, the file under it: its position counts the input consumed)."""
    raw = open(path, "rb")
    name = path.name.lower()
    if name.endswith(".gz"):
        return gzip.GzipFile(fileobj=raw, mode="rb"), raw
    if name.endswith(".zst"):
        try:
            import zstandard
        except ImportError:
            raw.close()
            raise DataError(f"input {path}: reading .zst needs the zstandard package: pip install zstandard") from None
        return zstandard.ZstdDecompressor().stream_reader(raw), raw
    return raw, raw


def _jsonl_jobs(path: Path) -> Iterator[Job]:
    """Blocks of whole lines of one JSONL file (the last line may lack its newline)."""
    stream, raw = _open_jsonl(path)
    line, carry, consumed = 1, b"", 0
    with stream, raw:
        while True:
            try:
                block = stream.read(BLOCK_BYTES)
            except (OSError, EOFError, ValueError) as exc:  # gzip and zstandard say a corrupt file so
                raise DataError(f"input {path}: cannot decompress after line {line} ({exc})") from None
            data = carry + block
            cut = len(data) if not block else data.rfind(b"\n") + 1
            if cut > 0 and data[:cut]:
                position = raw.tell()
                yield Job(str(path), line, position - consumed, lines=data[:cut])
                line, consumed = line + data.count(b"\n", 0, cut), position
            carry = data[cut:]
            if not block:
                return


def _column(table: Any, path: Path, field: str) -> Any:
    import pyarrow as pa

    if field not in table.schema.names:
        raise DataError(f"input {path}: no column {field!r} (columns: {', '.join(table.schema.names)}; "
                        "choose one with --text-field)")
    kind = table.schema.field(field).type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
        raise DataError(f"input {path}: column {field!r} is {kind}, not a string (choose one with --text-field)")
    return table.column(field)


def _batch_jobs(batches: Iterator[tuple[Any, int]], path: Path, reading: Reading) -> Iterator[Job]:
    """Jobs of Arrow record batches' text column, each with its input bytes; a null is a bad
    record (row numbers from 1)."""
    row = 1
    for batch, size in batches:
        values = _column(batch, path, reading.text_field).to_pylist()
        nulls = values.count(None)
        if nulls and not reading.skip_bad:
            raise DataError(f"input {path}: row {row + values.index(None)}: field {reading.text_field!r} is "
                            "null (--skip-bad-records skips such records)")
        yield Job(str(path), row, size, texts=tuple(v for v in values if v), skipped=nulls)
        row += len(values)


def _compressed_size(group: Any) -> int:
    return sum(group.column(i).total_compressed_size for i in range(group.num_columns))


def _parquet_jobs(path: Path, reading: Reading) -> Iterator[Job]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError(f"input {path}: reading Parquet needs the pyarrow package: pip install pyarrow") from None
    try:
        pf = pq.ParquetFile(path)
    except Exception as exc:  # pyarrow raises ArrowInvalid and OSError kinds for a file that is not Parquet
        raise DataError(f"input {path}: not a Parquet file ({exc})") from None
    _column(pf.schema_arrow.empty_table(), path, reading.text_field)
    batches = ((pf.read_row_group(g, columns=[reading.text_field]), _compressed_size(pf.metadata.row_group(g)))
               for g in range(pf.num_row_groups))
    yield from _batch_jobs(batches, path, reading)


def _arrow_files(folder: Path) -> list[Path]:
    """The Arrow files of a save_to_disk folder (of a DatasetDict: its train split), as its
    state.json lists them: plain names inside the folder only."""
    if (folder / "dataset_dict.json").is_file():
        splits = sorted(p.name for p in folder.iterdir() if (p / "state.json").is_file())
        if "train" not in splits:
            raise DataError(f"input {folder}: a DatasetDict without a train split (name one of its splits: "
                            f"{', '.join(str(folder / s) for s in splits) or 'none found'})")
        folder = folder / "train"
    try:
        state = json.loads((folder / "state.json").read_text())
        names = [entry["filename"] for entry in state["_data_files"]]
    except (ValueError, OSError, KeyError, TypeError) as exc:
        raise DataError(f"input {folder}: state.json is not a save_to_disk index ({exc})") from None
    for name in names:
        if not isinstance(name, str) or Path(name).name != name or not name.endswith(".arrow"):
            raise DataError(f"input {folder}: state.json names {name!r}, not an .arrow file of the folder")
    return [folder / n for n in names]


def _hf_jobs(folder: Path, reading: Reading) -> Iterator[Job]:
    try:
        import pyarrow as pa
    except ImportError:
        raise DataError(f"input {folder}: reading a saved dataset needs pyarrow: pip install pyarrow") from None
    for path in _arrow_files(folder):
        try:
            reader = pa.ipc.open_stream(pa.memory_map(str(path)))
        except Exception as exc:  # pyarrow's ArrowInvalid and OSError kinds
            raise DataError(f"input {path}: not an Arrow stream file ({exc})") from None
        yield from _batch_jobs(((b, b.nbytes) for b in reader), path, reading)


def read_jobs(files: Sequence[tuple[Path, str, bool]], reading: Reading) -> Iterator[Job]:
    """Every input's jobs, in input order; consecutive text files share jobs."""
    pending: list[tuple[Path, bool]] = []
    for path, kind, explicit in files:
        if kind == "text":
            pending.append((path, explicit))
            continue
        yield from _text_jobs(pending)
        pending = []
        if kind == "jsonl":
            yield from _jsonl_jobs(path)
        elif kind == "parquet":
            yield from _parquet_jobs(path, reading)
        else:
            yield from _hf_jobs(path, reading)
    yield from _text_jobs(pending)
