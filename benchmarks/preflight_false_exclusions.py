"""Claim: a quick preflight over the local Slurm's nodes excludes no healthy node, while a node
slowed for real (the gemm_slow test fault: its GEMMs 4x slow) is excluded every time. Runs N
jobs of `sbatch --nodes=K sbatch/preflight.sbatch --level quick` with every node healthy and M
with one node slowed, alternating so that both see the same load on the machine, with the
shipped thresholds. Each run's measurements are also judged by the rule before confirmation:
the first sample of every rate decides, nothing is measured again (the baseline, from the same
runs; it shares today's pair size and blame rule).

    .venv/bin/python benchmarks/preflight_false_exclusions.py [--healthy 10] [--slowed 10]
        [--nodes all] [--slow-node LAST]

Prints one JSON object per run (excluded nodes, exit code, the failing records with their
samples, the links measured again) and then the summary lines. Needs the local Slurm
(tests/slurm/cluster.sh start)."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from mshpc.bench import harness
from mshpc.bench.harness import REPO
from mshpc.preflight.links import link_records
from mshpc.preflight.record import Record
from mshpc.preflight.thresholds import load_thresholds
from mshpc.preflight.verdict import judge, verdict

SLOW_FAULT = "gemm_slow:node={node}"
JOB_TIMEOUT_S = 600
ENDED = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED")
LINKS = ("pair_gbps", "link_gbps")  # rebuilt from their first samples


def idle_nodes() -> list[str]:
    out = subprocess.run(["sinfo", "-h", "-N", "-o", "%N"], capture_output=True, text=True, timeout=30, check=True)
    return sorted(set(out.stdout.split()))


def submit(folder: Path, nodes: int, faults: str | None) -> tuple[int, float]:
    """One preflight job, waited for: (its exit code, wall seconds from submission)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "PMI", "OMPI_", "MSHPC_"))}
    env.update(PATH=f"{Path(sys.executable).parent}:{env.get('PATH', '')}", MSHPC_PYTHON=sys.executable,
               MSHPC_PREFLIGHT_DIR=str(folder / "preflight"), **({"MSHPC_TEST_FAULTS": faults} if faults else {}))
    start = time.perf_counter()
    out = subprocess.run(["sbatch", "--parsable", f"--nodes={nodes}", str(REPO / "sbatch/preflight.sbatch"),
                          "--level", "quick"], capture_output=True, text=True, cwd=folder, env=env, timeout=60)
    if out.returncode != 0:
        raise SystemExit(f"sbatch failed: {out.stderr.strip()}")
    job = out.stdout.strip().split(";")[0]
    while time.perf_counter() - start < JOB_TIMEOUT_S:
        # polled, not `sbatch --wait`, which checks only every half minute or so
        info = subprocess.run(["scontrol", "-o", "show", "job", job], capture_output=True, text=True, timeout=30)
        fields = dict(f.split("=", 1) for f in info.stdout.split() if "=" in f)
        if fields.get("JobState") in ENDED:
            return int(fields["ExitCode"].split(":")[0]), time.perf_counter() - start
        time.sleep(0.5)
    subprocess.run(["scancel", job], timeout=30)
    raise SystemExit(f"job {job} did not end within {JOB_TIMEOUT_S} s")


def first_only(r: Record) -> Record:
    """A record as first measured, not yet judged."""
    value = r.samples[0] if r.samples else r.value
    return Record(**{**r.to_json(), "status": "info", "threshold": "", "failed": None, "value": value,
                     "samples": r.samples[:1]})


def one_sample_verdict(records: list[Record], nodes: list[str]) -> list[str]:
    """The nodes that the rule before confirmation excluded: the same measurements, each link
    decided by its first sample, judged once."""
    raw = [{"a": a, "b": b, "rank": 0, "gbps": r.samples[0], "wrong": 0, "size_bytes": r.size_bytes}
           for r in records if r.test == "pair_gbps" for a, b in [r.device.split("<->")]]
    raw = list({(d["a"], d["b"]): d for d in raw}.values())  # a pair blamed on both ends is listed twice
    kinds = {r.node: r.kind for r in records if r.test == "link_gbps"}
    rest = [r if r.status in ("na", "skip") or r.value is None else first_only(r) for r in records if r.test not in LINKS]
    return verdict(judge(rest + link_records(raw, kinds), load_thresholds()), nodes).failed_nodes


