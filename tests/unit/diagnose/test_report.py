"""`mshpc diagnose` on a run directory of synthetic timings over a 2 x 2 x 2 mesh: the summary,
the slowest dependencies in the mesh, and a page that opens from disk."""

import json

import yaml

from support.cli_runner import mshpc
from mshpc.config import load_config, to_dict
from mshpc.diagnose.analysis import analyse
from mshpc.events import append_event
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
