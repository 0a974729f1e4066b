"""mshpc's real supervisor recovering in place among 64 simulated ranks on 8 simulated nodes
(benchmarks/scale/sim_in_place.py): one rank ends, the supervisor names it, its buddy on the next
node, tells every other rank to rejoin and brings a replacement up; the run finishes."""

import importlib.util
import sys
from pathlib import Path

SIM = Path(__file__).resolve().parents[3] / "benchmarks" / "scale" / "sim_in_place.py"


def test_one_rank_of_64_is_replaced_in_place_and_the_run_finishes(tmp_path):
    spec = importlib.util.spec_from_file_location("sim_in_place", SIM)
    sim = importlib.util.module_from_spec(spec)
    sys.modules["sim_in_place"] = sim
    spec.loader.exec_module(sim)
    sim.INTERVAL_S, sim.STEP_S, sim.FAULT_AT_S, sim.FINISH_AFTER_S = 0.1, 0.05, 1.0, 1.0
    events = sim.supervise(64, tmp_path / "run", lost=35)
    found = sim.figures(64, 35, events)
    assert found["checks"] == {"replaced": True, "buddy": 43, "buddy_on_next_node": True, "outcome": "finished"}
    kinds = [e["kind"] for e in events]
    assert kinds.count("recover_in_place") == 1 and "restart" not in kinds
    told = next(e for e in events if e["kind"] == "recover_in_place")
    assert told["store_rank"] == 0 and len(told["kept"]) == 63
    assert 0 <= found["in_place_decision_s"] < 1 and 0 < found["generation_ready_s"] < 5
