"""The run directory's files on a shared file system (issue #43, finding 9): a link another user
planted where the run writes (the lock, events, metrics, the watch and timings files, the config,
the requeue guard's files) is not followed, and a file another user put there is not written
into: one line (exit 2, not retried), and whatever the name pointed at is unchanged."""

import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest
from support.other_user import NOBODY, as_nobody, needs_root

from mshpc.config import Config, dump_yaml
from mshpc.diagnose.timings import TimingsWriter
from mshpc.diagnose.watch_stream import StreamWriter, stream_file
from mshpc.errors import MshpcError
from mshpc.events import append_event
from mshpc.launch.requeue import mark_finished
from mshpc.run_dir import MetricsLog, create_run_dir
from mshpc.run_lock import acquire_run_lock

PRIVATE = b"# the runner's private file\n" * 20

WRITERS = {  # a run-directory file, and what writes it
    "metrics.jsonl": lambda d: MetricsLog(d / "metrics.jsonl", 0).close(),
    "events.jsonl": lambda d: append_event(d, "supervisor_start"),
    ".lock": lambda d: acquire_run_lock(d).release(),
    "config.yaml": lambda d: create_run_dir(d, dump_yaml(Config())).close(),
    "timings/rank-0.jsonl": lambda d: TimingsWriter(d / "timings" / "rank-0.jsonl", {"rank": 0}, 1.0).close(),
    "watch/ranks-00000.bin": lambda d: StreamWriter(d, 0, {"rank": 0}, 0, 8),
    "FINISHED": lambda d: mark_finished(d, "job", 3),
}


@pytest.fixture
def shared():
    """A run directory in a folder every user may write (a shared project folder; not sticky, where
    the kernel's protected_symlinks and protected_regular refuse most of this on their own), and
    a private file of the runner's outside it. Under /tmp, not pytest's private tmp_path: the
    other user must reach it."""
    tmp_path = Path(tempfile.mkdtemp(prefix="mshpc-shared-"))
    os.chmod(tmp_path, 0o755)
    private = tmp_path / "private"
    private.write_bytes(PRIVATE)
    os.chmod(private, 0o600)
    run = tmp_path / "runs" / "r"
    run.mkdir(parents=True)
    for folder in (run.parent, run):
        os.chmod(folder, 0o777)
    for sub in ("timings", "watch"):
        (run / sub).mkdir(mode=0o777)
        os.chmod(run / sub, 0o777)
    yield run, private
    shutil.rmtree(tmp_path)


@pytest.mark.parametrize("name", list(WRITERS))
def test_a_planted_link_is_not_followed(shared, name):
    run, private = shared
    (run / name).symlink_to(private)
    assert stream_file(run, 0, 8) == run / "watch/ranks-00000.bin"
    with pytest.raises(MshpcError) as err:
        WRITERS[name](run)
    assert "\n" not in str(err.value) and "a symbolic link (not followed)" in str(err.value)
    assert private.read_bytes() == PRIVATE


@needs_root
@pytest.mark.parametrize("name", list(WRITERS))
def test_another_users_link_or_file_is_not_written(shared, name):
    run, private = shared
    # the case: another user's link, planted in a folder it may write, to the runner's file
    subprocess.run(as_nobody("ln", "-s", str(private), str(run / name)), check=True)
    with pytest.raises(MshpcError, match="a symbolic link"):
        WRITERS[name](run)
    assert private.read_bytes() == PRIVATE
    os.unlink(run / name)
    # or a plain file of its own, open to all, which the run would write its records into
    subprocess.run(as_nobody("sh", "-c", f"printf planted > '{run / name}'; chmod 666 '{run / name}'"), check=True)
    with pytest.raises(MshpcError, match=f"owned by uid {NOBODY}, not this user"):
        WRITERS[name](run)
    assert (run / name).read_bytes() == b"planted"


def test_a_hard_link_to_a_file_elsewhere_is_not_written(shared):
    run, private = shared
    os.link(private, run / "metrics.jsonl")  # where fs.protected_hardlinks is off, anyone may make one
    with pytest.raises(MshpcError, match="has 2 hard links"):
        WRITERS["metrics.jsonl"](run)
    assert private.read_bytes() == PRIVATE


def test_the_run_directorys_own_files_are_written_as_before(tmp_path):
    run = tmp_path / "r"
    run.mkdir()
    for name, write in WRITERS.items():
        write(run)
        write(run)  # again: its own file, reopened
        assert (run / name).is_file() and not (run / name).is_symlink(), name
