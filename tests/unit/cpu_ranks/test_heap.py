"""keep_freed_host_memory: a step's freed buffers are reused, not handed back to the OS and
page-faulted in again. Each case runs in a fresh interpreter: the setting is process-wide."""

import os
import platform
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's mallopt")

# A step's pattern: many sub-128 KiB tensors (under glibc's mmap threshold, so on the heap),
# all freed together, then allocated again. Prints whether the setting applied, then the minor
# faults of the measured rounds. `glibc` pins glibc's own starting thresholds (128 KiB): left
# adaptive, they move with whatever the interpreter happened to free while importing torch.
CHURN = """
import ctypes, resource, sys, torch
from mshpc.cpu_ranks.heap import (M_MMAP_THRESHOLD, M_TRIM_THRESHOLD, freed_host_memory_kept,
                                   keep_freed_host_memory)
if sys.argv[1] == "glibc":
    for option in (M_MMAP_THRESHOLD, M_TRIM_THRESHOLD):
        ctypes.CDLL(None).mallopt(option, 128 * 1024)
else:
    assert keep_freed_host_memory() == freed_host_memory_kept()
    print(freed_host_memory_kept())
def churn():
    tensors = [torch.ones(25_000) for _ in range(160)]  # 100 kB each, 16 MB in all
    del tensors
for _ in range(3):
    churn()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(10):
    churn()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _run(mode: str, env: dict[str, str] | None = None) -> list[str]:
    done = subprocess.run(
        [sys.executable, "-c", CHURN, mode],
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.split()


def test_freed_heap_memory_is_reused_without_page_faults():
    applied, faults = _run("keep")
    assert applied == "True"
    assert int(faults) < 100  # 10 rounds of 16 MB: about 39,000 pages if trimmed each time


def test_at_glibcs_own_thresholds_the_same_pattern_faults_every_round():
    (faults,) = _run("glibc")
    # 2,850-35,000 over 16 runs: how much of the 16 MB lies at the heap's top, and so is
    # trimmed each round, depends on what the interpreter's start left above it
    assert int(faults) > 1_000


def test_the_users_own_allocator_tuning_is_left_alone():
    applied, _ = _run("keep", {"GLIBC_TUNABLES": "glibc.malloc.check=0"})
    assert applied == "False"


def test_an_env_threshold_is_the_users_choice(monkeypatch):
    from mshpc.cpu_ranks.heap import user_tuned_allocator

    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "1048576")
    assert user_tuned_allocator() == "MALLOC_MMAP_THRESHOLD_ is set"
    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_")
    monkeypatch.setenv("LD_PRELOAD", "/usr/lib/libjemalloc.so.2")
    assert user_tuned_allocator() == "another allocator is preloaded"
