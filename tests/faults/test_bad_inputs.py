"""A full disk outside a save, through the real CLI on a real full file system (a tmpfs): it is
the site's environment, not the node's, so the run stops at once with one line naming the file
and the free space, exit 2, and nothing is retried, blamed or evicted."""

import os
import re
import subprocess

import pytest

from support.cli_runner import mshpc, read_metrics, train_args
from support.fault_runs import events, kinds, one, supervised

TMPFS_SIZE = "64k"


def _fill(mnt, leave_bytes: int = 0) -> None:
    """Fill the file system at `mnt` to the last page, then give back `leave_bytes` (whole pages)."""
    filler = mnt / "filler"
    with open(filler, "wb", buffering=0) as f:  # unbuffered: nothing left to fail again at close
        try:
            while True:
                f.write(b"\0" * 4096)
        except OSError:
            pass
    os.truncate(filler, max(0, os.path.getsize(filler) - leave_bytes))


@pytest.fixture
def tmpfs(tmp_path):
    """A small tmpfs of our own: a real ENOSPC from the kernel, with no other writer on it."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={TMPFS_SIZE}", "tmpfs", str(mnt)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        if os.environ.get("CI") == "true":
            pytest.fail(f"cannot mount a tmpfs in CI: {mounted.stderr.strip()}")
        pytest.skip(f"cannot mount a tmpfs (needs root): {mounted.stderr.strip()}")
    yield mnt
    subprocess.run(["umount", str(mnt)], check=False)


def test_a_full_disk_for_the_metrics_is_an_environment_error_not_a_node_fault(tmp_path, tmpfs, corpus_cache):
    # only metrics.jsonl lives on the full file system, so the supervisor's events tell the story;
    # bound there as a file (a link would be refused: the run writes through none, docs/security.md)
    run_dir = tmp_path / "m"
    run_dir.mkdir()
    for path in (tmpfs / "metrics.jsonl", run_dir / "metrics.jsonl"):
        path.touch()
    subprocess.run(["mount", "--bind", str(tmpfs / "metrics.jsonl"), str(run_dir / "metrics.jsonl")], check=True)
    try:
        _fill(tmpfs)
        out = supervised(tmp_path, corpus_cache, "m", "train.steps=4", "checkpoint.interval_steps=0")
    finally:
        subprocess.run(["umount", str(run_dir / "metrics.jsonl")], check=False)
    last = out.stderr.strip().splitlines()[-1]
    assert out.returncode == 2, out.stderr[-3000:]
    assert re.fullmatch(r"mshpc: rank 0 exited with code 2: RunEnvironmentError: cannot write \S+/m/metrics\.jsonl: "
                        r"no space left on its file system \(0 B free of 64\.0 KiB\); .*", last), last
    evs = events(run_dir)
    assert one(evs, "classified")["fault_class"] == "environment" and one(evs, "classified")["blame"] == []
    assert "restart" not in kinds(evs) and "evicted" not in kinds(evs), kinds(evs)
    assert (one(evs, "run_end")["exit_code"], one(evs, "run_end")["failures"]) == (2, 1)


def test_a_full_disk_under_the_timings_thread_stops_the_loop_with_one_line(tmp_path, tmpfs, corpus_cache):
    # one page left: the header and the first steps fit, so the disk fills under the writer's
    # thread mid-run (not in the loop's own thread, where the file is opened)
    run_dir = tmp_path / "t"
    run_dir.mkdir()
    (tmpfs / "timings").mkdir()
    (run_dir / "timings").symlink_to(tmpfs / "timings")
    _fill(tmpfs, leave_bytes=4096)
    args = train_args(tmp_path, corpus_cache, "train.steps=60", "checkpoint.interval_steps=0",
                      "diagnose.flush_interval_s=0", name="t")
    out = mshpc(*args, "--nproc", "1", timeout_s=300)
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2, out.stderr[-3000:]
    assert re.fullmatch(r"mshpc: error: RunEnvironmentError: cannot write \S+/t/timings/rank-00000\.jsonl: "
                        r"no space left on its file system \(0 B free of 64\.0 KiB\); .*", lines[-1]), lines[-1]
    assert "Traceback" not in out.stderr, out.stderr[-3000:]
    assert '{"step"' in (tmpfs / "timings/rank-00000.jsonl").read_text()  # it filled up mid-run ...
    assert 0 < len(read_metrics(run_dir)) < 60  # ... and the loop stopped there, not at the end
