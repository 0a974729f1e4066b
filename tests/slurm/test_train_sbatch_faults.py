"""The supervisor under Slurm: a node set DOWN mid-run is left out and the spare node of the
allocation takes its place, within the same job (no requeue), and the run ends as it would have."""

import json
import subprocess
import time

import pytest

from cli_runner import REPO, read_metrics

pytestmark = pytest.mark.slurm

TEMPLATE = str(REPO / "sbatch/train.sbatch")
CONFIG = str(REPO / "configs/tiny.yaml")


def events(run) -> list[dict]:
    path = run / "events.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def others_on(node: str, job: str) -> list[str]:
    out = subprocess.run(["squeue", "-h", "-w", node, "-o", "%i"], capture_output=True, text=True, timeout=30)
    return [j for j in out.stdout.split() if j != job]


def test_a_node_set_down_mid_run_is_replaced_by_the_spare(steps_for, slurm, corpus_cache):
    n = steps_for(40)
    sets = slurm.train_sets(corpus_cache, f"train.steps={n}", f"checkpoint.interval_steps={max(1, n // 8)}",
                            "train.spare_nodes=1", "supervisor.heartbeat_interval_s=0.5", "supervisor.stop_grace_s=5")
    job = slurm.sbatch("--nodes=3", TEMPLATE, CONFIG, *sets)
    run = slurm.cwd / "runs/t"
    first = slurm.wait_until("the first attempt", lambda: next((e for e in events(run) if e["kind"] == "attempt_start"), None))
    active, spare = first["hosts"], sorted({"n1", "n2", "n3"} - set(first["hosts"]))
    victim = active[1]  # not the batch host, where the supervisor itself runs
    slurm.wait_until("a few steps", lambda: (run / "metrics.jsonl").exists() and len(read_metrics(run)) >= 3)
    # other helpers' jobs share this cluster: take the node down only while it runs nothing else
    slurm.wait_until(f"{victim} to run only this job", lambda: not others_on(victim, job), timeout_s=120, poll_s=1)
    try:
        subprocess.run(["scontrol", "update", f"NodeName={victim}", "State=DOWN", "Reason=mshpc test: node failure"],
                       check=True, timeout=30)
        downed = time.time()
        info = slurm.wait_done(job, timeout_s=400)
    finally:
        subprocess.run(["scontrol", "update", f"NodeName={victim}", "State=RESUME"], timeout=30)
    assert (info["JobState"], info["Restarts"]) == ("COMPLETED", "0"), slurm.batch_log(job)
    evs = events(run)
    detected = next(e for e in evs if e["kind"] == "failure_detected")
    assert detected["time"] - downed < 30  # the step died with the node: seen at once, no timeout
    verdict = next(e for e in evs if e["kind"] == "classified")
    assert verdict["fault_class"] == "node_fault" and verdict["blame"] == [victim], verdict
    evicted = next(e for e in evs if e["kind"] == "evicted")
    assert (evicted["node"], evicted["replacement"]) == (victim, spare[0])
    last = [e for e in evs if e["kind"] == "attempt_start"][-1]
    assert victim not in last["hosts"] and spare[0] in last["hosts"]
    assert evs[-1]["kind"] == "run_end" and evs[-1]["outcome"] == "finished" and evs[-1]["evicted"] == [victim]
    assert [r["step"] for r in read_metrics(run)] == list(range(1, n + 1))
