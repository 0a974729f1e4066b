"""Small real corpora and prepared datasets shared by the data tests."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from mshpc.data.prepare import prepare_corpus
from mshpc.data.shards import TokenDataset

# In the order prepare walks them: a folder's files (sorted) before its subfolders.
_DOCS = {
    "a.txt": "hello world\n".encode(),
    "c.py": "def f(x):\n    return x + 1\n".encode(),
    "sub/b.md": "# naïve ünïcode — ok\n".encode(),
}


@pytest.fixture
def corpus_docs() -> list[bytes]:
    """The documents of `corpus`, in the order prepare reads them."""
    return list(_DOCS.values())


@pytest.fixture
def corpus(tmp_path: Path) -> Path:
    """A folder of three text documents plus files prepare must skip."""
    root = tmp_path / "corpus"
    for name, data in _DOCS.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(data)
    (root / "sub" / "image.bin").write_bytes(bytes(range(256)))  # suffix not taken
    (root / "sub" / "nul.txt").write_bytes(b"text\x00with a NUL")  # binary despite its suffix
    (root / "sub" / "latin1.txt").write_bytes("café".encode("latin-1"))  # not UTF-8
    (root / "__pycache__").mkdir()
    (root / "__pycache__" / "skip.py").write_text("skipped = True\n")
    return root


@pytest.fixture
def random_dataset(tmp_path: Path) -> TokenDataset:
    """A ~6k-token dataset of 20 random-length documents in shards of 1000 tokens."""
    rng = np.random.default_rng(0)
    root = tmp_path / "random"
    root.mkdir()
    for i in range(20):
        text = rng.integers(ord("a"), ord("z") + 1, size=int(rng.integers(50, 550)), dtype=np.uint8)
        (root / f"doc{i:02d}.txt").write_bytes(text.tobytes())
    return TokenDataset.open(prepare_corpus([root], tmp_path / "ds", shard_tokens=1000))
