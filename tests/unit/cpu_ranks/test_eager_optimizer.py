"""EagerOptimizer: on a CPU rank mshpc's optimizers work as torch's do without loading torch._dynamo
(about 2 s of CPU in every rank), and take torch's guarded path once it is loaded; elsewhere they
are torch's own."""

import importlib
import subprocess
import sys

import torch

from mshpc.cpu_ranks.eager_optimizer import EagerOptimizer
from mshpc.optim.lamb import Lamb
from mshpc.optim.multi_tensor import FusedAdamW

# a whole optimizer life in a fresh process: build, step, zero_grad, state_dict, load_state_dict
LIFE = """
import sys, torch
from mshpc.cpu_ranks.tunings import select_cpu_tunings
from mshpc.errors import KernelError
from mshpc.kernels import build
from mshpc.optim.lamb import Lamb
from mshpc.optim.multi_tensor import FusedAdamW
select_cpu_tunings(torch.device(sys.argv[1]))  # as a rank does at start-up
try:
    build.load()  # as a rank does first; without the kernels (the kernel tests say why) LAMB alone
    classes = (FusedAdamW, Lamb)
except KernelError:
    classes = (Lamb,)
w = torch.nn.Parameter(torch.ones(4))
for cls in classes:
    opt = cls([{"params": [w]}], lr=0.1)
    w.grad = torch.ones(4)
    opt.step()
    opt.zero_grad()
    cls([w], lr=0.1).load_state_dict(opt.state_dict())
    assert w.grad is None
print(sorted(m for m in sys.modules if m.startswith("torch._dynamo")))
"""


def test_a_whole_optimizer_life_leaves_dynamo_unloaded() -> None:
    out = subprocess.run([sys.executable, "-c", LIFE, "cpu"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == "[]"


def test_without_the_cpu_tunings_the_optimizers_are_torchs_own() -> None:
    # a GPU rank's choice ("meta" stands for a device that is not the CPU): torch's guarded methods
    out = subprocess.run([sys.executable, "-c", LIFE, "meta"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "'torch._dynamo'" in out.stdout


def test_state_dict_round_trip_equals_torchs_with_dynamo_loaded() -> None:
    importlib.import_module("torch._dynamo")  # loaded: the guarded path

    assert issubclass(FusedAdamW, EagerOptimizer)
    w = torch.nn.Parameter(torch.arange(4.0))
    ours = Lamb([w], lr=0.1)
    w.grad = torch.ones(4)
    ours.step()
    state = ours.state_dict()
    assert state == torch.optim.Optimizer.state_dict(ours)  # the same dict as torch's own code
    again = Lamb([torch.nn.Parameter(torch.zeros(4))], lr=0.5)
    again.load_state_dict(state)
    assert again.param_groups[0]["lr"] == 0.1
    assert torch.equal(again.state_dict()["state"][0]["exp_avg"], state["state"][0]["exp_avg"])
