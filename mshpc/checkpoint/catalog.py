"""What a reader knows of one checkpoint: the manifest's head (step, layout, extras) and the
tensor entries by name.

With the manifest's index (manifest.py) a name's entries are parsed on first use, from the byte
ranges the index gives, so a restoring rank parses the entries of the tensors its dp group
holds and not the whole manifest: at 12,288 ranks the manifest is 428 MB of JSON, 24 s to parse
on every rank (benchmarks/scale/checkpoint_scale.py). A checkpoint without an index (an older
mshpc), or one whose index does not describe its manifest, is parsed whole, as before.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from mshpc.checkpoint.manifest import (
    INDEX_FILE,
    INDEX_FORMAT,
    INDEX_MAX_BYTES,
    MANIFEST_FILE,
    MANIFEST_MAX_BYTES,
    VERSION,
    Manifest,
    ManifestHead,
    TensorEntry,
    check_tiling,
    entry_from_json,
    head_from_json,
    parse_head_json,
    read_manifest,
)
from mshpc.errors import CheckpointError, shown
from mshpc.regular_files import open_regular, read_regular

log = logging.getLogger(__name__)

Run = tuple[int, int, int]  # a name's consecutive entry lines: byte offset, bytes, entries


class Catalog:
    """A checkpoint's head and entries. `bytes_parsed` counts the JSON this catalog parsed."""

    def __init__(self, folder: Path, head: ManifestHead, entries: dict[str, list[TensorEntry]],
                 runs: dict[str, list[Run]] | None = None, bytes_parsed: int = 0) -> None:
        self.folder = folder
        self.head = head
        self.bytes_parsed = bytes_parsed
        self._entries = entries  # parsed so far: every name's when there is no index
        self._runs = runs  # where each name's entries lie in the manifest; None: all parsed
        self._names = sorted(runs if runs is not None else entries)
        self._whole: Manifest | None = None  # the whole manifest, once parsed

    @staticmethod
    def whole(folder: Path, m: Manifest, bytes_parsed: int = 0) -> Catalog:
        """Every entry of `m`, parsed already."""
        catalog = Catalog(folder, m.head(), m.by_name(), bytes_parsed=bytes_parsed)
        catalog._whole = m
        return catalog

    @property
    def indexed(self) -> bool:
        return self._runs is not None

    def names(self) -> list[str]:
        return self._names

    def __contains__(self, name: str) -> bool:
        return name in (self._runs if self._runs is not None else self._entries)

    def entries(self, name: str) -> list[TensorEntry]:
        """Tensor `name`'s entries (a known name: see `in`)."""
        if name not in self._entries:
            self.load([name])
        return self._entries[name]

    def load(self, names: Iterable[str]) -> None:
        """Parse the entries of those of `names` not parsed yet, in one pass over the manifest
        (adjacent runs read together). An index that does not match the manifest is dropped
        with a warning, and the manifest is parsed whole."""
        if self._runs is None:
            return
        wanted = sorted({n for n in names if n in self._runs and n not in self._entries})
        if not wanted:
            return
        try:
            got = self._parse_runs(wanted)
        except CheckpointError as exc:
            log.warning("%s: %s; reading the whole manifest instead", self.folder / INDEX_FILE, exc)
            self._read_whole()
            return
        check_tiling(got, self.folder / MANIFEST_FILE)
        self._entries.update(got)

    def _parse_runs(self, names: list[str]) -> dict[str, list[TensorEntry]]:
        assert self._runs is not None
        runs = sorted(run for n in names for run in self._runs[n])
        if any(a[0] + a[1] > b[0] for a, b in zip(runs, runs[1:], strict=False)):  # no byte is read twice
            raise CheckpointError("its ranges overlap")
        got: dict[str, list[TensorEntry]] = {}
        try:
            fd = open_regular(self.folder / MANIFEST_FILE)
            try:
                texts = [(offset, os.pread(fd, nbytes, offset)) for offset, nbytes in _coalesce(runs)]
            finally:
                os.close(fd)
        except OSError as exc:
            raise CheckpointError(f"the manifest is unreadable ({exc})") from None
        for offset, text in texts:
            self.bytes_parsed += len(text)
            try:
                parsed = json.loads(b"[" + text + b"]")
            except (ValueError, RecursionError) as exc:
                raise CheckpointError(f"bytes {offset}-{offset + len(text)} of the manifest are no entries "
                                      f"({type(exc).__name__})") from None
            for e in map(entry_from_json, parsed):
                got.setdefault(e.name, []).append(e)
        counts = {n: sum(run[2] for run in self._runs[n]) for n in names}
        if set(got) != set(names) or any(len(got[n]) != counts[n] for n in names):
            raise CheckpointError("it does not match the manifest (another name or count in its ranges)")
        return got

    def _read_whole(self) -> None:
        m = read_manifest(self.folder)
        self.bytes_parsed += (self.folder / MANIFEST_FILE).stat().st_size
        self._entries, self._runs, self._whole = m.by_name(), None, m
        self._names = sorted(self._entries)

    def manifest(self) -> Manifest:
        """The whole manifest (every name parsed: for tools that read everything)."""
        if self._whole is not None:
            return self._whole
        self.load(self._names)
        if self._whole is not None:  # the index failed, the manifest was read whole
            return self._whole
        return Manifest(self.head.step, self.head.config_hash, self.head.layout,
                        tuple(e for n in self._names for e in self._entries[n]), self.head.extras,
                        self.head.created_unix)


