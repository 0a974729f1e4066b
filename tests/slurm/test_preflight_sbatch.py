"""`mshpc preflight` on the real local Slurm: sbatch/preflight.sbatch across 2 nodes passes the
standard suite; the quick level across 3 nodes, with the shipped thresholds, excludes the node
slowed for real and no other, each failure confirmed by every sample; and
sbatch/train-with-preflight.sbatch leaves out the node with a wrong GEMM and trains on the other."""

import json

import pytest

from support.cli_runner import REPO, read_metrics

pytestmark = pytest.mark.slurm

SHARED = f"--set preflight.thresholds={REPO / 'tests/support/preflight_thresholds.yaml'}"


def verdict(slurm, folder: str) -> dict:
    return json.loads((slurm.cwd / "preflight" / folder / "verdict.json").read_text())


def test_preflight_sbatch_passes_the_standard_suite_across_two_nodes(slurm):
    job = slurm.sbatch(str(REPO / "sbatch/preflight.sbatch"), *SHARED.split(), "--set", "preflight.burn_s=1",
                       env={"MSHPC_PREFLIGHT_LEVEL": "standard"})
    info = slurm.wait_done(job, timeout_s=420)
    rank0 = (slurm.cwd / "preflight" / job / "rank-0.log").read_text()
    assert (info["JobState"], info["ExitCode"], info["NodeList"]) == ("COMPLETED", "0:0", "n[1-2]"), rank0[-3000:]
    doc = verdict(slurm, job)
    assert (doc["status"], doc["nodes"], doc["level"]) == ("pass", {"n1": "pass", "n2": "pass"}, "standard")
    assert (slurm.cwd / "preflight" / job / "exclude.txt").read_text() == ""
    tests = {(r["node"], r["test"]) for r in doc["records"]}
    assert {("n1", "gemm_tflops"), ("n2", "gemm_tflops"), ("n1", "burn_tflops"), ("n2", "burn_errors"),
            ("n[1-2]", "inter_all_reduce_busbw_gbps"), ("n[1-2]", "sendrecv_wrong_elements"),
            ("n1", "link_gbps"), ("n2", "link_gbps"), ("n1", "pair_gbps")} <= tests
    assert "preflight: PASS" in rank0 and "rank 0/2 on n1: gloo via slurm" in rank0


def test_quick_preflight_on_three_nodes_excludes_the_slowed_node_and_no_healthy_one(slurm):
    # the shipped thresholds, as a user runs it: a healthy node's one noisy link sample used to
    # exclude it in 2 runs of 3 here; a slowed GEMM must still exclude its node
    job = slurm.sbatch("--nodes=3", str(REPO / "sbatch/preflight.sbatch"), "--level", "quick",
                       env={"MSHPC_TEST_FAULTS": "gemm_slow:node=n2"})
    info = slurm.wait_done(job, timeout_s=300)
    rank0 = (slurm.cwd / "preflight" / job / "rank-0.log").read_text()
    assert (info["JobState"], info["ExitCode"], info["NodeList"]) == ("FAILED", "3:0", "n[1-3]"), rank0[-3000:]
    assert (slurm.cwd / "preflight" / job / "exclude.txt").read_text() == "n2\n", rank0[-3000:]
    doc = verdict(slurm, job)
    failed = [r for r in doc["records"] if r["status"] == "fail"]
    assert {r["node"] for r in failed} == {"n2"}, rank0[-3000:]  # a slow pair of n2's is blamed on n2
    gemm = next(r for r in failed if r["test"] == "gemm_tflops")
    assert (len(gemm["samples"]), gemm["failed"]) == (3, 3)  # run again twice, slow every time
    assert "3 of 3 samples failed" in rank0
    links = [r for r in doc["records"] if r["test"] in ("pair_gbps", "link_gbps")]
    assert len(links) == 6 and all(r["samples"] for r in links)


def test_train_with_preflight_leaves_out_the_failing_node(slurm, corpus_cache):
    env = {"MSHPC_TEST_FAULTS": "gemm_wrong:rank=1", "MSHPC_PREFLIGHT_ARGS": SHARED,
           "MSHPC_SBATCH_DIR": str(REPO / "sbatch")}
    job = slurm.sbatch("--nodes=2", str(REPO / "sbatch/train-with-preflight.sbatch"), str(REPO / "configs/tiny.yaml"),
                       *slurm.train_sets(corpus_cache, "train.steps=2"), env=env)
    info = slurm.wait_done(job, timeout_s=420)
    log = slurm.batch_log(job)
    assert info["JobState"] == "COMPLETED", log[-3000:]
    assert "mshpc: preflight exited with code 3" in log
    assert "leaving out n2" in log and "training on n1" in log
    folder = f"{job}-restart-0"
    assert (slurm.cwd / "preflight" / folder / "exclude.txt").read_text() == "n2\n"
    doc = verdict(slurm, folder)
    assert doc["nodes"] == {"n1": "pass", "n2": "fail"}
    assert {r["test"] for r in doc["records"] if r["status"] == "fail"} == {"gemm_rel_error"}
    assert len(read_metrics(slurm.cwd / "runs/t")) == 2
