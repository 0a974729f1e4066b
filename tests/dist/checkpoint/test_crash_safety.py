"""Whatever breaks during or after a save, resume uses the last good checkpoint and says why."""

import os
import queue
import shutil
import subprocess
import sys
import threading

import h5py
import numpy as np
import pytest
from support.ckpt_runs import CKPT, final_params, losses, run
from support.cli_runner import REPO, mshpc, read_metrics, train_args
from support.tmpfs import mounted_tmpfs

from mshpc.bench.disk_fill import fill


def assert_same_final_model(a_root, b_root):
    want, got = final_params(a_root), final_params(b_root)
    assert want.keys() == got.keys()
    for name in want:
        assert np.array_equal(want[name], got[name]), name


def copy_run(straight, tmp_path, name):
    shutil.copytree(straight / "straight", tmp_path / name, symlinks=True)
    return tmp_path / name / "checkpoints"


def test_kill_during_stage_2_leaves_the_previous_checkpoint(straight, tmp_path, corpus_cache):
    run(tmp_path, corpus_cache, "k", faults="kill_in_save:rank=0:step=8", expect=137)
    root = tmp_path / "k" / "checkpoints"
    assert os.readlink(root / "latest") == "step-0000004"
    assert (root / "step-0000008.tmp").is_dir()  # shards written, never committed
    out = run(tmp_path, corpus_cache, "k")
    assert "resumed from step 4" in out.stderr
    assert not (root / "step-0000008.tmp").exists()
    assert_same_final_model(straight / "straight" / "checkpoints", root)
    assert losses(tmp_path, "k") == losses(straight, "straight")


def test_truncated_shard_falls_back_and_names_the_file(straight, tmp_path, corpus_cache):
    root = copy_run(straight, tmp_path, "t")
    shard = root / "step-0000008" / "shard-00000.h5"
    with open(shard, "r+b") as f:
        f.truncate(os.path.getsize(shard) // 2)
    out = run(tmp_path, corpus_cache, "t")
    assert "step-0000008 is damaged or incomplete, trying an older one" in out.stderr
    assert "shard-00000.h5" in out.stderr
    assert "resumed from step 4" in out.stderr
    assert_same_final_model(straight / "straight" / "checkpoints", root)


def test_flipped_byte_falls_back_and_names_tensor_and_file(straight, tmp_path, corpus_cache):
    root = copy_run(straight, tmp_path, "f")
    shard = root / "step-0000008" / "shard-00000.h5"
    with h5py.File(shard, "r") as f:
        # a master-weight shard: what resume reads (model/ is written for inference only)
        name = next(n for n in f["master"] if f["master"][n].size * 4 >= 64 * 1024)
        offset = f["master"][name].id.get_offset()
    with open(shard, "r+b") as f:
        f.seek(offset + 10)
        byte = f.read(1)
        f.seek(offset + 10)
        f.write(bytes([byte[0] ^ 0x01]))
    verify = mshpc("ckpt", "verify", str(root))
    assert verify.returncode == 1
    assert f"shard-00000.h5:master/{name}: checksum mismatch" in verify.stderr
    out = run(tmp_path, corpus_cache, "f")
    assert f"checksum mismatch for tensor 'master/{name}'" in out.stderr
    assert "resumed from step 4" in out.stderr
    assert_same_final_model(straight / "straight" / "checkpoints", root)


@pytest.fixture
def small_tmpfs(tmp_path):
    """A 2.5 MiB tmpfs: room for one checkpoint of the test model (two 0.95 MiB shards), not two,
    whichever rank writes first: a shard's write asks for 1.1 MiB free before it starts, so 2 MiB
    failed step 4 too when one rank's shard landed before the other rank asked."""
    with mounted_tmpfs(tmp_path / "full", "2560k") as mnt:
        yield mnt


def _full_disk_ends_the_run_at_its_last_save(tmp_path, cache, mnt, *overrides):
    out = run(tmp_path, cache, "d", f"checkpoint.dir={mnt}", *overrides, expect=2)
    last = out.stderr.strip().splitlines()[-1]
    assert "CheckpointError: checkpoint of step 8 failed" in last and "No space left on device" in last
    assert os.readlink(mnt / "latest") == "step-0000004"
    assert len(losses(tmp_path, "d")) == 8  # what was trained and logged before the failure is kept
    return last


def test_full_disk_fails_the_save_and_keeps_the_last_good_one(small_tmpfs, tmp_path, corpus_cache):
    _full_disk_ends_the_run_at_its_last_save(tmp_path, corpus_cache, small_tmpfs)
    # the disk is still full: resume and train on without saving
    out = run(tmp_path, corpus_cache, "d", f"checkpoint.dir={small_tmpfs}", "train.steps=6", "checkpoint.interval_steps=0")
    assert "resumed from step 4" in out.stderr
    assert [r["step"] for r in read_metrics(tmp_path / "d")] == [1, 2, 3, 4, 5, 6]


def test_full_disk_at_the_last_save_ends_the_run_with_recovery_in_place_too(small_tmpfs, tmp_path, corpus_cache):
    # recovery in place skips only a periodic save that finds the disk full (tests/faults/test_in_place.py);
    # step 8 is the run's last, whose save must succeed: it waits for space up to the grace, then fails
    last = _full_disk_ends_the_run_at_its_last_save(tmp_path, corpus_cache, small_tmpfs, "recovery.in_place=true",
                                                    "recovery.full_disk_grace_s=2")
    assert "still full after 2 s of recovery.full_disk_grace_s" in last


def test_the_last_save_waits_for_space_with_recovery_in_place(tmp_path, corpus_cache):
    """A disk full at the last step's save, freed while the save waits: the run ends at step 8
    with that checkpoint committed, not with an error (its in-memory state would be gone)."""
    with mounted_tmpfs(tmp_path / "full", "8m") as mnt:
        filler = fill(mnt)  # every byte taken before the run: its only save, the last step's, finds none
        args = train_args(tmp_path, corpus_cache, *CKPT, "checkpoint.interval_steps=8", f"checkpoint.dir={mnt}",
                          "recovery.in_place=true", "recovery.full_disk_grace_s=120", name="w")
        proc = subprocess.Popen([sys.executable, "-m", "mshpc", *args, "--nproc", "2"], cwd=REPO, text=True,
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=lambda: [lines.put(line) for line in proc.stderr], daemon=True).start()
        seen: list[str] = []
        try:
            while not seen or "the save must succeed: trying again" not in seen[-1]:
                seen.append(lines.get(timeout=120))
            assert not (mnt / "latest").exists()  # step 8's save is waiting
            filler.unlink()  # the operator frees space
            assert proc.wait(timeout=120) == 0, "".join(seen)
        finally:
            proc.kill()
        assert os.readlink(mnt / "latest") == "step-0000008"
    assert len(losses(tmp_path, "w")) == 8
