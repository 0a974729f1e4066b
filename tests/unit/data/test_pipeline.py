"""Which loader a config gets, and why (the line a run logs)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from mshpc.config import DataConfig, load_config
from mshpc.data.pipeline import choose_loader
from mshpc.errors import ConfigError

MISSING = "DALI is not installed (No module named 'nvidia')"


def test_auto_takes_dali_where_it_is_installed_and_torch_otherwise() -> None:
    assert choose_loader(DataConfig(), missing=lambda: None) == ("dali", "data.loader=auto and DALI is installed")
    assert choose_loader(DataConfig(), missing=lambda: MISSING) == ("torch", f"data.loader=auto and {MISSING}")


def test_an_explicit_choice_is_kept_or_refused_with_the_reason() -> None:
    assert choose_loader(DataConfig(loader="torch"), missing=lambda: None) == ("torch", "data.loader=torch")
    assert choose_loader(DataConfig(loader="dali"), missing=lambda: None) == ("dali", "data.loader=dali")
    with pytest.raises(ConfigError, match=r"data.loader='dali' but DALI is not installed .*choose 'auto' or 'torch'"):
        choose_loader(DataConfig(loader="dali"), missing=lambda: MISSING)


def test_the_per_node_reader_uses_the_torch_reader_and_refuses_dali() -> None:
    name, why = choose_loader(DataConfig(per_node_reader=True), missing=lambda: None)
    assert name == "node" and "per_node_reader=true" in why
    with pytest.raises(ConfigError, match="does not combine with data.loader='dali'"):
        load_config(None, ["data.per_node_reader=true", "data.loader=dali"])


def test_the_fork_server_preloads_the_modules_a_dali_loader_imports() -> None:
    # a fresh process: this one may have imported DALI in another test
    code = ("import sys\nfrom mshpc.data.dali_source import dali_missing, preload_dali\n"
            "print(preload_dali(), dali_missing() is None, 'nvidia.dali.plugin.pytorch' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    loaded, installed, plugin = out.stdout.split()
    assert loaded == installed and plugin == installed, out.stderr[-2000:]
