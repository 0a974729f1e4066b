"""The local launcher stops every rank when one fails and says which one and why (with restarts
off: tests/faults has the supervisor's restarts)."""

import time

from support.cli_runner import mshpc, train_args


def test_a_rank_that_raises_is_named_with_its_error(tmp_path, corpus_cache):
    start = time.monotonic()
    out = mshpc(*train_args(tmp_path, corpus_cache, "train.steps=50", "supervisor.max_restarts=0"), "--nproc", "2",
                env={"MSHPC_TEST_FAULTS": "raise:rank=1:step=2"})
    assert out.returncode == 1
    last = out.stderr.strip().splitlines()[-1]
    assert last == "mshpc: rank 1 exited with code 1: RuntimeError: injected fault at rank 1 step 2"
    assert time.monotonic() - start < 120  # rank 0 was stopped, not left waiting in a collective


def test_a_killed_rank_is_named_with_its_signal(tmp_path, corpus_cache):
    out = mshpc(*train_args(tmp_path, corpus_cache, "train.steps=50", "supervisor.max_restarts=0"), "--nproc", "2",
                env={"MSHPC_TEST_FAULTS": "kill:rank=0:step=1"})
    assert out.returncode == 128 + 9
    assert out.stderr.strip().splitlines()[-1] == "mshpc: rank 0 was killed by SIGKILL"


def test_bad_world_fails_before_starting_ranks(tmp_path, corpus_cache):
    out = mshpc(*train_args(tmp_path, corpus_cache, "parallel.tp=2"), "--nproc", "3")
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [
        "mshpc: error: ConfigError: world size 3 is not divisible by parallel.tp*parallel.pp=2 "
        "(launch a multiple of 2 ranks)"
    ]
