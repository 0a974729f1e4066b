"""The seam's one choice: a CPU rank runs every CPU-rank tuning, a GPU rank none, and the choice is
one line of the log. Each case in a fresh interpreter: the choice is process-wide."""

import subprocess
import sys

CHOOSE = """
import logging, sys, torch
logging.basicConfig(level=logging.INFO, format="%(message)s")
from mshpc.cpu_ranks import tunings
from mshpc.parallel import comm
before = comm.transport().name
chosen = tunings.select_cpu_tunings(torch.device(sys.argv[1]))
assert chosen == tunings.active()
print(before, comm.transport().name, chosen.p2p_collectives, chosen.shared_buckets, chosen.eager_optimizer)
"""


def _choose(device: str) -> tuple[str, str]:
    out = subprocess.run([sys.executable, "-c", CHOOSE, device], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.strip(), out.stderr


def test_a_cpu_rank_takes_every_tuning_and_says_so():
    chosen, log = _choose("cpu")
    assert chosen == "torch gloo point-to-point True True True"
    assert log.count("CPU rank tunings (mshpc/cpu_ranks)") == 1
    assert "gloo reduce-scatter and all-gather point-to-point" in log


def test_a_gpu_rank_keeps_torchs_own_path():
    # "meta" stands for any device that is not the host's CPU
    chosen, log = _choose("meta")
    assert chosen == "torch torch False False False"
    assert log.count("GPU rank: torch's collectives, private buckets, no CPU-rank tunings") == 1
