"""A small real dataset and loader checks, shared by the single-process and multi-rank data tests."""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np

from mshpc.data.loader import BatchLoader
from mshpc.data.prepare import PrepareOptions, prepare_corpus
from mshpc.data.shared_ring import MEMFD_NAME


def make_random_dataset(tmp_path: Path, val_fraction: float = 0.0) -> Path:
    """A ~6k-token dataset of 20 random-length documents in shards of 1000 tokens, `val_fraction`
    of them held out in its val/ split; its folder."""
    rng = np.random.default_rng(0)
    root = tmp_path / "random"
    root.mkdir()
    for i in range(20):
        text = rng.integers(ord("a"), ord("z") + 1, size=int(rng.integers(50, 550)), dtype=np.uint8)
        (root / f"doc{i:02d}.txt").write_bytes(text.tobytes())
    return prepare_corpus([root], tmp_path / "ds", PrepareOptions(shard_tokens=1000, val_fraction=val_fraction))


def wait_until_full(loader: BatchLoader, depth: int, timeout_s: float = 120.0) -> None:
    """Return once `depth` batches are ready: a step that ends here is slower than the loader."""
    deadline = time.monotonic() + timeout_s
    while loader.ready() < depth:
        assert time.monotonic() < deadline, f"loader never filled {depth} slots"
        time.sleep(0.005)


def holds_shared_ring() -> bool:
    """Whether this process still maps, or holds a descriptor of, a batch ring's memory."""
    if f"memfd:{MEMFD_NAME}" in Path("/proc/self/maps").read_text():
        return True
    fds = Path("/proc/self/fd")
    for fd in os.listdir(fds):
        try:
            if MEMFD_NAME in os.readlink(fds / fd):
                return True
        except OSError:  # the descriptor listing itself, closed meanwhile
            continue
    return False
