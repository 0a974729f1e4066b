"""The checkpoint manifest: what each tensor is, which slice of it each shard file holds, and a
checksum of its bytes. Plain JSON, written last: a folder without one is not a checkpoint.

    {"format": "mshpc-checkpoint", "version": 1, "step": 100, "config_hash": "...",
     "layout": {"dp": 2, "tp": 1, "pp": 1}, "created_unix": 1764000000.0,
     "tensors": [{"name": "model/layers.0.attn.qkv.weight", "global_shape": [768, 256],
                  "dtype": "float32", "file": "shard-00000.h5", "dataset": "model/layers.0...",
                  "start": 0, "numel": 196608, "crc32": 123456, "offset": 8192}, ...],
     "extras": {...}}      # JSON-only state: scheduler, data position, per-rank notes

A tensor is a list of entries whose flat ranges [start, start + numel) tile it. `offset` is where
the dataset's contiguous bytes start in its shard file (what HDF5's own metadata says too), so a
restore reads them with large parallel reads and no rank needs to parse another's HDF5 headers;
manifests written before it existed lack it, and the reader asks h5py instead.

Beside it, written just before it, `manifest.index.json` says where each tensor's entry lines
lie in the manifest, so a restoring rank parses only the entries its dp group holds (catalog.py):

    {"format": "mshpc-checkpoint-index", "version": 1, "manifest_bytes": 427772162,
     "head_bytes": 310, "names": {"master/layers.0.attn.wq.weight@tp0": [[8192, 1450, 6]], ...}}

Each name maps to runs of its consecutive lines, [byte offset, bytes, entries] (one run when the
entries are grouped by name, as the saver writes them); `head_bytes` is the length of the
manifest's leading object up to its tensor list. Both files are ASCII (`json.dumps` escapes the
rest), so characters and bytes count alike.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mshpc.checkpoint.paths import fsync_dir
from mshpc.errors import CheckpointError, shown
from mshpc.regular_files import read_regular, write_own

FORMAT = "mshpc-checkpoint"
VERSION = 1
MANIFEST_FILE = "manifest.json"
INDEX_FILE = "manifest.index.json"
INDEX_FORMAT = "mshpc-checkpoint-index"


@dataclass(frozen=True)
class TensorEntry:
    name: str
    global_shape: tuple[int, ...]
    dtype: str
    file: str
    dataset: str
    start: int
    numel: int
    crc32: int
    offset: int | None = None  # byte offset of the dataset's data in `file`

    @property
    def stop(self) -> int:
        return self.start + self.numel


@dataclass(frozen=True)
class ManifestHead:
    """A manifest less its tensors: what a restore needs before any entry."""

    step: int
    config_hash: str
    layout: dict[str, int]
    extras: dict[str, Any] = field(default_factory=dict)
    created_unix: float = 0.0


@dataclass(frozen=True)
class Manifest:
    step: int
    config_hash: str
    layout: dict[str, int]
    tensors: tuple[TensorEntry, ...]
    extras: dict[str, Any] = field(default_factory=dict)
    created_unix: float = 0.0

    def by_name(self) -> dict[str, list[TensorEntry]]:
        return group_by_name(self.tensors)

    def head(self) -> ManifestHead:
        return ManifestHead(self.step, self.config_hash, self.layout, self.extras, self.created_unix)


def group_by_name(entries: tuple[TensorEntry, ...] | list[TensorEntry]) -> dict[str, list[TensorEntry]]:
    """Each name's entries, in the order given; names in order of first appearance."""
    out: dict[str, list[TensorEntry]] = {}
    for entry in entries:
        out.setdefault(entry.name, []).append(entry)
    return out


def grouped_by_name(entries: list[TensorEntry]) -> tuple[TensorEntry, ...]:
    """`entries` with each tensor's together (in the order given), names in order of first
    appearance: the order the saver writes, so that the index gives each name one byte range."""
    return tuple(e for same in group_by_name(entries).values() for e in same)


def to_json(m: Manifest) -> str:
    return render(m)[0]


def render(m: Manifest) -> tuple[str, dict[str, Any]]:
    """The manifest's text and its index. One line per tensor entry: readable with grep and head,
    and about 8x faster to write at 12,288 ranks (millions of entries) than `asdict` and
    `indent`, which copy and indent every field (benchmarks/scale/checkpoint_scale.py)."""
    head = json.dumps({"format": FORMAT, "version": VERSION, "step": m.step, "config_hash": m.config_hash,
                       "layout": m.layout, "created_unix": m.created_unix, "extras": m.extras})
    prefix = head[:-1] + ', "tensors": [\n'
    fields = [f.name for f in dataclasses.fields(TensorEntry)]
    lines = [json.dumps(dict(zip(fields, astuple_shallow(e), strict=True)), separators=(",", ":"))
             for e in m.tensors]
    text = prefix + ",\n".join(lines) + "\n]}\n"
    index = {"format": INDEX_FORMAT, "version": VERSION, "manifest_bytes": len(text), "head_bytes": len(head) - 1,
             "names": _runs(m.tensors, lines, len(prefix))}
    return text, index


