"""Hugging Face's weight files: `model.safetensors`, or above a size shards
`model-0000i-of-0000n.safetensors` with `model.safetensors.index.json` mapping each tensor to its
file (what save_pretrained writes). safetensors holds raw bytes and a JSON header: reading one
runs no code, unlike the pickled `pytorch_model.bin`, which mshpc never opens.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from mshpc.errors import InteropError
from mshpc.interop.hf_names import HfTensors

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
DEFAULT_SHARD_BYTES = 2 * 10**9  # transformers' own default max_shard_size is 5 GB; 2 GB eases uploads


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
    """The index's tensor -> file map, None for a single file; an InteropError for neither."""
    if (hf_dir / INDEX).is_file():
        try:
            return dict(json.loads((hf_dir / INDEX).read_text())["weight_map"])
        except (ValueError, KeyError, TypeError) as exc:
            raise InteropError(f"{hf_dir / INDEX}: not a safetensors index ({exc})") from None
    if (hf_dir / SINGLE).is_file():
        return None
    pickled = [p.name for p in hf_dir.glob("*.bin")]
    extra = f" ({', '.join(pickled)} is pickled: mshpc does not load pickles)" if pickled else ""
    raise InteropError(f"{hf_dir}: has neither {SINGLE} nor {INDEX}{extra}")


@contextmanager
def read_safetensors(hf_dir: Path) -> Iterator[HfTensors]:
    """The tensors of the Hugging Face folder `hf_dir`, each read when taken; files stay open
    until the block ends."""
    indexed = _weight_map(hf_dir)
    with ExitStack() as stack:
        handles = {}
        for file in sorted(set(indexed.values()) if indexed is not None else {SINGLE}):
            try:
                handles[file] = stack.enter_context(safe_open(str(hf_dir / file), framework="pt"))
            except (OSError, SafetensorError) as exc:
                raise InteropError(f"{hf_dir / file}: not a readable safetensors file ({exc})") from None
        weight_map = indexed if indexed is not None else {n: SINGLE for n in handles[SINGLE].keys()}
        yield HfTensors(set(weight_map), lambda n: handles[weight_map[n]].get_tensor(n), str(hf_dir))
