"""Bad bytes under a supervised run, each found where it lies and named: a corrupt model/ copy in
the checkpoint a rerun resumes from is rebuilt from the masters, not kept; a data shard cut
short under the running job stops it at once as a data error (exit 2), not as a node fault."""

import os
import re
import signal
from pathlib import Path

import h5py
from support.cli_runner import mshpc
from support.fault_runs import (
    assert_recovered_exactly,
    events,
    kinds,
    one,
    start_supervised,
    supervised,
    wait_for_step,
)
from support.token_data import make_random_dataset

TENSOR = "model/layers.0.mlp.fc.weight"


def flip_model_byte(ckpt: Path, dataset: str) -> Path:
    """Flip one byte of `dataset` in whichever shard of checkpoint `ckpt` holds it; that shard."""
    for shard in sorted(ckpt.glob("shard-*.h5")):
        with h5py.File(shard, "r") as f:
            if dataset not in f:
                continue
            offset = f[dataset].id.get_offset()
        with open(shard, "r+b") as f:
            f.seek(offset + 16)
            byte = f.read(1)
            f.seek(offset + 16)
            f.write(bytes([byte[0] ^ 0x01]))
        return shard
    raise AssertionError(f"no shard of {ckpt} holds {dataset}")


def test_a_corrupt_model_copy_is_rebuilt_from_the_masters_on_resume(reference, tmp_path, corpus_cache):
    # the first run ends at step 6 (synchronous saves: its checkpoint is committed), no restart
    first = supervised(tmp_path, corpus_cache, "m", "checkpoint.async_save=false", "supervisor.max_restarts=0",
                       faults="kill:rank=1:step=6")
    assert first.returncode == 137, first.stderr[-3000:]  # rank 1 killed, no restart allowed
    ckpts = tmp_path / "m" / "checkpoints"
    assert os.readlink(ckpts / "latest") == "step-0000006"
    shard = flip_model_byte(ckpts / "step-0000006", TENSOR)
    assert mshpc("ckpt", "verify", str(ckpts)).returncode == 1  # the inference weights are bad
    out = supervised(tmp_path, corpus_cache, "m")  # reruns to step 8, from step 6
    assert out.returncode == 0, out.stderr[-3000:]
    evs = events(tmp_path / "m")
    repaired = one(evs, "checkpoint_repaired")
    assert (repaired["step"], repaired["tensor"]) == (6, TENSOR)
    assert Path(repaired["file"]).resolve() == shard.resolve()
    assert "checksum mismatch" in repaired["problem"]
    assert f"rebuilt the model copy {TENSOR}" in out.stderr
    verified = mshpc("ckpt", "verify", str(ckpts))
    assert verified.returncode == 0 and "step-0000006: OK" in verified.stdout, verified.stdout + verified.stderr
    assert_recovered_exactly(tmp_path / "m", reference)


def test_a_shard_truncated_under_the_job_is_a_data_error_at_once(tmp_path, corpus_cache):
    data = make_random_dataset(tmp_path)  # shards of 1000 tokens, 2000 bytes
    # steps enough that the job is still reading when the shard goes; one batch read ahead
    proc = start_supervised(tmp_path, corpus_cache, "d", f"data.path={data}", "train.steps=400",
                            "data.prefetch_batches=1")
    try:
        wait_for_step(proc, tmp_path / "d")
        os.truncate(data / "shard-00002.bin", 0)  # a whole page past the end: a mapped read would SIGBUS
        assert proc.wait(timeout=240) == 2
    finally:
        if proc.poll() is None:  # the test failed with the job still running: end it and its ranks
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    last = (tmp_path / "d.log").read_text().strip().splitlines()[-1]
    assert re.fullmatch(r"mshpc: rank [01] exited with code 2: DataError: " + re.escape(
        f"{data / 'shard-00002.bin'}: 0 bytes, index says 1000 tokens = 2000 bytes (truncated or "
        "overwritten); re-run mshpc prepare"), last), last
    evs = events(tmp_path / "d")
    assert "restart" not in kinds(evs) and kinds(evs).count("attempt_start") == 1
    assert one(evs, "classified")["fault_class"] == "user_error"
    assert one(evs, "run_end")["exit_code"] == 2


def test_a_rank_failing_while_a_save_is_in_flight_lets_it_commit_first(tmp_path, corpus_cache):
    # rank 1 raises in step 5 while the save of step 4 is in stage 2, where rank 0 sits 4 s before
    # committing: past the supervisor's 2 s stop grace, so a rank that left at once would have
    # had rank 0 stopped before the commit (and, exiting under the save's collective, crashed)
    out = supervised(tmp_path, corpus_cache, "s", "supervisor.max_restarts=0",
                     faults="slow_save:rank=0:step=4:factor=4;raise:rank=1:step=4")
    assert out.returncode == 1, out.stderr[-3000:]
    assert out.stderr.strip().splitlines()[-1] == (
        "mshpc: rank 1 exited with code 1: RuntimeError: injected fault at rank 1 step 4"), out.stderr[-3000:]
    ckpts = tmp_path / "s" / "checkpoints"
    assert os.readlink(ckpts / "latest") == "step-0000004"
    assert "finishing the checkpoint of step 4 in flight before exiting" in out.stderr
    verified = mshpc("ckpt", "verify", str(ckpts))
    assert verified.returncode == 0 and "step-0000004: OK" in verified.stdout, verified.stdout + verified.stderr
    detected = one(events(tmp_path / "s"), "failure_detected")
    assert detected["phase"] == "checkpoint", detected  # the wait was the save's phase, not a hang
