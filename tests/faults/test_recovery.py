"""Real faults injected into real ranks: each one is detected within its timeout, named, and
recovered from on its own, ending with bitwise the parameters of an undisturbed run."""

import os
import random

from support.fault_runs import assert_recovered_exactly, assert_story, events, kinds, one, supervised


def test_kill_9_at_a_random_step(reference, tmp_path, corpus_cache):
    seed = int.from_bytes(os.urandom(2), "little")
    step = random.Random(seed).randrange(1, 7)
    out = supervised(tmp_path, corpus_cache, "k", faults=f"kill:rank=1:step={step}:attempt=0")
    assert out.returncode == 0, f"seed {seed}, step {step}\n" + out.stderr[-3000:]
    evs = assert_story(tmp_path / "k", "kill", "crash", 1)
    detected = one(evs, "failure_detected")
    assert detected["detail"] == "rank 1 was killed by SIGKILL" and detected["host"] == "slot1"
    assert one(evs, "classified")["fault_class"] == "node_fault"
    assert_recovered_exactly(tmp_path / "k", reference)


def test_sigstop_hang_is_reported_with_the_stopped_rank(reference, tmp_path, corpus_cache):
    out = supervised(tmp_path, corpus_cache, "h", "supervisor.timeout_floor_s=8", faults="stop:rank=1:step=4:attempt=0")
    assert out.returncode == 0, out.stderr[-3000:]
    evs = assert_story(tmp_path / "h", "stop", "hang", None)
    assert [m["rank"] for m in one(evs, "hang_report")["missing"]] == [1]
    report = (tmp_path / "h" / "hang-report.txt").read_text()
    missing = report.split("missing ranks:\n")[1].split("\n\n")[0]
    assert missing.startswith("  rank 1 on slot1 (dp=1, tp=0, pp=0): silent for") and "stopped" in missing
    assert "rank 0" not in missing
    assert "Python stacks (faulthandler)" in report and "in run_training" in report  # rank 0's main thread
    # SIGCONT follows SIGTERM, so the stopped rank ends on it instead of waiting out the grace
    assert one(evs, "ranks_stopped")["sigkilled"] == []  # none outlived the grace
    assert one(evs, "classified")["blame"] == ["slot1"]
    assert_recovered_exactly(tmp_path / "h", reference)


def test_a_rank_raising_inside_a_collective(reference, tmp_path, corpus_cache):
    out = supervised(tmp_path, corpus_cache, "c", faults="raise_in_collective:rank=0:step=3:attempt=0")
    assert out.returncode == 0, out.stderr[-3000:]
    evs = assert_story(tmp_path / "c", "raise_in_collective", "crash", 0)
    assert one(evs, "failure_detected")["detail"] == (
        "rank 0 exited with code 1: RuntimeError: injected fault at rank 0 step 3 (inside a collective)")
    assert one(evs, "classified")["fault_class"] == "unknown"
    assert_recovered_exactly(tmp_path / "c", reference)


def test_corrupt_latest_checkpoint_before_the_restart(reference, tmp_path, corpus_cache):
    # synchronous saves: the checkpoint of step 4 is surely committed when step 5 (index 5) starts
    faults = "corrupt_latest:rank=0:step=5:attempt=0;kill:rank=1:step=5:attempt=0"
    out = supervised(tmp_path, corpus_cache, "r", "checkpoint.async_save=false", faults=faults)
    assert out.returncode == 0, out.stderr[-3000:]
    evs = events(tmp_path / "r")
    corrupted = next(e for e in evs if e["kind"] == "fault_injected" and e["fault"] == "corrupt_latest")
    assert corrupted["target"] == "step-0000004"
    assert "step-0000004 is damaged or incomplete, trying an older one" in out.stderr
    assert [e["from_step"] for e in evs if e["kind"] == "resumed"] == [0, 2]  # fell back past step 4
    assert one(evs, "restart")["latest_checkpoint"] == 4
    assert_recovered_exactly(tmp_path / "r", reference)


def test_nan_loss_is_caught_before_it_is_saved(reference, tmp_path, corpus_cache):
    # synchronous saves: the checkpoint of step 4 is committed before step 5 (index 4) goes NaN
    out = supervised(tmp_path, corpus_cache, "n", "checkpoint.async_save=false", faults="nan:rank=1:step=4:attempt=0")
    assert out.returncode == 0, out.stderr[-3000:]
    evs = assert_story(tmp_path / "n", "nan", "loss", None)
    assert "LossDiverged: loss nan at step 5" in one(evs, "failure_detected")["detail"]
    assert one(evs, "restart")["latest_checkpoint"] == 4  # the NaN weights of step 5 were never saved
    assert [e["from_step"] for e in evs if e["kind"] == "resumed"] == [0, 4]
    assert_recovered_exactly(tmp_path / "n", reference)


def test_a_node_failing_twice_is_evicted_for_the_spare(reference, tmp_path, corpus_cache):
    # the fault sits on slot1, not on a rank: it strikes whoever runs there, in every attempt
    out = supervised(tmp_path, corpus_cache, "e", "train.spare_nodes=1", faults="kill:node=slot1:step=3")
    assert out.returncode == 0, out.stderr[-3000:]
    evs = events(tmp_path / "e")
    assert [e["host"] for e in evs if e["kind"] == "failure_detected"] == ["slot1", "slot1"]
    evicted = one(evs, "evicted")
    assert (evicted["node"], evicted["blames"], evicted["replacement"]) == ("slot1", 2, "slot2")
    assert [e["hosts"] for e in evs if e["kind"] == "attempt_start"] == [["slot0", "slot1"]] * 2 + [["slot0", "slot2"]]
    assert one(evs, "run_end")["evicted"] == ["slot1"]
    assert_recovered_exactly(tmp_path / "e", reference)


def test_a_deterministic_error_is_not_retried_forever(tmp_path, corpus_cache):
    out = supervised(tmp_path, corpus_cache, "d", faults="raise:rank=1:step=1")
    assert out.returncode == 2  # a user error: Slurm's requeue guard will not requeue it either
    assert out.stderr.strip().splitlines()[-1] == (
        "mshpc: rank 1 exited with code 1: RuntimeError: injected fault at rank 1 step 1")
    evs = events(tmp_path / "d")
    assert kinds(evs).count("attempt_start") == 2
    verdicts = [e["fault_class"] for e in evs if e["kind"] == "classified"]
    assert verdicts == ["unknown", "user_error"]
    assert one(evs, "run_end")["outcome"] == "failed"


def test_a_user_error_stops_at_once(tmp_path, corpus_cache):
    out = supervised(tmp_path, corpus_cache, "u", f"train.resume={tmp_path / 'nowhere'}")
    assert out.returncode == 2
    assert "CheckpointError: train.resume=" in out.stderr.strip().splitlines()[-1]
    evs = events(tmp_path / "u")
    assert kinds(evs).count("attempt_start") == 1 and one(evs, "classified")["fault_class"] == "user_error"
