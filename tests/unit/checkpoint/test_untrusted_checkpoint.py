"""A checkpoint from elsewhere is data (issue #43, finding 1): a crafted manifest or shard is
refused in one line naming the bad entry, and nothing outside the checkpoint folder is read or
written; a NaN state is never "verified" (finding 6)."""

import dataclasses
import hashlib
import json
import os
import re
import threading
import zlib

import numpy as np
import pytest
import torch
import torch.distributed as dist
from support.ckpt_runs import sharded_checkpoint

from mshpc.checkpoint.catalog import open_catalog
from mshpc.checkpoint.h5_shard import _CODEC
from mshpc.checkpoint.manifest import INDEX_FILE, ITEMSIZES, MANIFEST_FILE, read_manifest, write_manifest
from mshpc.checkpoint.model_copy import check_model_copy, read_model_copy, repair, repair_on_resume
from mshpc.checkpoint.paths import committed_steps, latest_step
from mshpc.checkpoint.reader import CheckpointReader
from mshpc.checkpoint.saver import CheckpointSaver, SaveTarget
from mshpc.checkpoint.state import checked_lrs, checked_scheduler_state
from mshpc.checkpoint.tools import verify
from mshpc.config import OptimConfig
from mshpc.errors import CheckpointError
from mshpc.loss_check import LossDiverged, StateDiverged
from mshpc.optim.schedule import build_scheduler
from mshpc.tensor_slice import TensorSlice

W = torch.randn(64, 32, generator=torch.Generator().manual_seed(0))
PAYLOAD = b"echo PWNED\n"


def checkpoint(folder):
    folder.mkdir()
    return sharded_checkpoint(folder, {"master/w": W}, n_shards=2, whole={"model/w": (W, 1)})


def edit_entry(folder, name, **fields):
    """Rewrite the manifest's entry of tensor `name` with `fields` (its index then no longer
    matches the manifest's size: a reader reads the manifest whole, as after any edit)."""
    raw = json.loads((folder / MANIFEST_FILE).read_text())
    for entry in raw["tensors"]:
        if entry["name"] == name:
            entry.update(fields)
    (folder / MANIFEST_FILE).write_text(json.dumps(raw))


def tree(root):
    """Every file under `root` (not following links) with a hash of its bytes."""
    out = {}
    for dirpath, _, files in os.walk(root):
        for f in files:
            p = os.path.join(dirpath, f)
            out[p] = "link" if os.path.islink(p) else hashlib.sha256(open(p, "rb").read()).hexdigest()
    return out


@pytest.fixture
def one_rank():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield dist.new_group(backend="gloo")
    dist.destroy_process_group()


def test_an_entry_naming_a_file_outside_the_folder_writes_nothing_and_is_named(tmp_path, one_rank):
    # The reproduction: the model/ entry names a private file outside the checkpoint, with
    # a checksum that fails, so that a resume's model-copy repair "rebuilds" it into that file.
    # Crafted with a matching index, as a careful attacker would write it.
    private = tmp_path / "fake_bashrc"
    private.write_bytes(b"# private\n" * 100)
    ckpt = tmp_path / "run" / "checkpoints" / "step-0000003"
    ckpt.parent.mkdir(parents=True)
    m = checkpoint(ckpt)
    write_manifest(ckpt, dataclasses.replace(m, tensors=tuple(
        dataclasses.replace(e, file="../../../fake_bashrc", crc32=zlib.crc32(PAYLOAD), offset=0)
        if e.name == "model/w" else e for e in m.tensors)))
    before = tree(tmp_path)
    line = (f"{ckpt / MANIFEST_FILE}: malformed entry 'model/w': file='../../../fake_bashrc' is not a shard of "
            "this folder (shard-NNNNN.h5)")
    repairs, error = repair_on_resume(ckpt, open_catalog(ckpt), one_rank)  # what a resume runs
    assert (repairs, error) == ([], line)
    for read in (read_manifest, check_model_copy, read_model_copy):  # verify, export, generate
        with pytest.raises(CheckpointError) as err:
            read(ckpt)
        assert str(err.value) == line
    assert verify(ckpt)[1] == [line]
    assert tree(tmp_path) == before and PAYLOAD not in private.read_bytes()


