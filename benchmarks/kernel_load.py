"""Claim: a rank whose kernel sources, flags and toolchain are unchanged readies the fused kernels
in a small fraction of what torch.utils.cpp_extension.load costs it (kernels/library_cache.py:
the kept library is loaded directly; no setuptools import, no ninja or compiler run).

Each round starts two fresh processes, in turns, that import torch and then ready the kernels:
the baseline as every rank did before (build._compile: cpp_extension.load, which finds the build
up to date, then the Python registrations), ours with build.load(). Reported: the median over
rounds of the CPU-s and wall seconds of that step alone, the torch import excluded.

    .venv/bin/python benchmarks/kernel_load.py [--rounds 7]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

from mshpc.bench import harness
from mshpc.bench.harness import REPO

PROBE = """
import json, resource, sys, time
import torch
from mshpc.kernels import build, ops
cpu = lambda: sum(resource.getrusage(w)[0] + resource.getrusage(w)[1]
                  for w in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))
c0, t0 = cpu(), time.perf_counter()
if sys.argv[1] == "cpp_extension":
    build._compile(build.recipe(build.want_cuda()), False)
    ops.register()
else:
    assert build.load().kept, "no kept library: run build.load() once first"
print(json.dumps({"cpu_s": cpu() - c0, "wall_s": time.perf_counter() - t0}))
"""


def ready_once(how: str) -> dict[str, float]:
    out = subprocess.run([sys.executable, "-c", PROBE, how], capture_output=True, text=True, check=True,
                         cwd=REPO, timeout=600)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    harness.add_rounds(parser, 7, "rounds; the two ways take turns in each")
    args = parser.parse_args()
    ready_once("kept")  # the first load keeps the library (a build, if the cache is cold)
    times: dict[str, list[dict[str, float]]] = {"cpp_extension": [], "kept": []}
    for order in harness.turns(list(times), args.rounds):
        for how in order:
            times[how].append(ready_once(how))
    for metric in ("cpu_s", "wall_s"):
        harness.emit({"bench": "kernel_load", "metric": f"rank_kernel_ready_{metric}_vs_cpp_extension_load", "unit": "s",
                      **harness.paired([t[metric] for t in times["kept"]], [t[metric] for t in times["cpp_extension"]]),
                      "load_avg": harness.load_average()})


if __name__ == "__main__":
    main()
