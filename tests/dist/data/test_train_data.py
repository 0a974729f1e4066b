"""The loaders inside real training runs (CLI, local launcher, 2 gloo ranks): the per-node reader
trains on exactly the ordinary loader's batches, and document masks reach the model."""

from __future__ import annotations

from pathlib import Path

import pytest

from support.cli_runner import mshpc, read_metrics, train_args
from support.token_data import make_random_dataset


def run(tmp_path: Path, cache: Path, name: str, *overrides: str) -> tuple[list[float], str]:
    out = mshpc(*train_args(tmp_path, cache, "train.steps=3", *overrides, name=name), "--nproc", "2")
    assert out.returncode == 0, out.stderr[-3000:]
    return [r["loss"] for r in read_metrics(tmp_path / name)], out.stderr


@pytest.mark.usefixtures("dali")
def test_per_node_reader_and_doc_masks_in_training(tmp_path: Path, corpus_cache: Path) -> None:
    data = f"data.path={make_random_dataset(tmp_path)}"  # short documents: windows cross them
    torch_doc, _ = run(tmp_path, corpus_cache, "torch", data, "data.loader=torch", "data.doc_mask=true")
    node_doc, node_log = run(tmp_path, corpus_cache, "node", data, "data.per_node_reader=true",
                             "data.doc_mask=true")
    auto, auto_log = run(tmp_path, corpus_cache, "auto", data, "data.loader=auto")
    assert "data loader: node (data.per_node_reader=true" in node_log
    assert "data loader: dali (data.loader=auto and DALI is installed)" in auto_log
    assert len(torch_doc) == 3 and node_doc == torch_doc  # the same batches, bit for bit
    assert auto != torch_doc  # the same batches (DALI) without masks: the masks changed the loss