@pytest.mark.parametrize("field, value, why", [
    ("file", "/etc/passwd", "file='/etc/passwd' is not a shard of this folder"),
    ("file", "shard-00001.h5/../../x", "is not a shard of this folder"),
    ("dataset", "master/w", "dataset='master/w' is not the tensor's own name"),
    ("dtype", "complex128", "dtype='complex128' is not one of float32"),
    ("dtype", ["float32"], "dtype=['float32'] is not one of"),
    ("numel", 2**62, "numel=4611686018427387904 is not an integer in [0, 281474976710656]"),
    ("numel", True, "numel=True is not an integer"),
    ("global_shape", [2**40, 2**40], "has more than 281474976710656 elements"),
    ("global_shape", "64x32", "global_shape='64x32' is not a list"),
    ("offset", -4096, "offset=-4096 is not an integer"),
    ("crc32", 2**40, "crc32=1099511627776 is not an integer in [0, 4294967295]"),
    ("start", 1, "elements [1, 2049) lie outside its 2048"),
])
def test_a_malformed_entry_is_one_line_naming_it(tmp_path, field, value, why):
    ckpt = tmp_path / "c"
    checkpoint(ckpt)
    edit_entry(ckpt, "model/w", **{field: value})
    with pytest.raises(CheckpointError) as err:
        read_manifest(ckpt)
    message = str(err.value)
    assert "\n" not in message and message.startswith(f"{ckpt / MANIFEST_FILE}: malformed entry 'model/w': ")
    assert why in message


def test_the_manifest_and_the_codec_name_the_same_dtypes():
    assert {name: codec[0].itemsize for name, codec in _CODEC.items()} == ITEMSIZES


@pytest.mark.parametrize("kind", ["symlink", "fifo", "folder"])
def test_a_shard_that_is_not_a_regular_file_is_refused_without_reading_it(tmp_path, kind):
    ckpt = tmp_path / "c"
    checkpoint(ckpt)
    secret = tmp_path / "secret"
    secret.write_bytes((ckpt / "shard-00001.h5").read_bytes())  # a private file, shaped to pass every check
    (ckpt / "shard-00001.h5").unlink()
    {"symlink": lambda p: p.symlink_to(secret), "fifo": os.mkfifo, "folder": os.mkdir}[kind](ckpt / "shard-00001.h5")
    result: list = []

    def check():
        try:
            check_model_copy(ckpt)
        except CheckpointError as exc:
            result.append(str(exc))

    worker = threading.Thread(target=check, daemon=True)  # a FIFO opened for reading would block
    worker.start()
    worker.join(timeout=30)
    assert not worker.is_alive(), "the check blocked on the shard"
    why = {"symlink": "a symbolic link (not followed)", "fifo": "not a regular file (a FIFO)",
           "folder": "not a regular file (a folder)"}[kind]
    assert result == [f"{ckpt / 'shard-00001.h5'}: cannot open shard ({why})"]


def test_a_rewrite_goes_only_where_hdf5_puts_the_entrys_dataset(tmp_path):
    # a valid shard name, but the offset aimed at the shard's HDF5 header: the repair refuses
    ckpt = tmp_path / "c"
    checkpoint(ckpt)
    edit_entry(ckpt, "model/w", offset=0, crc32=1)
    before = tree(ckpt)
    reader = CheckpointReader(ckpt, read_manifest(ckpt))
    try:
        [r] = repair(reader, [e for e in reader.manifest.tensors if e.name == "model/w"])
    finally:
        reader.close()
    assert r.crc32 is None and re.search(r"shard-00001\.h5:model/w: HDF5 puts its data at \d+, the manifest at 0$", r.error)
    assert tree(ckpt) == before


def test_an_index_with_huge_sizes_is_dropped_before_any_allocation(tmp_path, caplog):
    ckpt = tmp_path / "c"
    checkpoint(ckpt)
    index = json.loads((ckpt / INDEX_FILE).read_text())
    for bad in ({"head_bytes": 2**62}, {"manifest_bytes": 2**62},
                {"names": {"master/w": [[0, 2**62, 1]]}}, {"names": {"master/w": [[0, 10, 1], [5, 10, 1]]}}):
        (ckpt / INDEX_FILE).write_text(json.dumps({**index, **bad}))
        reader = CheckpointReader(ckpt, open_catalog(ckpt))
        assert torch.equal(reader.read_whole("master/w"), W)  # the manifest, read whole, still serves
        reader.close()
    assert "unusable" in caplog.text


