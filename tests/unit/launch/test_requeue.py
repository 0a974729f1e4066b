"""The requeue guards and the signal watcher, in one process (the real cycle is in tests/slurm)."""

import logging
import os
import signal

import pytest
import torch.distributed as dist

from mshpc import cli
from mshpc.config import SlurmConfig
from mshpc.errors import USER_ERROR_EXIT
from mshpc.launch import requeue as rq
from mshpc.launch.env import read_launch_env

SRUN = {"SLURM_JOB_ID": "77", "SLURM_STEP_ID": "0", "SLURM_PROCID": "0", "SLURM_NTASKS": "1"}


def test_the_clis_user_error_code_is_not_requeued(tmp_path, caplog):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model:\n  n_layers: 2\n")
    code = cli.main(["train", str(bad)])
    assert code == USER_ERROR_EXIT
    with caplog.at_level(logging.INFO, logger="mshpc.launch.requeue"):
        rq.after_exit(code, read_launch_env({"SLURM_JOB_ID": "77"}), slurm=SlurmConfig(), run_dir=tmp_path / "run",
                      checkpoints=tmp_path / "run" / "checkpoints")
    assert f"not requeued: exit code {code} is a user error" in caplog.text
    assert not (tmp_path / "run" / rq.STATE_FILE).exists()  # no requeue was tried


def test_array_tasks_are_requeued_by_array_id_and_task():
    array = read_launch_env({**SRUN, "SLURM_ARRAY_JOB_ID": "70", "SLURM_ARRAY_TASK_ID": "3"})
    assert rq.job_key(array.slurm) == "70_3"
    assert rq.job_key(read_launch_env(SRUN).slurm) == "77"
    assert read_launch_env({**SRUN, "SLURM_RESTART_COUNT": "2"}).slurm.restart_count == 2


def test_failure_budget_counts_only_failures_without_a_newer_checkpoint():
    s = rq.account(None, "77", None)
    assert s.failures_without_progress == 1  # crashed before any checkpoint
    s = rq.account(s, "77", 100)
    assert s.failures_without_progress == 0 and s.checkpoint_step == 100  # progress resets it
    s = rq.account(rq.account(s, "77", 100), "77", 100)
    assert s.failures_without_progress == 2
    assert rq.account(s, "78", 100).failures_without_progress == 0  # a new job, a new budget


def test_finished_marker_names_the_job(tmp_path):
    rq.mark_finished(tmp_path, "77", 10)
    assert rq.finished_by(tmp_path, "77") and not rq.finished_by(tmp_path, "78")


def test_guard_check_rejects_a_bad_config_with_the_do_not_requeue_code(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model:\n  n_layers: 2\n")
    assert rq.main(["check", str(bad)]) == USER_ERROR_EXIT
    assert "ConfigError: unknown config key 'model.n_layers'" in capsys.readouterr().err


def test_after_success_marks_the_run_finished(tmp_path):
    rq.after_exit(0, read_launch_env({"SLURM_JOB_ID": "77"}), slurm=SlurmConfig(), run_dir=tmp_path / "run",
                  checkpoints=tmp_path / "run" / "checkpoints")
    assert rq.finished_by(tmp_path / "run", "77")


@pytest.fixture
def one_rank():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_watcher_turns_the_preempt_signal_into_a_requeue_at_the_step_boundary(one_rank, tmp_path):
    with rq.watch_signals(read_launch_env(SRUN), slurm=SlurmConfig(), run_dir=tmp_path,
                          checkpoints=tmp_path / "checkpoints") as watcher:
        assert watcher.should_stop() is None
        os.kill(os.getpid(), signal.SIGTERM)  # scancel: stop, no requeue
        assert watcher.should_stop() == rq.StopRequest(signal.SIGTERM, requeue=False)
        os.kill(os.getpid(), signal.SIGUSR2)  # the pre-timeout signal wins
        request = watcher.should_stop()
    assert request == rq.StopRequest(signal.SIGUSR2, requeue=True) and request.exit_code == 140
    assert signal.getsignal(signal.SIGUSR2) is signal.SIG_DFL  # handlers restored


def test_outside_slurm_sigterm_keeps_its_default_and_stop_raises_system_exit(one_rank, tmp_path):
    with rq.watch_signals(read_launch_env({}), slurm=SlurmConfig(preempt_signal="USR1"), run_dir=tmp_path / "run",
                          checkpoints=tmp_path / "run" / "checkpoints") as watcher:
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
        os.kill(os.getpid(), signal.SIGUSR1)
        request = watcher.should_stop()
        with pytest.raises(rq.JobStopped) as stopped:
            watcher.stop(request, 0)  # not under Slurm: nothing to requeue, just stop
    assert isinstance(stopped.value, SystemExit) and stopped.value.code == 128 + signal.SIGUSR1


def test_ctrl_c_asks_for_a_stop_checkpoint_and_a_second_one_stops_at_once(one_rank, tmp_path):
    # a rank outside any supervisor (`mshpc train` of one process): Ctrl-C as SIGTERM is under Slurm.
    # Python's own Ctrl-C handler first, as on a terminal: a test run started in the background
    # (`make test &`, nohup) inherits SIGINT ignored.
    inherited = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with rq.watch_signals(read_launch_env({}), slurm=SlurmConfig(), run_dir=tmp_path,
                              checkpoints=tmp_path / "checkpoints") as watcher:
            os.kill(os.getpid(), signal.SIGINT)
            assert watcher.should_stop() == rq.StopRequest(signal.SIGTERM, requeue=False)  # checkpoint, then exit
            with pytest.raises(KeyboardInterrupt):
                os.kill(os.getpid(), signal.SIGINT)
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # restored
    finally:
        signal.signal(signal.SIGINT, inherited)
