"""Local ranks are forked by the fork server (mshpc/launch/fork_server.py), which imports torch,
the train loop and DALI but must leave CUDA untouched: a forked child cannot use a context its
parent made. A rank forked on a GPU machine trains on the GPU. Skips without a GPU."""

import pytest
import torch
from support.cli_runner import read_metrics, train_args

from mshpc.launch.forked import ForkServer
from mshpc.launch.ports import free_port

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (a forked rank's CUDA)")


def test_a_forked_rank_trains_on_the_gpu(tmp_path):
    args = train_args(tmp_path, tmp_path / "cache", "train.steps=3", "train.device=cuda", "parallel.dp=1",
                      "checkpoint.interval_steps=0")
    server = ForkServer(args, {})
    try:
        rank = server.fork({"MSHPC_BOOTSTRAP": "env", "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1",
                            "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())})
        code = rank.wait(600)
        assert code == 0, rank.stderr.read().decode()[-3000:]
    finally:
        server.close()
    assert [row["step"] for row in read_metrics(tmp_path / "t")][-1] == 3
