"""Hugging Face's weight files: `model.safetensors`, or above a size shards
`model-0000i-of-0000n.safetensors` with `model.safetensors.index.json` mapping each tensor to its
file (what save_pretrained writes). safetensors holds raw bytes and a JSON header: reading one
runs no code, unlike the pickled `pytorch_model.bin`, which mshpc never opens.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from mshpc.errors import InteropError, shown
from mshpc.interop.hf_names import HfTensors
from mshpc.regular_files import fd_path, open_regular, read_regular

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
DEFAULT_SHARD_BYTES = 2 * 10**9
# A weight file the index names: a plain name in the folder (never a path out of it)
WEIGHT_FILE = re.compile(r"[A-Za-z0-9_.-]+\.safetensors")
INDEX_MAX_BYTES = 64 * 2**20  # an index of a 405B model is ~100 kB  # transformers' own default max_shard_size is 5 GB; 2 GB eases uploads


def plan_shards(tensors: dict[str, torch.Tensor], max_shard_bytes: int) -> list[list[str]]:
    """Tensor names in files of at most `max_shard_bytes` each (a larger tensor alone), in order."""
    shards: list[list[str]] = [[]]
    size = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    return shards


def write_safetensors(out_dir: Path, tensors: dict[str, torch.Tensor], max_shard_bytes: int) -> list[str]:
    """Write `tensors` into `out_dir` as one file, or shards and their index when they exceed
    `max_shard_bytes`; return the files written."""
    shards = plan_shards(tensors, max_shard_bytes)
    if len(shards) == 1:
        save_file(tensors, str(out_dir / SINGLE), metadata={"format": "pt"})
        return [SINGLE]
    files = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    weight_map = {}
    for file, names in zip(files, shards, strict=True):
        save_file({n: tensors[n] for n in names}, str(out_dir / file), metadata={"format": "pt"})
        weight_map.update({n: file for n in names})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out_dir / INDEX).write_text(json.dumps(index, indent=2) + "\n")
    return [*files, INDEX]


def _weight_map(hf_dir: Path) -> dict[str, str] | None:
    """The index's tensor -> file map, None for a single file; an InteropError for neither, or for
    an index naming a file that is not a plain `.safetensors` name of this folder."""
    path = hf_dir / INDEX
    if path.is_file() or path.is_symlink():
        try:
            weight_map = json.loads(read_regular(path, INDEX_MAX_BYTES))["weight_map"]
        except (OSError, ValueError, KeyError, TypeError, RecursionError) as exc:
            raise InteropError(f"{path}: not a safetensors index ({type(exc).__name__}: {str(exc)[:200]})") from None
        if not isinstance(weight_map, dict) or not weight_map:
            raise InteropError(f"{path}: its weight_map is not an object of tensor names and files")
        for name, file in weight_map.items():
            if not isinstance(file, str) or not WEIGHT_FILE.fullmatch(file):
                raise InteropError(f"{path}: tensor {shown(name)} is in {shown(file)}, not a .safetensors file "
                                   "of this folder")
        return weight_map
    if (hf_dir / SINGLE).is_file():
        return None
    pickled = [p.name for p in hf_dir.glob("*.bin")]
    extra = f" ({', '.join(pickled)} is pickled: mshpc does not load pickles)" if pickled else ""
    raise InteropError(f"{hf_dir}: has neither {SINGLE} nor {INDEX}{extra}")


def _open(stack: ExitStack, path: Path) -> Any:
    """safe_open of the regular file `path`, opened without following a link (safe_open takes a
    path: it is given the checked descriptor's)."""
    try:
        fd = open_regular(path)
        stack.callback(os.close, fd)
        return stack.enter_context(safe_open(fd_path(fd), framework="pt"))
    except (OSError, SafetensorError) as exc:
        raise InteropError(f"{path}: not a readable safetensors file ({exc})") from None


@contextmanager
def read_safetensors(hf_dir: Path) -> Iterator[HfTensors]:
    """The tensors of the Hugging Face folder `hf_dir`, each read when taken; files stay open
    until the block ends."""
    indexed = _weight_map(hf_dir)
    with ExitStack() as stack:
        handles = {file: _open(stack, hf_dir / file)
                   for file in sorted(set(indexed.values()) if indexed is not None else {SINGLE})}
        weight_map = indexed if indexed is not None else {n: SINGLE for n in handles[SINGLE].keys()}
        try:
            shapes = {n: tuple(handles[f].get_slice(n).get_shape()) for n, f in weight_map.items()}
        except SafetensorError as exc:
            raise InteropError(f"{hf_dir}: its index names a tensor its files lack ({exc})") from None
        yield HfTensors(set(weight_map), lambda n: handles[weight_map[n]].get_tensor(n), str(hf_dir), shapes)
