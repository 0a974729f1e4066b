"""mshpc's real supervisor (monitor, detection, hang report, classification, eviction, restarts,
events) against 256 simulated ranks on 32 simulated nodes speaking the node-level heartbeat
protocol (benchmarks/scale/sim_nodes.py), one fault per attempt: a silent rank, a crashed node, a
stuck collective, then a straggler in an attempt that finishes."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

SIM_NODES = Path(__file__).resolve().parents[3] / "benchmarks" / "scale" / "sim_nodes.py"
WORLD = 256


def load_sim_nodes():
    """benchmarks/ is no package: the simulated nodes are loaded from their file."""
    spec = importlib.util.spec_from_file_location("sim_nodes", SIM_NODES)
    module = importlib.util.module_from_spec(spec)
    sys.modules["sim_nodes"] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_every_fault_among_256_ranks_is_detected_reported_and_its_node_evicted(tmp_path):
    sim = load_sim_nodes()
    timing = sim.Timing(interval_s=0.1, step_s=0.05, fault_at_s=0.8, finish_at_s=0.5, timeout_floor_s=2.2)
    # a floor past the dump wait's 2 s of silence: the frozen rank is not waited for (as with real timeouts)
    out = sim.supervise(WORLD, tmp_path / "run", seed=7, timing=timing)
    silent, crashed, stuck, _ = out.faults
    hosts = [f"node{i:05d}" for i in range(WORLD // 8 + 3)]

    assert out.code == 0 and out.of("run_end")[0]["outcome"] == "finished"
    assert [d["failure"] for d in out.of("failure_detected")] == ["hang", "crash", "hang"]
    assert all(a.registered_s is not None and a.registered_s < 10 for a in out.attempts)

    # the silent rank: found past its timeout within a second, named alone, its node evicted
    fired = out.attempts[0].fired_wall()
    first = out.of("failure_detected")[0]
    assert 0 <= first["time"] - fired - first["timeout_s"] < 1.0
    reports = out.of("hang_report")
    assert [(m["rank"], m["host"]) for m in reports[0]["missing"]] == [(silent.rank, hosts[silent.rank // 8])]
    assert reports[0]["missing"][0]["why"].startswith("silent for")
    assert (tmp_path / "run" / "hang-report.txt").exists()

    # the crashed node: a crash on one of its ranks; the stuck rank: missing from the collective
    assert out.of("failure_detected")[1]["host"] == hosts[crashed.rank]
    assert [m["rank"] for m in reports[1]["missing"]] == [stuck.rank]
    assert "missing from all_reduce" in reports[1]["missing"][0]["why"]

    # each blamed node evicted for a spare, in order; the restarts ran on the spares
    evicted = out.of("evicted")
    active = hosts[:WORLD // 8]
    blamed = [active[silent.rank // 8]]
    active[silent.rank // 8] = hosts[-3]
    blamed.append(active[crashed.rank])
    active[crashed.rank] = hosts[-2]
    blamed.append(active[stuck.rank // 8])
    assert [e["node"] for e in evicted] == blamed
    assert [e["replacement"] for e in evicted] == hosts[-3:]
    assert [f["fault_class"] for f in out.of("classified")] == ["node_fault", "node_fault", "unknown"]


def test_a_world_past_this_machine_stops_with_one_line_naming_the_largest():
    sim = load_sim_nodes()
    too_many = (sim.largest_world() // 8 + 1) * 8
    out = subprocess.run([sys.executable, str(SIM_NODES), "--n", "8", str(too_many)], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 1 and out.stdout == ""
    assert out.stderr.strip() == (f"sim_nodes: N={too_many} is past this machine: the largest N it holds is "
                                  f"{sim.largest_world()} (RLIMIT_NOFILE hard limit and local port range, one "
                                  "connection per node of 8)")


def test_the_simulated_beats_are_the_relays_batches():
    """The simulator builds its beats from serialized parts (1,536 nodes a second); they must be
    what mshpc/launch/node_relay.py sends."""
    from mshpc.launch.node_relay import beat_entry, beats_message

    sim = load_sim_nodes()
    clock = sim._Clock()
    ranks = [sim._Rank(r, sim.Fault("stuck", 9, 0.0), sim.Timing(), clock, sim._tp_group(1)) for r in range(8, 16)]
    clock.fired_wall, clock.now = 1.0, lambda: 3.0  # in the hang (rank 9 one collective behind), time stopped
    expected = beats_message([beat_entry(r.rank, r.beat(), 0.0) for r in ranks])
    got = json.loads(sim.beats_line(ranks))
    assert got == expected and got["beats"][1]["counts"]["world"] == got["beats"][0]["counts"]["world"] - 1
