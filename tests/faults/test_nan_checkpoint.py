"""A checkpoint whose state is NaN (issue #43, finding 6): `ckpt verify` rejects it, and a resume
skips it for the good checkpoint before it, in the first attempt, rather than resuming from it
and diverging again in every attempt."""

import json
import shutil
import zlib

import h5py
import numpy as np
from support.ckpt_runs import final_params
from support.cli_runner import mshpc
from support.fault_runs import events, kinds, one, supervised

MASTER = "master/layers.0.mlp.fc.weight"


def poison(ckpt):
    """Make `MASTER`'s first slice NaN with a checksum that matches it, as a run that saved its
    diverged weights (or someone crafting a checkpoint) would leave it: every check before #43 passed."""
    manifest = json.loads((ckpt / "manifest.json").read_text())
    entry = next(e for e in manifest["tensors"] if e["name"] == MASTER)
    with h5py.File(ckpt / entry["file"], "r+") as f:
        f[entry["dataset"]][...] = np.nan
        entry["crc32"] = zlib.crc32(f[entry["dataset"]][()].tobytes())
    (ckpt / "manifest.json").write_text(json.dumps(manifest))


def test_a_nan_checkpoint_is_refused_and_the_good_one_before_is_resumed(reference_run, tmp_path, corpus_cache):
    run = tmp_path / "n"
    shutil.copytree(reference_run, run, symlinks=True)  # finished at step 8; checkpoints of steps 2, 4, 6 and 8
    poison(run / "checkpoints" / "step-0000008")
    verified = mshpc("ckpt", "verify", str(run / "checkpoints"))
    assert verified.returncode == 1 and "holds NaN or Inf values" in verified.stdout + verified.stderr
    out = supervised(tmp_path, corpus_cache, "n")  # train.steps=8 again: resume, and train what is missing
    assert out.returncode == 0, out.stderr[-3000:]
    assert "step-0000008 is damaged or incomplete, trying an older one" in out.stderr and "holds NaN or Inf" in out.stderr
    evs = events(run)[len(events(reference_run)):]
    assert kinds(evs).count("attempt_start") == 1 and "failure_detected" not in kinds(evs)
    assert one(evs, "checkpoint_restore")["step"] == 6
    want, got = final_params(reference_run / "checkpoints"), final_params(run / "checkpoints")
    assert want.keys() == got.keys() and all(np.array_equal(want[k], got[k]) for k in want)
