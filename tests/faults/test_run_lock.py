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
from support.cli_runner import REPO, read_metrics, train_args
from support.fault_runs import STEPS, SUPERVISED, events, kinds

NAME = "shared"
# Rank 1 stops itself (SIGSTOP) at the start of step 3, after two steps are logged: the first run
# is surely mid-training, holding its lock, while the second runs are refused, whatever the load.
# The test resumes it (SIGCONT) well within the hang timeout (SUPERVISED's 60 s floor).
PAUSE = "stop:rank=1:step=2:attempt=0"
START_WAIT_S = 240.0  # start-up of 2 ranks on a shared 2-core machine
SECOND_TIMEOUT_S = 45.0  # all three second runs together; each is refused in seconds


def _start(argv: list[str], env: dict[str, str] | None = None, launcher: tuple[str, ...] = (),
           **popen) -> subprocess.Popen:
    """The real `mshpc ARGV` as a process that runs on (the environment support/cli_runner gives)."""
    full_env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "PMI", "OMPI_"))}
    return subprocess.Popen([*launcher, sys.executable, "-m", "mshpc", *argv], env={**full_env, **(env or {})},
                            cwd=REPO, text=True, **popen)


def _stopped_rank(run_dir: Path) -> int | None:
    """The PID of the rank that stopped itself, once it is stopped and steps 1-2 are logged (rank 0
    cannot log step 3 without it)."""
    try:
        logged = len(read_metrics(run_dir))
        pid = next(e["pid"] for e in events(run_dir) if e["kind"] == "fault_injected")
    except (FileNotFoundError, StopIteration, ValueError):  # not yet, or a line caught mid-write
        return None
    state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    return pid if state == "T" and logged >= 2 else None


def _wait_for_pause(first: subprocess.Popen, run_dir: Path, log: Path) -> int:
    deadline = time.monotonic() + START_WAIT_S
    while (pid := _stopped_rank(run_dir)) is None:
        assert first.poll() is None, f"the first run ended before its pause:\n{log.read_text()[-3000:]}"
        assert time.monotonic() < deadline, "the first run did not reach its pause in time"
        time.sleep(0.1)
    return pid


def _mpiexec() -> str:
    """The mpich wheel puts mpiexec beside the venv's python (`make test` installs it)."""
    found = shutil.which("mpiexec", path=f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}")
    if found is None:
        pytest.skip("mpiexec is not installed (pip install mpich)")
    return found


def _assert_refused(second: subprocess.Popen, holder_pid: int, ranks: int = 1) -> None:
    """Exit 2 with one line naming the holder: the last line, or with several ranks one of theirs
    (mpiexec interleaves them); no rank of a supervisor started."""
    _, stderr = second.communicate(timeout=SECOND_TIMEOUT_S)
    assert second.returncode == 2, stderr[-3000:]
    lines = stderr.strip().splitlines()
    line = lines[-1] if ranks == 1 else next((t for t in lines if "RunLockError" in t), "")
    assert line.startswith("mshpc: error: RunLockError: ") and "is in use by another run" in line, line
    assert f"pid {holder_pid} on {socket.gethostname()}" in line, line
    assert "[rank " not in stderr, "a rank was started"


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
    assert not (run_dir / ".lock").read_text(), "the lock outlived its run"


def test_a_second_run_of_the_same_name_is_refused_while_the_first_trains(tmp_path, corpus_cache):
    args = train_args(tmp_path, corpus_cache, *SUPERVISED, name=NAME)
    run_dir, log = tmp_path / NAME, tmp_path / "first.log"
    with log.open("w") as out:  # killed if the test fails: its ranks die with it (PR_SET_PDEATHSIG)
        first = _start([*args, "--nproc", "2"], {"MSHPC_TEST_FAULTS": PAUSE}, stdout=out,
                       stderr=subprocess.STDOUT)
    seconds: list[subprocess.Popen] = []
    try:
        paused = _wait_for_pause(first, run_dir, log)
        logged = read_metrics(run_dir)
        # as the first was started (its supervisor holds the lock), as one process (rank 0 takes
        # the lock itself), and as two mpiexec ranks without a supervisor (rank 1 stops with rank 0)
        pipes = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE}
        seconds += [_start([*args, "--nproc", "2"], **pipes), _start([*args, "--nproc", "1"], **pipes),
                    _start(args, launcher=(_mpiexec(), "-n", "2"), **pipes)]
        for second, ranks in zip(seconds, (1, 1, 2), strict=True):
            _assert_refused(second, first.pid, ranks)
        assert read_metrics(run_dir) == logged, "a second run wrote into the first's metrics"
        os.kill(paused, signal.SIGCONT)
        assert first.wait(timeout=300) == 0, log.read_text()[-3000:]
    finally:
        for proc in [*seconds, first]:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    _assert_alone(run_dir)
