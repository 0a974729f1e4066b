import pytest

from mshpc.errors import LaunchError
from mshpc.launch.env import check_world, read_launch_env


def test_single_process_when_nothing_is_set():
    env = read_launch_env({})
    assert (env.launcher, env.rank, env.world_size, env.local_rank) == ("single", 0, 1, 0)


def test_torchrun_style_variables():
    env = read_launch_env({"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
                           "MASTER_ADDR": "h1", "MASTER_PORT": "1234"})
    assert (env.launcher, env.rank, env.world_size, env.local_rank, env.local_world_size) == ("env", 3, 4, 1, 2)
    assert (env.master_addr, env.master_port) == ("h1", 1234)


def test_torchrun_without_master_is_an_error():
    with pytest.raises(LaunchError, match="MASTER_ADDR or MASTER_PORT"):
        read_launch_env({"RANK": "0", "WORLD_SIZE": "2"})


SRUN = {"SLURM_JOB_ID": "77", "SLURM_STEP_ID": "0", "SLURM_PROCID": "5", "SLURM_NTASKS": "6",
        "SLURM_LOCALID": "1", "SLURM_NODEID": "2", "SLURM_TASKS_PER_NODE": "2(x2),3",
        "SLURM_STEP_NODELIST": "n[1-3]", "SLURMD_NODENAME": "n3"}


def test_plain_srun():
    env = read_launch_env(SRUN)
    assert (env.launcher, env.rank, env.world_size, env.local_rank, env.node) == ("slurm", 5, 6, 1, "n3")
    assert env.local_world_size == 3  # third node of "2(x2),3"
    assert env.slurm.job_id == 77 and env.slurm.nodelist == "n[1-3]" and env.slurm.ntasks == 6


def test_mpi_markers_win_over_slurm():
    env = read_launch_env({**SRUN, "PMIX_RANK": "5"})
    assert env.launcher == "mpi"


def test_hydra_variables():
    env = read_launch_env({"PMI_RANK": "1", "PMI_SIZE": "2", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2"})
    assert (env.launcher, env.rank, env.world_size, env.local_rank) == ("mpi", 1, 2, 1)


def test_forced_bootstrap_and_bad_values():
    assert read_launch_env({**SRUN, "MSHPC_BOOTSTRAP": "slurm", "PMIX_RANK": "0"}).launcher == "slurm"
    with pytest.raises(LaunchError, match="choose mpi, slurm, env, single"):
        read_launch_env({"MSHPC_BOOTSTRAP": "pmi"})
    with pytest.raises(LaunchError, match="SLURM_PROCID='x' is not an integer"):
        read_launch_env({**SRUN, "SLURM_PROCID": "x"})


def test_world_must_match_slurm_ntasks():
    env = read_launch_env({**SRUN, "PMIX_RANK": "0"})
    check_world(env, 6)
    with pytest.raises(LaunchError, match="world size 1 but SLURM_NTASKS=6"):
        check_world(env, 1)