def run(index: int, nodes: list[str], slow: str | None, root: Path) -> dict:
    folder = root / f"run-{index}"
    folder.mkdir()
    code, wall_s = submit(folder, len(nodes), SLOW_FAULT.format(node=slow) if slow else None)
    found = list((folder / "preflight").glob("*/verdict.json"))
    if not found:
        logs = "".join(p.read_text()[-2000:] for p in folder.glob("*.out"))
        raise SystemExit(f"run {index}: no verdict.json (sbatch exit {code}):\n{logs}")
    doc = json.loads(found[0].read_text())
    records = [Record.from_json(r) for r in doc["records"]]
    excluded = sorted(n for n, s in doc["nodes"].items() if s == "fail")
    return {"bench": "preflight_false_exclusions", "run": index, "slowed": slow, "exit_code": code,
            "wall_s": round(wall_s, 1), "preflight_wall_s": round(doc["wall_s"], 1), "excluded": excluded,
            "excluded_one_sample_rule": one_sample_verdict(records, list(doc["nodes"])),
            "failed": [{"node": r.node, "device": r.device, "test": r.test, "value": r.value,
                        "samples": len(r.samples) or 1, "failed": r.failed} for r in records if r.status == "fail"],
            "measured_again": sorted({f"{r.node} {r.device} {r.test}: {[round(s, 3) for s in r.samples]}"
                                      for r in records if r.test != "link_gbps" and len(r.samples) > 1})}


def summary(lines: list[dict], slow: str) -> list[dict]:
    healthy = [x for x in lines if x["slowed"] is None]
    slowed = [x for x in lines if x["slowed"] is not None]
    ours = sum(bool(x["excluded"]) for x in healthy)
    before = sum(bool(x["excluded_one_sample_rule"]) for x in healthy)
    caught = sum(x["excluded"] == [slow] for x in slowed)
    caught_before = sum(x["excluded_one_sample_rule"] == [slow] for x in slowed)
    found = sum(slow in x["excluded"] for x in slowed)
    found_before = sum(slow in x["excluded_one_sample_rule"] for x in slowed)
    def count(metric: str, value: int, runs: int, baseline: int, **context: object) -> dict:
        if not baseline:  # the one-sample rule excluded nothing: no ratio
            return {**harness.record("preflight_false_exclusions", metric, value, f"runs of {runs}", digits=0),
                    "baseline": baseline, "ratio": None, **context}
        return harness.record("preflight_false_exclusions", metric, value, f"runs of {runs}", baseline, digits=0,
                              **context)

    return [count("healthy_runs_excluding_a_node_vs_one_sample_rule", ours, len(healthy), before),
            count("slowed_runs_excluding_the_slowed_node_vs_one_sample_rule", found, len(slowed), found_before,
                  slowed_node=slow),
            count("slowed_runs_excluding_exactly_the_slowed_node_vs_one_sample_rule", caught, len(slowed),
                  caught_before, slowed_node=slow)]


def interleaved(healthy: int, slowed: int, slow: str) -> list[str | None]:
    """Healthy (None) and slowed runs taking turns, so that the machine's load falls on both alike."""
    order: list[str | None] = []
    for i in range(max(healthy, slowed)):
        order += ([None] if i < healthy else []) + ([slow] if i < slowed else [])
    return order


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--healthy", type=int, default=10, help="runs with every node healthy (N)")
    parser.add_argument("--slowed", type=int, default=10, help="runs with one node slowed (M)")
    parser.add_argument("--nodes", type=int, default=0, help="nodes per job (0: every node of the cluster)")
    parser.add_argument("--slow-node", default="", help="the node slowed (default: the job's last node)")
    args = parser.parse_args()
    nodes = idle_nodes()[: args.nodes or None]
    slow = args.slow_node or nodes[-1]
    lines = []
    with tempfile.TemporaryDirectory(prefix="preflight-bench-") as root:
        for i, who in enumerate(interleaved(args.healthy, args.slowed, slow)):
            lines.append(run(i, nodes, who, Path(root)))
            harness.emit(lines[-1])
    for line in summary(lines, slow):
        harness.emit(line)


if __name__ == "__main__":
    main()