def _runs(entries: tuple[TensorEntry, ...], lines: list[str], offset: int) -> dict[str, list[list[int]]]:
    """Each name's runs of consecutive entry lines as [byte offset, bytes, entries]; lines are
    joined by a comma and a newline, which a run's bytes leave out."""
    out: dict[str, list[list[int]]] = {}
    previous = None
    for e, line in zip(entries, lines, strict=True):
        if e.name == previous:
            run = out[e.name][-1]
            run[1] += 2 + len(line)
            run[2] += 1
        else:
            out.setdefault(e.name, []).append([offset, len(line), 1])
        previous = e.name
        offset += len(line) + 2
    return out


def astuple_shallow(e: TensorEntry) -> tuple[Any, ...]:
    return (e.name, e.global_shape, e.dtype, e.file, e.dataset, e.start, e.numel, e.crc32, e.offset)


def _write_synced(path: Path, text: str) -> None:
    write_own(path, text, sync=True)


def write_manifest(folder: Path, m: Manifest) -> None:
    """Write and fsync the index, then the manifest: the last file of a checkpoint, so its
    presence means complete."""
    text, index = render(m)
    _write_synced(folder / INDEX_FILE, json.dumps(index, separators=(",", ":")))
    _write_synced(folder / MANIFEST_FILE, text)


def replace_manifest(folder: Path, m: Manifest) -> None:
    """Replace a committed checkpoint's manifest atomically (a new file renamed over the old),
    so a crash leaves the old manifest or the new one, never half of one. The old index goes
    first: a crash before the new one is in place leaves a manifest without an index (read
    whole), never an index pointing into the wrong bytes."""
    text, index = render(m)
    (folder / INDEX_FILE).unlink(missing_ok=True)
    fsync_dir(folder)
    for name, content in ((MANIFEST_FILE, text), (INDEX_FILE, json.dumps(index, separators=(",", ":")))):
        tmp = folder / f".{name}.tmp"
        _write_synced(tmp, content)
        os.replace(tmp, folder / name)
        fsync_dir(folder)  # the rename itself


# What an entry may say. A manifest may come from elsewhere (a checkpoint someone else wrote): its
# file names are confined to the saver's own pattern, so no entry reaches outside its folder; its
# dataset is the tensor's own name; every number is bounded before anything is allocated for it.
SHARD_FILE = re.compile(r"shard-[0-9]{5,9}\.h5")  # saver.py's _shard_name(rank)
TENSOR_NAME = re.compile(r"[A-Za-z0-9_.@-]+(/[A-Za-z0-9_.@-]+)*")  # parameter names, '/'-joined
NAME_MAX = 512
ITEMSIZES = {"float32": 4, "float64": 8, "float16": 2, "bfloat16": 2, "int64": 8, "int32": 4, "uint8": 1, "bool": 1}
DIMS_MAX = 16
ELEMENTS_MAX = 2**48  # per tensor: 1 PiB of fp32, past any model here
OFFSET_MAX = 2**62
MANIFEST_MAX_BYTES = 2**32  # 428 MB at 12,288 ranks (catalog.py)
INDEX_MAX_BYTES = 2**30


def _count(raw: dict[str, Any], key: str, high: int) -> int:
    value = raw.get(key)
    if type(value) is not int or not 0 <= value <= high:
        raise CheckpointError(f"{key}={shown(value)} is not an integer in [0, {high}]")
    return value


def _check_name(name: Any) -> str:
    if type(name) is not str or len(name) > NAME_MAX or not TENSOR_NAME.fullmatch(name):
        raise CheckpointError(f"entry name={shown(name)}: not a tensor name ('/'-joined parts of letters, "
                              f"digits and _.@-, at most {NAME_MAX} characters)")
    return name


