"""`mshpc preflight` on several CPU ranks: 4 local ranks pass the standard suite; 4 nodes emulated
by network namespaces, with one rank's GEMM slowed (4x), one rank's GEMM wrong and one node's
link rate-limited by tc, fail exactly those and nothing else; the quick level never calls
scontrol."""

import json
import os
import sys
from pathlib import Path

import pytest

from support.cli_runner import REPO, mshpc
from mshpc.bench.netns import Fabric, run_ranks, why_unavailable
from mshpc.launch.ports import free_port

THRESHOLDS = REPO / "tests/support/preflight_thresholds.yaml"
SHARED = ["--set", f"preflight.thresholds={THRESHOLDS}"]
OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "sendrecv")


def read(path: Path) -> dict:
    return json.loads(path.read_text())


def failures(doc: dict) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for r in doc["records"]:
        if r["status"] == "fail":
            out.setdefault(r["node"], set()).add(r["test"])
    return out


def test_four_local_ranks_pass_the_standard_suite(tmp_path):
    out = mshpc("preflight", "--nproc", "4", "--level", "standard", *SHARED, "--set", "preflight.burn_s=1",
                "--json", str(tmp_path / "v.json"), "--exclude-file", str(tmp_path / "exclude.txt"), timeout_s=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    doc = read(tmp_path / "v.json")
    assert (doc["status"], doc["ranks"], doc["exclude"]) == ("pass", 4, "") and set(doc["nodes"].values()) == {"pass"}
    assert (tmp_path / "exclude.txt").read_text() == ""
    tests = {(r["rank"], r["test"]) for r in doc["records"]}
    for rank in range(4):
        device_tests = ("gemm_tflops", "gemm_rel_error", "copy_gbps", "burn_tflops", "burn_errors")
        assert {(rank, t) for t in device_tests} <= tests
    checked = {r["test"]: r for r in doc["records"] if r["test"].endswith("_wrong_elements")}
    assert set(checked) == {f"{op}_wrong_elements" for op in OPS}
    assert all(r["value"] == 0 and r["status"] == "pass" for r in checked.values())
    busbw = [r for r in doc["records"] if r["test"] == "intra_all_reduce_busbw_gbps"]
    assert sorted(r["size_bytes"] for r in busbw) == [64 << 10, 1 << 20, 4 << 20] and all(r["value"] > 0 for r in busbw)
    nvml = [r for r in doc["records"] if r["test"] == "nvml"]
    assert len(nvml) == 4 and all(r["status"] == "na" and "not available" in r["detail"] for r in nvml)
    assert "preflight: PASS" in out.stdout


def run_on_fabric(fabric: Fabric, args: list[str], env: dict[str, str]) -> list[int]:
    """`mshpc ARGS` as one rank per namespace (node pf<i+1>), bootstrapped like torchrun."""
    port, n = free_port(), len(fabric.ns)
    commands = []
    for i in range(n):
        prefix, net_env = fabric.prefix(i, hostname=f"pf{i + 1}")
        commands.append(([*prefix, sys.executable, "-m", "mshpc", *args], {
            **net_env, **env, "RANK": str(i), "WORLD_SIZE": str(n), "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
            "MASTER_ADDR": fabric.addr(0), "MASTER_PORT": str(port), "MSHPC_BOOTSTRAP": "env"}))
    done = run_ranks(commands, timeout_s=600, ok_codes=(0, 3))
    for i, result in enumerate(done):
        print(f"--- rank {i}\n{result.stdout[-2000:]}{result.stderr[-2000:]}")
    return [result.returncode for result in done]


@pytest.mark.skipif(why_unavailable() is not None, reason=f"no network namespaces here: {why_unavailable()}")
def test_injected_faults_fail_exactly_their_rank_node_and_link(tmp_path):
    # the quick level (no burn): the same tests, and the suite's time stays small
    with Fabric("mpf", 4) as fabric:
        fabric.set_rate(3, 200)  # node pf4's link: 25 MB/s each way; unlimited links run at ~100s of MB/s
        codes = run_on_fabric(fabric, ["preflight", "--level", "quick", *SHARED, "--json", str(tmp_path / "v.json"),
                                       "--exclude-file", str(tmp_path / "exclude.txt")],
                              {"MSHPC_TEST_FAULTS": "gemm_slow:rank=1;gemm_wrong:rank=2"})
    assert codes == [3, 3, 3, 3]  # every rank knows the verdict
    doc = read(tmp_path / "v.json")
    assert doc["nodes"] == {"pf1": "pass", "pf2": "fail", "pf3": "fail", "pf4": "fail"}
    assert (tmp_path / "exclude.txt").read_text() == "pf[2-4]\n"
    failed = failures(doc)
    assert set(failed) == {"pf2", "pf3", "pf4"}  # nothing on pf1, no group-level failure
    assert failed["pf2"] == {"gemm_tflops"}
    assert failed["pf3"] == {"gemm_rel_error"}
    assert failed["pf4"] == {"link_gbps", "pair_gbps"}
    slow_pairs = {r["device"] for r in doc["records"] if r["test"] == "pair_gbps" and r["status"] == "fail"}
    assert slow_pairs == {"pf1<->pf4", "pf2<->pf4", "pf3<->pf4"}  # each blamed on pf4 alone
    # confirmed before excluding: pf4's pairs measured again, every sample slow; the slowed GEMM
    # slow in every repetition
    confirmed = [r for r in doc["records"] if r["status"] == "fail" and r["test"] in ("link_gbps", "pair_gbps",
                                                                                     "gemm_tflops")]
    assert confirmed and all((len(r["samples"]), r["failed"]) == (3, 3) for r in confirmed), confirmed
    wrong = next(r for r in doc["records"] if r["node"] == "pf3" and r["test"] == "gemm_rel_error")
    assert wrong["value"] > 1 and wrong["rank"] == 2


def test_quick_level_never_calls_scontrol_and_drain_refuses_it(tmp_path):
    spy = tmp_path / "bin"
    spy.mkdir()
    for tool in ("scontrol", "sinfo", "sbatch", "srun"):
        (spy / tool).write_text(f"#!/bin/sh\necho {tool} \"$@\" >> {tmp_path}/called\n")
        (spy / tool).chmod(0o755)
    env = {"PATH": f"{spy}:{os.environ['PATH']}"}
    out = mshpc("preflight", "--level", "quick", "--exclude-file", str(tmp_path / "exclude.txt"), env=env)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert (tmp_path / "exclude.txt").read_text() == "" and not (tmp_path / "called").exists()
    refused = mshpc("preflight", "--level", "quick", "--drain", env=env)
    assert refused.returncode == 2 and not (tmp_path / "called").exists()
    assert "ConfigError: --drain cannot run with --level quick" in refused.stderr
