"""The supervisor under Slurm: a node set DOWN mid-run is left out, and the spare node of the
allocation takes its place within the same job, or, with no spare, the job is requeued without
it; either way the run ends at its last step."""

import json
import os
import subprocess
import time

import pytest

from support.cli_runner import REPO, read_metrics

pytestmark = pytest.mark.slurm

TEMPLATE = str(REPO / "sbatch/train.sbatch")
CONFIG = str(REPO / "configs/tiny.yaml")


def events(run) -> list[dict]:
    path = run / "events.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def others_on(node: str, job: str) -> list[str]:
    out = subprocess.run(["squeue", "-h", "-w", node, "-o", "%i"], capture_output=True, text=True, timeout=30)
    return [j for j in out.stdout.split() if j != job]


def down_mid_run(slurm, corpus_cache, steps: int, nodes: int, spare: int):
    """Submit, take the job's second node DOWN after a few steps, bring it back when the job ends.
    Returns (the job's final info, the node taken down, the nodes left over at first, when)."""
    sets = slurm.train_sets(corpus_cache, f"train.steps={steps}", f"checkpoint.interval_steps={max(1, steps // 8)}",
                            f"train.spare_nodes={spare}", "supervisor.heartbeat_interval_s=0.5", "supervisor.stop_grace_s=5")
    job = slurm.sbatch(f"--nodes={nodes}", TEMPLATE, CONFIG, *sets)
    run = slurm.cwd / "runs/t"
    first = slurm.wait_until("the first attempt", lambda: next((e for e in events(run) if e["kind"] == "attempt_start"), None))
    victim = first["hosts"][1]  # not the batch host, where the supervisor itself runs
    unused = sorted({"n1", "n2", "n3"} - set(first["hosts"]))
    slurm.wait_until("a few steps", lambda: (run / "metrics.jsonl").exists() and len(read_metrics(run)) >= 3)
    # other helpers' jobs share this cluster: take the node down only while it runs nothing else
    # (on a cluster of its own, as in CI, at once)
    slurm.wait_until(f"{victim} to run only this job", lambda: not others_on(victim, job)
                     or slurm.info(job).get("JobState") != "RUNNING", timeout_s=600, poll_s=1)
    if slurm.info(job).get("JobState") != "RUNNING":
        why = f"{victim} ran other users' jobs until this one ended: it could not be taken down"
        pytest.fail(why) if os.environ.get("CI") == "true" else pytest.skip(why)
    try:
        subprocess.run(["scontrol", "update", f"NodeName={victim}", "State=DOWN", "Reason=mshpc test: node failure"],
                       check=True, timeout=30)
        downed = time.time()
        assert slurm.info(job)["JobState"] == "RUNNING", "the job ended before its node could be taken down"
        info = slurm.wait_done(job, timeout_s=400)
    finally:
        subprocess.run(["scontrol", "update", f"NodeName={victim}", "State=RESUME"], timeout=30)
    return job, info, victim, unused, downed


def test_a_node_set_down_mid_run_is_replaced_by_the_spare(steps_for, slurm, corpus_cache):
    n = steps_for(10)  # time to take the node down after step 3 (within about a second) with most of the run left
    job, info, victim, unused, downed = down_mid_run(slurm, corpus_cache, n, nodes=3, spare=1)
    assert (info["JobState"], info["Restarts"]) == ("COMPLETED", "0"), slurm.batch_log(job)
    run = slurm.cwd / "runs/t"
    evs = events(run)
    detected = next(e for e in evs if e["kind"] == "failure_detected")
    assert detected["time"] - downed < 30  # the step died with the node: seen at once, no timeout
    verdict = next(e for e in evs if e["kind"] == "classified")
    assert verdict["fault_class"] == "node_fault" and verdict["blame"] == [victim], verdict
    evicted = next(e for e in evs if e["kind"] == "evicted")
    assert (evicted["node"], evicted["replacement"]) == (victim, unused[0])
    last = [e for e in evs if e["kind"] == "attempt_start"][-1]
    assert victim not in last["hosts"] and unused[0] in last["hosts"]
    assert evs[-1]["kind"] == "run_end" and evs[-1]["outcome"] == "finished" and evs[-1]["evicted"] == [victim]
    assert [r["step"] for r in read_metrics(run)] == list(range(1, n + 1))


def test_without_a_spare_the_job_is_requeued_without_the_down_node(steps_for, slurm, corpus_cache):
    n = steps_for(10)  # time to take the node down after step 3 (within about a second) with most of the run left
    job, info, victim, unused, _ = down_mid_run(slurm, corpus_cache, n, nodes=2, spare=0)
    assert (info["JobState"], info["Restarts"]) == ("COMPLETED", "1"), slurm.batch_log(job)
    assert victim not in info["NodeList"] and info["ExcNodeList"] == victim  # excluded by the requeue
    evs = events(slurm.cwd / "runs/t")
    evicted = next(e for e in evs if e["kind"] == "evicted")
    assert (evicted["node"], evicted["replacement"]) == (victim, None)
    assert next(e for e in evs if e["kind"] == "requeue")["exclude"] == [victim]
    ends = [e["outcome"] for e in evs if e["kind"] == "run_end"]
    assert ends == ["requeued", "finished"]
    assert [r["step"] for r in read_metrics(slurm.cwd / "runs/t")] == list(range(1, n + 1))
