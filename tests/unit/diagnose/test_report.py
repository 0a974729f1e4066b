"""`mshpc diagnose` on a run directory of synthetic timings over a 2 x 2 x 2 mesh: the summary,
the slowest dependencies in the mesh, and a page that opens from disk."""

import json

import yaml

from support.cli_runner import mshpc
from mshpc.config import load_config, to_dict
from mshpc.diagnose.analysis import analyse
from mshpc.diagnose.report import summary_lines, write_report
from mshpc.events import append_event
from mshpc.mesh_shape import MeshShape
from support.synthetic_timings import MESH, synthetic, write_files

SLOW = 5  # pp=1, dp=0, tp=1


def make_run(run_dir):
    cfg = load_config(None, [f"parallel.pp={MESH.pp}", f"parallel.dp={MESH.dp}", f"parallel.tp={MESH.tp}",
                             "model.n_head=4", "run.name=mesh"])
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))
    records = synthetic(150, seed=2, slow_rank=SLOW, slow_from=40, factor=1.4)
    write_files(run_dir, records)
    with (run_dir / "metrics.jsonl").open("w") as f:
        for step, rec in records[0].items():
            tflops = 1.0 / rec["step_s"]
            val = {"val_loss": 5.5 - step / 100} if step % 50 == 0 else {}  # eval.interval_steps=50
            f.write(json.dumps({"step": step, "loss": 5.0 - step / 100, "tflops": tflops, "mfu": tflops / 4, **val}) + "\n")
    append_event(run_dir, "mfu_decline", step=60, median_tflops=2.6, best_tflops=3.0, drop=0.13)


def test_report_on_a_3d_mesh(tmp_path):
    run = tmp_path / "mesh"
    make_run(run)
    a = analyse(run)
    assert [s.rank for s in a.stragglers] == [SLOW] and a.ranks[0].info.rank == SLOW
    deps = {r.info.rank: r.dependency for r in a.ranks}
    # the slow rank's tp partner (4), dp partner (7) and pipeline neighbour (1) all wait on it
    assert (deps[4].rank, deps[4].group) == (SLOW, "tp")
    assert (deps[7].rank, deps[7].group) == (SLOW, "dp")
    assert (deps[1].rank, deps[1].group) == (SLOW, "pp")
    assert deps[0].rank != SLOW  # rank 0 (pp0 dp0 tp0) shares no group with rank 5

    out = mshpc("diagnose", str(run))
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].startswith(f"run {run}: 8 ranks (dp=2, tp=2, pp=2), steps 1-150")
    assert lines[2].startswith("  rank 5 on node1 (dp=0, tp=1, pp=1)") and "STRAGGLER since step" in lines[2]
    assert any(line.startswith("biggest phase: backward") for line in lines)
    # the peak is recovered from the logged (mfu, tflops) pairs: MFU, not TFLOP/s
    assert any(line.startswith("MFU trend: MFU 0.") and "1 decline event(s), first at step 60" in line
               for line in lines)
    assert "validation loss: 5 at step 50 -> 4 at step 150 (3 evaluations)" in lines
    page = (run / "report" / "index.html").read_text()
    assert page.count("<img src=") == 4 and "https://" not in page and "<script" not in page
    assert "r5 (tp)" in page  # rank 4's slowest dependency in the ranks table


def test_not_a_run_directory_is_a_one_line_error(tmp_path):
    out = mshpc("diagnose", str(tmp_path))
    assert out.returncode == 2
    assert out.stderr.strip() == f"mshpc: error: DiagnoseError: {tmp_path} is not a run directory " \
                                 "(no config.yaml; give runs/<run.name>)"


PAIR = MeshShape(pp=1, dp=2, tp=1)


def _pair_run(run_dir, records, mesh=PAIR):
    cfg = load_config(None, [f"parallel.dp={mesh.dp}", f"parallel.tp={mesh.tp}", f"parallel.pp={mesh.pp}",
                             "model.n_head=4", "run.name=pair"])
    run_dir.mkdir(exist_ok=True)
    (run_dir / "config.yaml").write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))
    write_files(run_dir, records, mesh=mesh, host=lambda r: "laptop")
    return cfg


def test_two_ranks_on_one_host_11_percent_apart_are_no_straggler_in_the_report(tmp_path):
    # two local ranks on one host's cores: one 12% slower in compute, as the other's work on the host
    # makes them in turn; the detector flags it (an event), the report does not cry straggler
    records = synthetic(120, seed=5, slow_rank=0, slow_from=20, factor=1.12, world=2)
    cfg = _pair_run(tmp_path / "pair", records)
    from mshpc.diagnose.stragglers import detect
    from mshpc.diagnose.timings import read_timings

    flagged = detect(read_timings(tmp_path / "pair"), cfg.diagnose)[0].current()
    assert [s.rank for s in flagged] == [0] and 0.85 < flagged[0].relative_score < 0.9
    a = analyse(tmp_path / "pair")
    assert a.stragglers == []
    out = mshpc("diagnose", str(tmp_path / "pair"))
    assert out.returncode == 0 and "STRAGGLER" not in out.stdout
    assert "no straggler: no rank is persistently slower than its peers below the warning floor (score < 0.75" in out.stdout


def test_a_flagged_rank_is_slower_than_its_peers_in_what_it_is_flagged_for(tmp_path):
    # rank 1 a third slower in compute: flagged, and its line gives the flagged category's score under 1
    records = synthetic(120, seed=6, slow_rank=1, slow_from=10, factor=1.6, world=2)
    _pair_run(tmp_path / "pair", records)
    a = analyse(tmp_path / "pair")
    assert [(s.rank, s.category) for s in a.stragglers] == [(1, "compute")] and a.stragglers[0].relative_score < 0.75
    flagged_line = next(line for line in summary_lines(a) if "STRAGGLER" in line)
    assert flagged_line.startswith("  rank 1 on laptop") and "(compute score 0." in flagged_line
    assert a.ranks[0].info.rank == 1 and a.ranks[0].relative_score < 1  # the slower rank, not the faster


def test_a_run_resumed_at_another_layout_is_diagnosed_at_its_last(tmp_path):
    # 4 ranks at dp=4 for 60 steps, then resumed on 2 ranks at dp=2 (config.yaml: the last layout)
    run = tmp_path / "relaid"
    _pair_run(run, synthetic(60, seed=7, world=4), mesh=MeshShape(pp=1, dp=4, tp=1))
    later = [{s + 60: {**r, "step": s + 60} for s, r in recs.items()} for recs in synthetic(40, seed=8, world=2)]
    _pair_run(run, later)
    index, lines = write_report(run)
    assert index.is_file() and (run / "report" / "mesh.png").is_file()
    assert lines[0].startswith(f"run {run}: 2 ranks (dp=2, tp=1, pp=1), steps 61-100")
    assert lines[1] == ("resumed at another layout: the per-rank view is of the last one (dp=2, tp=1, pp=1); "
                        "2 rank(s) trained only at an earlier one, left out")