def _coalesce(runs: list[Run]) -> list[tuple[int, int]]:
    """(offset, bytes) reads covering `runs` (sorted by offset); runs one separator apart (a
    comma and a newline) are read, and parsed, as one."""
    out: list[list[int]] = []
    for offset, nbytes, _ in runs:
        if out and offset == out[-1][0] + out[-1][1] + 2:
            out[-1][1] += 2 + nbytes
        else:
            out.append([offset, nbytes])
    return [(o, n) for o, n in out]


def open_catalog(folder: Path) -> Catalog:
    """The catalog of `folder`: from its index when it has a usable one, else its whole manifest.
    Raises a one-line CheckpointError naming the file on a missing or malformed manifest."""
    runs, head_bytes, manifest_bytes = _read_index(folder)
    if runs is None:
        m = read_manifest(folder)
        return Catalog.whole(folder, m, bytes_parsed=(folder / MANIFEST_FILE).stat().st_size)
    path = folder / MANIFEST_FILE
    try:
        fd = open_regular(path)
        try:
            size = os.fstat(fd).st_size
            text = os.pread(fd, head_bytes, 0) if size == manifest_bytes else b""  # head_bytes <= manifest_bytes
        finally:
            os.close(fd)
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing (an incomplete checkpoint)") from None
    except OSError as exc:
        raise CheckpointError(f"{path}: unreadable ({exc})") from None
    if size != manifest_bytes:
        log.warning("%s describes a manifest of %d bytes, not %d; reading the whole manifest", folder / INDEX_FILE,
                    manifest_bytes, size)
        return Catalog.whole(folder, read_manifest(folder), bytes_parsed=size)
    head = head_from_json(path, parse_head_json(path, text.decode("ascii", "replace") + "}"))
    return Catalog(folder, head, {}, runs, bytes_parsed=head_bytes + _index_bytes(folder))


def _index_bytes(folder: Path) -> int:
    return (folder / INDEX_FILE).stat().st_size


def _read_index(folder: Path) -> tuple[dict[str, list[Run]] | None, int, int]:
    """The index's runs by name, head bytes and manifest bytes; (None, 0, 0) when there is no
    usable index (an older checkpoint: not an error, the manifest is read whole). Every number is
    checked against the manifest's size before anything is read or allocated by it."""
    path = folder / INDEX_FILE
    try:
        raw: Any = json.loads(read_regular(path, INDEX_MAX_BYTES))
        if not isinstance(raw, dict) or raw.get("format") != INDEX_FORMAT or raw.get("version") != VERSION:
            raise ValueError(f"not an {INDEX_FORMAT} v{VERSION} file")
        manifest_bytes, head_bytes = raw["manifest_bytes"], raw["head_bytes"]
        if not (type(manifest_bytes) is int and 0 < manifest_bytes <= MANIFEST_MAX_BYTES
                and type(head_bytes) is int and 0 < head_bytes < manifest_bytes):
            raise ValueError(f"head_bytes={shown(head_bytes)} and manifest_bytes={shown(manifest_bytes)} are not "
                             f"sizes of a manifest (at most {MANIFEST_MAX_BYTES} bytes)")
        return {str(n): _runs(r, manifest_bytes) for n, r in raw["names"].items()}, head_bytes, manifest_bytes
    except FileNotFoundError:
        return None, 0, 0
    except (OSError, ValueError, KeyError, TypeError, AttributeError, RecursionError) as exc:
        log.warning("%s: unusable (%s); reading the whole manifest", path, str(exc)[:200])
        return None, 0, 0


def _runs(raw: Any, manifest_bytes: int) -> list[Run]:
    """A name's runs, each [offset, bytes, entries] of integers inside the manifest; ValueError otherwise."""
    runs = [(o, b, c) for o, b, c in raw]
    if not all(type(x) is int for run in runs for x in run) or not all(
            0 <= o and 0 < b and 0 < c and o + b <= manifest_bytes for o, b, c in runs):
        raise ValueError(f"runs {shown(raw)} lie outside the manifest's {manifest_bytes} bytes")
    return runs
