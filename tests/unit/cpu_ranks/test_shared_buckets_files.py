"""The /dev/shm bucket buffers (issue #43, finding 10): a buffer never has a name, so a rank killed
right after making it leaves nothing behind (a 200 MB file stayed); a peer's buffer is mapped
only if it is the very file the peer announced, on this host, owned by this user, not merely
because something opened."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from support.other_user import needs_root, nobody_python

from mshpc.cpu_ranks import shared_buckets

MAKE = """
import json, os, sys, time
from mshpc.cpu_ranks import shared_buckets
fd = shared_buckets.create_unnamed({nbytes})
print(json.dumps(shared_buckets.identity(fd)), flush=True)
time.sleep(60)
"""


def names(folder: Path) -> set[str]:
    return {p.name for p in folder.iterdir()}


def test_a_rank_killed_after_making_its_buffer_leaves_nothing():
    before = names(shared_buckets.SHM_DIR)
    rank = subprocess.Popen([sys.executable, "-c", MAKE.format(nbytes=200 * 2**20)], stdout=subprocess.PIPE, text=True)
    who = json.loads(rank.stdout.readline())
    assert os.stat(f"/proc/{who['pid']}/fd/{who['fd']}").st_nlink == 0  # made without a name
    assert names(shared_buckets.SHM_DIR) - before == set()
    rank.send_signal(signal.SIGKILL)  # between creation and any peer's mapping
    rank.wait()
    assert names(shared_buckets.SHM_DIR) - before == set()


def test_a_buffer_maps_only_as_what_its_owner_announced():
    me = shared_buckets.identity(fd := shared_buckets.create_unnamed(4096))
    try:
        assert shared_buckets.map_peer(None, me, me, 4096) is not None  # through /proc, as a peer opens it
        for changed in ({"file": [me["file"][0], me["file"][1] + 1]}, {"boot": "another host"},
                        {"folder": [0, 0]}, {"fd": 999_999}):
            assert shared_buckets.map_peer(None, {**me, **changed}, me, 4096) is None, changed
    finally:
        os.close(fd)


@needs_root
def test_another_users_buffer_is_not_mapped():
    # before #43 "same host" meant "its file opens": another user's file, opened, was mapped
    other = nobody_python(MAKE.format(nbytes=4096))
    try:
        who = json.loads(other.stdout.readline())
        me = shared_buckets.identity(fd := shared_buckets.create_unnamed(4096))
        try:
            assert os.stat(f"/proc/{who['pid']}/fd/{who['fd']}").st_uid == 65534  # it opens (as root)
            assert shared_buckets.map_peer(None, who, me, 4096) is None
        finally:
            os.close(fd)
    finally:
        other.kill()
        other.wait()
