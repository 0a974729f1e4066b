"""Two runs with one run.name: while a supervised run trains, a second `mshpc train` of the same
name is refused at once with one line naming the first's host and PID, before it starts a rank or
writes a byte in the folder; the first ends as if alone."""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from support.cli_runner import REPO, mshpc, read_metrics, train_args
from support.fault_runs import STEPS, SUPERVISED, events, kinds

NAME = "shared"
# rank 0's forwards slowed from the second step on (~2 s a step here), so the first run is surely
# still training while the three second runs start and are refused (~15 s in all)
SLOW = "slow:rank=0:step=1:factor=200"
FIRST_METRIC_WAIT_S = 240.0  # start-up of 2 ranks on a shared 2-core machine


def _start_first(tmp_path: Path, cache: Path) -> tuple[subprocess.Popen, Path]:
    """The supervised 2-rank run of tests/support/fault_runs.py, as a process that runs on."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "PMI", "OMPI_"))}
    env["MSHPC_TEST_FAULTS"] = SLOW
    log = tmp_path / "first.log"
    argv = [*train_args(tmp_path, cache, *SUPERVISED, name=NAME), "--nproc", "2"]
    with log.open("w") as out:
        # its own process group, so a failed test stops its ranks too
        proc = subprocess.Popen([sys.executable, "-m", "mshpc", *argv], stdout=out, stderr=subprocess.STDOUT,
                                env=env, cwd=REPO, start_new_session=True)
    return proc, log


def _wait_for_training(proc: subprocess.Popen, run_dir: Path, log: Path) -> None:
    deadline = time.monotonic() + FIRST_METRIC_WAIT_S
    metrics = run_dir / "metrics.jsonl"
    while not (metrics.exists() and metrics.read_text().strip()):
        assert proc.poll() is None, f"the first run ended before training:\n{log.read_text()[-3000:]}"
        assert time.monotonic() < deadline, "the first run logged no step in time"
        time.sleep(0.1)


def _assert_refused(second: subprocess.CompletedProcess, holder_pid: int, ranks: int = 1) -> None:
    """Exit 2 with one line naming the holder: the last line, or with several ranks one of theirs
    (mpiexec interleaves them)."""
    assert second.returncode == 2, second.stderr[-3000:]
    lines = second.stderr.strip().splitlines()
    last = lines[-1] if ranks == 1 else next((line for line in lines if "RunLockError" in line), "")
    assert last.startswith("mshpc: error: RunLockError: ") and "is in use by another run" in last, last
    assert f"pid {holder_pid} on {socket.gethostname()}" in last, last
    assert "[rank " not in second.stderr, "a rank was started"


def _mpiexec() -> str:
    """The mpich wheel puts mpiexec beside the venv's python (`make test` installs it)."""
    found = shutil.which("mpiexec", path=f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}")
    if found is None:
        pytest.skip("mpiexec is not installed (pip install mpich)")
    return found


def _assert_alone(run_dir: Path) -> None:
    """What one run leaves: every step once in metrics and timings, no torn line, one story."""
    assert [r["step"] for r in read_metrics(run_dir)] == list(range(1, STEPS + 1))
    for timings in sorted((run_dir / "timings").glob("rank-*.jsonl")):
        lines = [json.loads(line) for line in timings.read_text().splitlines()]
        assert [r["step"] for r in lines if "step" in r] == list(range(1, STEPS + 1)), timings
    story = kinds(events(run_dir))
    assert story.count("supervisor_start") == 1 and story.count("attempt_start") == 1, story
    assert story[-1] == "run_end" and story.count("run_end") == 1, story
    assert events(run_dir)[-1]["outcome"] == "finished"


def test_a_second_run_of_the_same_name_is_refused_while_the_first_trains(tmp_path, corpus_cache):
    first, log = _start_first(tmp_path, corpus_cache)
    run_dir = tmp_path / NAME
    try:
        _wait_for_training(first, run_dir, log)
        args = train_args(tmp_path, corpus_cache, *SUPERVISED, name=NAME)
        # as the first was started (its supervisor holds the lock), and as one process (rank 0
        # takes the lock itself): both refused, naming the supervisor
        _assert_refused(mshpc(*args, "--nproc", "2", timeout_s=120), first.pid)
        _assert_refused(mshpc(*args, "--nproc", "1", timeout_s=120), first.pid)
        # two ranks of mpiexec, no supervisor: rank 0 is refused, rank 1 stops with it
        pair = mshpc(*args, timeout_s=120, launcher=(_mpiexec(), "-n", "2"))
        _assert_refused(pair, first.pid, ranks=2)
        assert first.poll() is None, "the first run ended before the second runs were refused: slow it more"
        assert first.wait(timeout=300) == 0, log.read_text()[-3000:]
    finally:
        if first.poll() is None:
            os.killpg(first.pid, signal.SIGKILL)
            first.wait()
    _assert_alone(run_dir)
    assert not (run_dir / ".lock").read_text(), "the lock outlived its run"
