"""graph_breaks: the MoE layer's eager islands are marked for torch.compile only when compiling
starts, so an eager run never loads torch._dynamo (~1.4 CPU-s a rank); once marked, dynamo sees
each as disabled."""

import subprocess
import sys

# a tiny-moe model's forward and backward, eager, in a fresh process
EAGER_MOE = """
import sys, torch
import mshpc.train  # what a rank imports
from mshpc.config import load_config
from mshpc.model.gpt import GPT
cfg = load_config("configs/tiny-moe.yaml", ["model.n_layer=1"])
model = GPT(cfg.model)
idx = torch.randint(0, cfg.model.vocab_size, (2, 16))
out = model(idx)
(out[0] if isinstance(out, tuple) else out).float().sum().backward()
print(sorted(m for m in sys.modules if m.startswith("torch._dynamo")))
"""

MARKED = """
from mshpc import graph_breaks
from mshpc.model import moe
from mshpc.parallel import expert_dispatch as d
names = [moe._expert_loop, moe._grouped_gemms_eager, moe.MoE._record, d.AllToAllDispatch.start]
before = [getattr(f, "_torchdynamo_disable", False) for f in names]
graph_breaks.apply()
after = [getattr(f, "_torchdynamo_disable", False) for f in
         [moe._expert_loop, moe._grouped_gemms_eager, moe.MoE._record, d.AllToAllDispatch.start]]
print(before, after)
"""


def run(code: str) -> str:
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.strip()


def test_an_eager_moe_step_leaves_dynamo_unloaded() -> None:
    assert run(EAGER_MOE) == "[]"


def test_apply_marks_every_eager_island_for_dynamo() -> None:
    assert run(MARKED) == "[False, False, False, False] [True, True, True, True]"