def test_a_nan_state_fails_verify_and_restore(tmp_path):
    bad = W.clone()
    bad[3, 4] = float("nan")
    ckpt = tmp_path / "c"
    ckpt.mkdir()
    sharded_checkpoint(ckpt, {"master/w": bad}, n_shards=2)  # checksums of the NaN bytes: they match
    good, problems = verify(ckpt)
    assert good == [] and len(problems) == 1
    assert problems[0].endswith("shard-00000.h5:master/w: holds NaN or Inf values (a diverged state, not one "
                                "to save or resume from)")
    reader = CheckpointReader(ckpt, open_catalog(ckpt))
    with pytest.raises(CheckpointError, match="holds NaN or Inf"):
        reader.read_whole("master/w")
    reader.close()


def scheduler():
    return build_scheduler(torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=3e-4), OptimConfig(), 10)


def test_scheduler_state_from_a_manifest_sets_only_the_schedulers_own_fields():
    s = scheduler()
    s.optimizer.step()
    s.step()
    saved = json.loads(json.dumps(s.state_dict()))  # as the manifest's extras hold it
    fresh = scheduler()
    fresh.load_state_dict(checked_scheduler_state({**saved, "verbose": False}, fresh.state_dict(), "c"))
    assert fresh.state_dict() == s.state_dict()  # an older torch's extra key is left out
    for crafted, why in [({**saved, "optimizer": {}}, None),
                         ({**saved, "last_epoch": 1e300}, "last_epoch=1e+300"),
                         ({**saved, "_last_lr": [float("nan")]}, "_last_lr=[nan]"),
                         ({**saved, "lr_lambdas": [{"__code__": 1}]}, "lr_lambdas=[{'__code__': 1}]"),
                         ({k: v for k, v in saved.items() if k != "base_lrs"}, "base_lrs=None")]:
        if why is None:  # an unknown key is not applied at all
            assert "optimizer" not in checked_scheduler_state(crafted, fresh.state_dict(), "c")
            continue
        with pytest.raises(CheckpointError, match="c: scheduler state " + why.replace("[", r"\[").replace("+", r"\+")):
            checked_scheduler_state(crafted, fresh.state_dict(), "c")
    assert checked_lrs([1e-4, 2], 2, "c") == [1e-4, 2.0]
    for bad in ([1e-4], [float("inf"), 1.0], "0.1", [-1.0, 1.0], [True, 1.0]):
        with pytest.raises(CheckpointError, match="c: group_lrs="):
            checked_lrs(bad, 2, "c")


def test_a_checkpoints_own_bytes_still_restore_bitwise(tmp_path):
    ckpt = tmp_path / "c"
    checkpoint(ckpt)
    check_model_copy(ckpt)
    assert np.array_equal(read_model_copy(ckpt)["w"].numpy(), W.numpy())


def test_a_nan_state_is_refused_at_save_as_a_divergence_and_nothing_is_committed(tmp_path, one_rank):
    bad = W.clone()
    bad[0, 1] = float("inf")
    target = SaveTarget(root=tmp_path, keep=3, layout={"dp": 1, "tp": 1, "pp": 1}, config_hash="abc")
    saver = CheckpointSaver(target, 0, one_rank, async_save=False)
    saver.save(2, {"master/w": TensorSlice.whole(W)}, {"step": 2})
    with pytest.raises(StateDiverged) as err:
        saver.save(4, {"master/w": TensorSlice.whole(bad)}, {"step": 4})
    assert str(err.value) == ("checkpoint of step 4 failed: rank 0: step 4's tensor 'master/w': holds NaN or Inf "
                              "values (a diverged state, not one to save or resume from)")
    assert isinstance(err.value, LossDiverged)  # the supervisor retries it from the last checkpoint
    assert committed_steps(tmp_path) == [2] and latest_step(tmp_path) == 2
    assert not any(tmp_path.glob("*.tmp"))
