"""A child started with die_with_parent dies when its parent is killed with -9."""

import os
import subprocess
import sys
import time

# the parent starts a sleeping child that dies with it, prints the child's pid, then waits
PARENT = """
import subprocess, sys
from mshpc.launch.orphan_guard import die_with_parent
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], preexec_fn=die_with_parent())
print(child.pid, flush=True)
child.wait()
"""


def alive(pid: int) -> bool:
    """Running (a zombie, waiting only to be reaped, is not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_a_child_dies_with_its_parent_killed_by_sigkill():
    parent = subprocess.Popen([sys.executable, "-c", PARENT], stdout=subprocess.PIPE, text=True)
    child = int(parent.stdout.readline())
    assert alive(child)
    parent.kill()  # SIGKILL: no handler, no finally, runs in the parent
    parent.wait()
    try:
        deadline = time.monotonic() + 5
        while alive(child) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not alive(child), f"child {child} outlived its parent"
    finally:
        if alive(child):
            os.kill(child, 9)
