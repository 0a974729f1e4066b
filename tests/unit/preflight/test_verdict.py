"""Judging records: device-type limits, fleet-median rules, node verdicts, the exclude list."""

import json

from mshpc.preflight.record import Record
from mshpc.preflight.thresholds import load_thresholds
from mshpc.preflight.verdict import judge, table, verdict, write_exclude, write_json


def gemm(node: str, value: float, kind: str = "CPU") -> Record:
    return Record(node, "cpu/rank 0", "gemm_tflops", value, "TFLOP/s", kind=kind)


def status_of(records):
    return {(r.node, r.test): r.status for r in records}


def test_fleet_rule_fails_below_0_8_and_warns_below_0_9_of_the_median():
    values = {"n1": 1.0, "n2": 1.02, "n3": 0.98, "n4": 0.78, "n5": 0.88}  # median 0.98: fail < 0.784, warn < 0.882
    judged = judge([gemm(n, v) for n, v in values.items()], load_thresholds())
    assert status_of(judged) == {("n1", "gemm_tflops"): "pass", ("n2", "gemm_tflops"): "pass",
                                 ("n3", "gemm_tflops"): "pass", ("n4", "gemm_tflops"): "fail",
                                 ("n5", "gemm_tflops"): "warn"}
    assert "fail < 0.8 x median 0.98" in judged[3].threshold


def test_device_type_limits_name_their_source():
    judged = judge([gemm("a", 450.0, "H100"), gemm("b", 450.0, "A100")], load_thresholds())
    assert [(r.status, r.threshold.split(";")[0]) for r in judged] == [
        ("fail", "fail < 500, warn < 600 (H100)"), ("pass", "fail < 180, warn < 220 (A100)")]


def test_not_available_is_neither_pass_nor_fail_and_does_not_fail_a_node(tmp_path):
    records = [Record("n1", "cpu/rank 0", "nvml", None, "", "na",
                      detail="not available: NVML: NVML Shared Library Not Found"),
               gemm("n1", 1.0), gemm("n2", 1.0)]
    v = verdict(judge(records, load_thresholds()), ["n1", "n2"])
    assert v.records[0].status == "na" and v.nodes == {"n1": "pass", "n2": "pass"} and v.status == "pass"
    assert "NA" in table(v) and "not available: NVML" in table(v)


def test_failing_nodes_become_a_hostlist_and_a_group_failure_fails_only_the_run(tmp_path):
    records = [gemm("n1", 1.0), gemm("n2", 0.1), gemm("n3", 0.1), gemm("n5", 1.0), gemm("n4", 1.0),
               Record("n[1-5]", "ranks 0-4", "all_reduce_wrong_elements", 0.0, "", scope="group"),
               Record("n4", "rank 3", "gemm_rel_error", 7.9, "", kind="CPU")]
    v = verdict(judge(records, load_thresholds()), ["n1", "n2", "n3", "n4", "n5"])
    assert v.failed_nodes == ["n2", "n3", "n4"] and v.status == "fail"
    write_exclude(tmp_path / "exclude.txt", v)
    assert (tmp_path / "exclude.txt").read_text() == "n[2-4]\n"
    write_json(tmp_path / "v.json", v, {"level": "quick"})
    doc = json.loads((tmp_path / "v.json").read_text())
    assert doc["exclude"] == "n[2-4]" and doc["nodes"]["n1"] == "pass" and len(doc["records"]) == 7
    assert {"node", "device", "test", "value", "unit", "threshold", "status"} <= set(doc["records"][0])
    healthy = verdict(judge([gemm("n1", 1.0)], load_thresholds()), ["n1"])
    write_exclude(tmp_path / "exclude.txt", healthy)
    assert (tmp_path / "exclude.txt").read_text() == ""  # exists, empty: nothing to leave out


def test_only_the_largest_size_of_a_bus_bandwidth_is_judged():
    records = [Record("n1", "ranks 0-7", "intra_all_reduce_busbw_gbps", v, "GB/s", kind="H100", scope="node",
                      size_bytes=size) for size, v in [(1 << 20, 5.0), (1 << 30, 400.0)]]
    judged = judge(records, load_thresholds())
    assert [r.status for r in judged] == ["info", "pass"]
