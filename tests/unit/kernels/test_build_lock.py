"""A kernel build killed mid-way leaves cpp_extension's `lock` file; the next build must clear it
and proceed, not wait on it forever, and must never clear the lock of a builder still alive."""

import subprocess
import sys
import threading
from pathlib import Path

import pytest
from unit.kernels.test_library_cache import load_as_a_new_process, probe_recipe, probe_value, write_probe

from mshpc.kernels import build
from mshpc.kernels.build_lock import BATON, exclusive_build

# A builder as cpp_extension runs one under build._compile: our flock, then torch's baton.
BUILDER = """
import sys, time
from pathlib import Path
from torch.utils.file_baton import FileBaton
from mshpc.kernels.build_lock import exclusive_build
folder = Path(sys.argv[1])
with exclusive_build(folder):
    baton = FileBaton(str(folder / "lock"))
    assert baton.try_acquire()
    print("building", flush=True)
    sys.stdin.readline()  # until the test says finish (or kills this builder)
    baton.release()
"""


def start_builder(folder: Path) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", BUILDER, str(folder)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline() == "building\n"
    return proc


@pytest.mark.timeout(120)  # before the fix, the build below waited on the dead builder's lock forever
def test_a_build_after_a_builder_killed_mid_way_clears_its_lock_and_builds(tmp_path: Path) -> None:
    write_probe(tmp_path, 7)
    recipe = probe_recipe(tmp_path)
    folder = build.build_dir(recipe)
    folder.mkdir(parents=True)
    builder = start_builder(folder)
    builder.kill()  # SIGKILL: no finally runs, the baton stays
    builder.wait()
    assert (folder / BATON).exists()

    library, kept = load_as_a_new_process(recipe)
    assert not kept and probe_value(library) == 7
    assert not (folder / BATON).exists()


def test_a_live_builders_lock_is_waited_for_not_cleared(tmp_path: Path) -> None:
    builder = start_builder(tmp_path)
    entered = threading.Event()

    def second_builder() -> None:
        with exclusive_build(tmp_path):
            entered.set()
    waiter = threading.Thread(target=second_builder, daemon=True)
    waiter.start()
    assert not entered.wait(0.5)  # still building: the second waits
    assert (tmp_path / BATON).exists()

    builder.communicate("finish\n", timeout=60)
    assert builder.returncode == 0
    assert entered.wait(60)  # released at the first builder's end, its baton removed by its owner
    waiter.join(60)
    assert not (tmp_path / BATON).exists()
