"""Blends (data.sources): Megatron's weighting as a pure function of the sample number, so shares
follow the weights and a resumed run reads exactly the windows an uninterrupted one reads."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from mshpc.config import DataConfig, SourceConfig, load_config
from mshpc.data.blend import BlendSampler, block_plan
from mshpc.data.pipeline import build_loader
from mshpc.data.prepare import PrepareOptions, prepare_corpus
from mshpc.data.sources import open_sources, source_paths
from mshpc.errors import ConfigError

WEIGHTS = [0.5, 0.3, 0.2]
SEQ, BATCH = 8, 4


def test_shares_over_10000_windows_are_within_1_percent_of_the_weights() -> None:
    sampler = BlendSampler([5_000, 800, 90], [5, 3, 2], SEQ, BATCH, seed=3)
    src = np.concatenate([sampler.source_windows(step, 0, 1)[0] for step in range(10_000 // BATCH)])
    shares = np.bincount(src, minlength=3) / len(src)
    assert np.all(np.abs(shares - WEIGHTS) < 0.01), shares
    # Megatron's greedy rule: any prefix of the plan is within one sample of each weight
    plan, _, counts = block_plan(WEIGHTS, 1000)
    for n in (1, 7, 100, 999):
        assert np.all(np.abs(np.bincount(plan[:n], minlength=3) - np.array(WEIGHTS) * n) <= 1)
    assert counts.tolist() == [500, 300, 200]


def test_each_source_walks_its_own_shuffled_epochs() -> None:
    sampler = BlendSampler([101, 41], [1, 1], 4, 2, seed=0)  # 25 and 10 windows
    got = {0: [], 1: []}
    for step in range(50):
        src, windows = sampler.source_windows(step, 0, 1)
        for d, w in zip(src.tolist(), windows.tolist(), strict=True):
            got[d].append(w)
    assert sorted(got[1][:10]) == list(range(10)) and sorted(got[1][10:20]) == list(range(10))
    assert sorted(got[0][:25]) == list(range(25)) and got[0][:25] != list(range(25))
    assert sampler.epochs(50) == pytest.approx([2.0, 5.0])


@pytest.fixture
def three_sources(tmp_path: Path) -> list[Path]:
    rng = np.random.default_rng(1)
    made = []
    for i, n_docs in enumerate((30, 12, 6)):
        root = tmp_path / f"in{i}"
        root.mkdir()
        for j in range(n_docs):
            (root / f"{j}.txt").write_bytes(bytes(rng.integers(97 + 8 * i, 105 + 8 * i, size=int(rng.integers(20, 90)),
                                                               dtype=np.uint8)))
        made.append(prepare_corpus([root], tmp_path / f"ds{i}", PrepareOptions(val_fraction=0.3)))
    return made


def test_a_resumed_blend_reads_the_windows_of_an_uninterrupted_one(three_sources: list[Path]) -> None:
    cfg = DataConfig(sources=tuple(SourceConfig(str(p), w) for p, w in zip(three_sources, WEIGHTS, strict=True)),
                     loader="torch", seed=5)
    data = open_sources(cfg, source_paths(cfg))
    with build_loader(cfg, data, SEQ, BATCH, 0, 1, 0) as loader:
        straight = [next(loader).tokens for _ in range(30)]
    with build_loader(cfg, open_sources(cfg, source_paths(cfg)), SEQ, BATCH, 0, 1, 0) as loader:
        first = [next(loader).tokens for _ in range(13)]
    with build_loader(cfg, open_sources(cfg, source_paths(cfg)), SEQ, BATCH, 0, 1, 13) as loader:
        rest = [next(loader).tokens for _ in range(17)]
    for a, b in zip(straight, first + rest, strict=True):
        assert np.array_equal(a.numpy(), b.numpy())
    # each source's letters tell where a window came from: all three are in the blend
    letters = np.concatenate([t.numpy().ravel() for t in straight])
    assert {(x - 97) // 8 for x in letters.tolist() if x != 256} == {0, 1, 2}
    val = open_sources(cfg, source_paths(cfg), "val")
    assert [s.path.name for s in val.sources] == ["val"] * 3


@pytest.mark.parametrize("override, message", [
    ("data.sources=[{path: a, weight: -0.5}]", r"data\.sources\[0\]\.weight=-0\.5 must be a finite number >= 0"),
    ("data.sources=[{path: a, weight: 0}, {path: b, weight: 0}]", r"data\.sources: every weight is 0"),
    ("data.sources=[{path: a, weight: .nan}]", r"data\.sources\[0\]\.weight=nan must be a finite number"),
])
def test_negative_or_all_zero_weights_are_one_line(override: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(None, [override])