def entry_from_json(raw: Any) -> TensorEntry:
    """One manifest entry, checked: a one-line CheckpointError naming the entry and its bad field."""
    if not isinstance(raw, dict):
        raise CheckpointError(f"entry {shown(raw)}: not an object")
    name = _check_name(raw.get("name"))
    try:
        shape = raw.get("global_shape")
        if not isinstance(shape, list) or len(shape) > DIMS_MAX:
            raise CheckpointError(f"global_shape={shown(shape)} is not a list of at most {DIMS_MAX} sizes")
        dims = tuple(_count({"global_shape[]": d}, "global_shape[]", ELEMENTS_MAX) for d in shape)
        if math.prod(dims) > ELEMENTS_MAX:
            raise CheckpointError(f"global_shape={list(dims)} has more than {ELEMENTS_MAX} elements")
        dtype, file, dataset = raw.get("dtype"), raw.get("file"), raw.get("dataset")
        if type(dtype) is not str or dtype not in ITEMSIZES:
            raise CheckpointError(f"dtype={shown(dtype)} is not one of {', '.join(ITEMSIZES)}")
        if type(file) is not str or not SHARD_FILE.fullmatch(file):
            raise CheckpointError(f"file={shown(file)} is not a shard of this folder (shard-NNNNN.h5)")
        if dataset != name:
            raise CheckpointError(f"dataset={shown(dataset)} is not the tensor's own name")
        start, numel = _count(raw, "start", ELEMENTS_MAX), _count(raw, "numel", ELEMENTS_MAX)
        if start + numel > math.prod(dims):
            raise CheckpointError(f"elements [{start}, {start + numel}) lie outside its {math.prod(dims)}")
        offset = None if raw.get("offset") is None else _count(raw, "offset", OFFSET_MAX)
        return TensorEntry(name=name, global_shape=dims, dtype=dtype, file=file, dataset=dataset, start=start,
                           numel=numel, crc32=_count(raw, "crc32", 2**32 - 1), offset=offset)
    except CheckpointError as exc:
        raise CheckpointError(f"entry {name!r}: {exc}") from None


def read_manifest(folder: Path) -> Manifest:
    """Parse and check a manifest; any problem is a one-line CheckpointError naming the file."""
    return parse_manifest(folder, read_manifest_text(folder))


def read_manifest_text(folder: Path) -> str:
    path = folder / MANIFEST_FILE
    try:
        return read_regular(path, MANIFEST_MAX_BYTES).decode("ascii")
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing (an incomplete checkpoint)") from None
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{path}: unreadable ({exc})") from None


def parse_manifest(folder: Path, text: str) -> Manifest:
    """The manifest of `folder` from its text (read here or by another rank)."""
    path = folder / MANIFEST_FILE
    raw = parse_head_json(path, text)
    head = head_from_json(path, raw)
    if not isinstance(raw.get("tensors"), list):
        raise CheckpointError(f"{path}: malformed (no list of tensors)")
    try:
        tensors = tuple(entry_from_json(t) for t in raw["tensors"])
    except CheckpointError as exc:
        raise CheckpointError(f"{path}: malformed {exc}") from None
    m = Manifest(step=head.step, config_hash=head.config_hash, layout=head.layout, tensors=tensors,
                 extras=head.extras, created_unix=head.created_unix)
    check_tiling(m.by_name(), path)
    return m


def parse_head_json(path: Path, text: str) -> dict[str, Any]:
    """The manifest's JSON object (or its head alone), checked for format and version."""
    try:
        raw = json.loads(text)
    except (ValueError, RecursionError) as exc:  # RecursionError: nested past the parser's depth
        raise CheckpointError(f"{path}: unreadable ({type(exc).__name__}: {str(exc)[:200]})") from None
    if not isinstance(raw, dict) or raw.get("format") != FORMAT or raw.get("version") != VERSION:
        raise CheckpointError(f"{path}: not an {FORMAT} v{VERSION} manifest")
    return raw


def head_from_json(path: Path, raw: dict[str, Any]) -> ManifestHead:
    """The manifest's head, checked: a one-line CheckpointError naming the file and the field."""
    try:
        layout, extras, created = raw.get("layout"), raw.get("extras", {}), raw.get("created_unix", 0.0)
        if not isinstance(layout, dict) or len(layout) > DIMS_MAX:
            raise CheckpointError(f"layout={shown(layout)} is not an object of sizes")
        if not isinstance(extras, dict):
            raise CheckpointError(f"extras={shown(extras)} is not an object")
        if type(created) not in (int, float) or not math.isfinite(created):
            raise CheckpointError(f"created_unix={shown(created)} is not a time")
        config_hash = raw.get("config_hash")
        if type(config_hash) is not str or len(config_hash) > NAME_MAX:
            raise CheckpointError(f"config_hash={shown(config_hash)} is not a hash")
        return ManifestHead(step=_count(raw, "step", ELEMENTS_MAX), config_hash=config_hash,
                            layout={str(k): _count(layout, k, ELEMENTS_MAX) for k in layout},
                            extras=extras, created_unix=float(created))
    except CheckpointError as exc:
        raise CheckpointError(f"{path}: malformed head: {exc}") from None


def check_tiling(by_name: dict[str, list[TensorEntry]], path: Path) -> None:
    """Every tensor's slices must cover it exactly once, or a restore would read holes."""
    for name, entries in by_name.items():
        total = math.prod(entries[0].global_shape)
        covered = 0
        for e in sorted(entries, key=lambda e: e.start):
            if e.start != covered or (e.global_shape, e.dtype) != (entries[0].global_shape, entries[0].dtype):
                raise CheckpointError(f"{path}: tensor {name!r} slices overlap, leave a gap at {covered} "
                                      "or disagree on its shape or dtype")
            covered = e.stop
        if covered != total:
            raise CheckpointError(f"{path}: tensor {name!r} covers {covered} of {total} elements")
