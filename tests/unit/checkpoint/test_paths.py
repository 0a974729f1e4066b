import os

from mshpc.checkpoint.paths import committed_steps, latest_step, prune, publish, remove_stale_tmp, tmp_dir
from mshpc.checkpoint.restore import candidates


def make(root, step):
    tmp_dir(root, step).mkdir(parents=True)
    (tmp_dir(root, step) / "manifest.json").write_text("{}")
    return publish(root, step)


def test_publish_latest_prune_and_candidates(tmp_path):
    for step in (10, 20, 30):
        make(tmp_path, step)
    assert latest_step(tmp_path) == 30 and os.readlink(tmp_path / "latest") == "step-0000030"
    assert prune(tmp_path, keep=2) == [10]
    assert committed_steps(tmp_path) == [20, 30]
    tmp_dir(tmp_path, 40).mkdir()  # a save that crashed before its commit
    assert committed_steps(tmp_path) == [20, 30]
    assert [p.name for p in candidates(tmp_path)] == ["step-0000030", "step-0000020"]
    remove_stale_tmp(tmp_path)
    assert not tmp_dir(tmp_path, 40).exists()
