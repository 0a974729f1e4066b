"""Claim: each fused kernel (csrc/) is faster than the eager PyTorch it replaces, on CPU (the
C++ twins) and on GPU (the CUDA kernels), and this file says how it compares with torch.compile
of the same reference. Forward + backward for the model's ops, one step for the optimizers.

Each case times the fused op, the eager reference (mshpc.kernels.reference; torch's AdamW and
mshpc's LAMB for the optimizers) and torch.compile of the reference, interleaved round by round
so that all three see the same machine load; the median round counts. Bandwidth is the least
number of bytes each op must move over its time, against the device's peak on GPU (table
below) and against a same-run tensor copy on CPU.

    .venv/bin/python benchmarks/fused_kernels.py [--device auto|cpu|cuda] [--rounds 7] [--no-compile]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from mshpc.bench import harness
from mshpc.config import ModelConfig
from mshpc.kernels import build, ops, reference
from mshpc.model.gpt import GPT, loss_fn
from mshpc.optim.multi_tensor import FusedAdamW
from mshpc.parallel.sharded_optim import FusedShardedLamb, ShardedLamb

# HBM peak GB/s per device (vendor datasheets, SXM parts).
PEAK_HBM_GBPS = {"H200": 4800.0, "H100": 3350.0, "A100": 2039.0}


@dataclass
class Case:
    name: str
    fused: Callable[[], object]
    baselines: dict[str, Callable[[], object]]  # "eager" first, then "compiled" and others
    bytes_moved: int  # the least the op must read and write


def fwd_bwd(fn: Callable, args: tuple, grad_of: int) -> Callable[[], None]:
    """Forward and backward of fn's outputs against fixed cotangents (made once)."""
    outs = fn(*args)
    outs = outs if isinstance(outs, tuple) else (outs,)
    cotangents = [torch.ones_like(o) for o in outs]
    targets = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad][:grad_of]

    def run() -> None:
        out = fn(*args)
        out = out if isinstance(out, tuple) else (out,)
        torch.autograd.grad(out, targets, cotangents)

    return run


def op_cases(device: str, dtype: torch.dtype, compile_ok: bool) -> list[Case]:
    tokens, d = (4096, 1024) if device == "cpu" else (16384, 4096)
    e = torch.tensor([], dtype=dtype).element_size()
    x, r = (torch.randn(tokens, d, device=device, dtype=dtype, requires_grad=True) for _ in range(2))
    w = torch.ones(d, device=device, requires_grad=True)
    b = torch.zeros(d, device=device, requires_grad=True)
    h = torch.randn(tokens, 4 * d, device=device, dtype=dtype, requires_grad=True)
    fb = torch.zeros(4 * d, device=device, requires_grad=True)
    gate_up = torch.randn(tokens, 2 * 4 * d, device=device, dtype=dtype, requires_grad=True)  # [gate | up]
    qk = torch.randn(tokens // 512, 512, 2 * d // 64, 64, device=device, dtype=dtype, requires_grad=True)
    cos, sin = torch.randn(512, 32, device=device), torch.randn(512, 32, device=device)
    specs = [  # name, fused fn, reference fn, args, bytes (fwd + bwd)
        ("add_rms_norm", ops.add_rms_norm, reference.add_rms_norm, (x, r, w, 1e-5), 8 * tokens * d * e),
        ("add_layer_norm", ops.add_layer_norm, reference.add_layer_norm, (x, r, w, b, 1e-5), 8 * tokens * d * e),
        ("bias_gelu", ops.bias_gelu, reference.bias_gelu, (h, fb), 5 * tokens * 4 * d * e),
        # forward reads gate and up, writes y; backward reads dy, gate and up, writes both gradients
        ("swiglu", ops.swiglu, reference.swiglu, (gate_up,), 8 * tokens * 4 * d * e),
        ("rope", ops.rope, reference.rope, (qk, cos, sin), 4 * qk.numel() * e),
    ]
    cases = []
    for name, fused, ref, args, nbytes in specs:
        baselines = {"eager": fwd_bwd(ref, args, 4)}
        if compile_ok:
            baselines["compiled"] = fwd_bwd(torch.compile(ref, dynamic=False), args, 4)
        cases.append(Case(f"{name}_fwd_bwd", fwd_bwd(fused, args, 4), baselines, nbytes))
    return cases


def shard_groups(device: str, n_tensors: int, numel: int) -> list[dict]:
    """ZeRO-style piece groups (decay and no-decay, each piece with its owner index)."""
    g = torch.Generator().manual_seed(0)
    params = [torch.randn(numel, generator=g).to(device) for _ in range(n_tensors)]
    for p in params:
        p.grad = torch.randn(numel, generator=g).to(device) * 1e-3
    half = n_tensors // 2
    return [{"params": params[:half], "weight_decay": 0.1, "owner": list(range(half))},
            {"params": params[half:], "weight_decay": 0.0, "owner": list(range(half, n_tensors))}]


def optimizer_cases(device: str, compile_ok: bool) -> list[Case]:
    """One step over a rank's ZeRO pieces: ours against the eager optimizers the engine uses
    otherwise, torch.compile of them, and torch's own fused AdamW."""
    n_tensors, numel = (48, 1 << 17) if device == "cpu" else (96, 1 << 20)
    kw = dict(lr=1e-3, betas=(0.9, 0.95), eps=1e-8)

    def groups() -> list[dict]:
        return shard_groups(device, n_tensors, numel)

    adamw = {"eager": torch.optim.AdamW(groups(), foreach=True, **kw).step,
             "torch_fused": torch.optim.AdamW(groups(), fused=True, **kw).step}
    lamb = {"eager": ShardedLamb(groups(), n_tensors, None, **kw).step}
    if compile_ok:
        adamw["compiled"] = torch.compile(torch.optim.AdamW(groups(), foreach=True, **kw).step)
        lamb["compiled"] = torch.compile(ShardedLamb(groups(), n_tensors, None, **kw).step)
    n = n_tensors * numel * 4
    return [
        Case("adamw_step", FusedAdamW(groups(), **kw).step, adamw, 7 * n),
        # the fused LAMB writes its direction into the gradients, the eager one leaves them: each
        # reads values of the same kind every round, so the times compare
        Case("lamb_step", FusedShardedLamb(groups(), n_tensors, None, **kw).step, lamb, 10 * n),
    ]


def model_case(device: str, mlp: str = "gelu") -> Case:
    """A whole training step's forward and backward of a small GPT: every op in place."""
    cfg = dict(vocab_size=257, seq_len=256, n_layer=4, n_head=4, d_model=256, mlp=mlp)
    models = {mode: GPT(ModelConfig(**cfg, fused_kernels=mode)).to(device) for mode in ("on", "off")}
    batch = torch.randint(0, 257, (8, 257), device=device)

    def step(model: GPT) -> Callable[[], None]:
        def run() -> None:
            loss_fn(model(batch[:, :-1]), batch[:, 1:]).backward()
        return run

    return Case("gpt_fwd_bwd" if mlp == "gelu" else f"gpt_{mlp}_fwd_bwd", step(models["on"]),
                {"eager": step(models["off"])}, 0)


def timed(fn: Callable[[], object], device: str, iters: int) -> float:
    if device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    if device == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / iters


def measure(case: Case, device: str, rounds: int) -> dict[str, list[float]]:
    """Each variant's seconds per call, one sample per round; the variants take turns in a round."""
    variants = {"fused": case.fused, **case.baselines}
    iters = {}
    for name, fn in variants.items():  # warm up (and compile), then size a round to ~0.2 s
        fn()
        one = max(timed(fn, device, 1), 1e-6)
        iters[name] = max(1, min(50, int(0.2 / one)))
    samples: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(rounds):
        for name, fn in variants.items():
            samples[name].append(timed(fn, device, iters[name]))
    return samples


def copy_gbps(device: str) -> float:
    """This device's tensor-copy bandwidth now (read + write), the CPU's practical ceiling."""
    src = torch.randn(1 << 25, device=device)
    dst = torch.empty_like(src)
    seconds = statistics.median(timed(lambda: dst.copy_(src), device, 5) for _ in range(5))
    return 2 * src.numel() * 4 / seconds / 1e9


def emit(case: Case, samples: dict[str, list[float]], device: str, dtype: str, peak_gbps: float | None) -> None:
    """A line per baseline (eager first, with the bandwidths, then compiled and others), its ratio
    with the paired-round interval; the bandwidth ceiling is the device's HBM peak on GPU, a
    same-run copy on CPU."""
    ceiling = "peak" if device == "cuda" else "copy"
    times = {name: statistics.median(s) for name, s in samples.items()}
    for baseline in case.baselines:
        line = {"bench": "kernels", "metric": f"{case.name}_time_vs_{baseline}", "unit": "s",
                **harness.paired(samples["fused"], samples[baseline], digits=7), "device": device, "dtype": dtype}
        if case.bytes_moved and baseline == "eager":
            gbps = case.bytes_moved / times["fused"] / 1e9
            line.update(achieved_gbps=round(gbps, 1), eager_gbps=round(case.bytes_moved / times["eager"] / 1e9, 1))
            if peak_gbps is not None:
                line.update({f"{ceiling}_gbps": round(peak_gbps, 1), f"fraction_of_{ceiling}": round(gbps / peak_gbps, 3)})
        harness.emit(line)


def peak_for(device: str) -> tuple[float | None, str]:
    if device != "cuda":
        gbps = copy_gbps(device)
        harness.emit(harness.record("kernels", "cpu_copy_bandwidth", gbps, "GB/s", digits=1,
                                    threads=torch.get_num_threads()))
        return gbps, "same-run tensor copy"
    name = torch.cuda.get_device_name()
    peak = next((v for k, v in PEAK_HBM_GBPS.items() if k in name.upper()), None)
    return peak, name


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    harness.add_rounds(parser, 7, "timed runs of each contender, taking turns; the median counts")
    parser.add_argument("--no-compile", action="store_true", help="skip the torch.compile baselines")
    parser.add_argument("--only", default="", help="run the cases whose name contains this, e.g. adamw")
    args = parser.parse_args()
    device = "cuda" if args.device == "auto" and torch.cuda.is_available() else args.device.replace("auto", "cpu")
    loaded = build.load()
    harness.emit(harness.record("kernels", "kernels_ready", loaded.built_s, "s", digits=2, cuda=loaded.cuda,
                                torch=torch.__version__, load_avg=harness.load_average()))
    with tempfile.TemporaryDirectory() as tmp:  # ShardedLamb all-reduces its norms: a group of one
        dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=0, world_size=1)
        try:
            peak, _ = peak_for(device)
            dtypes = [torch.float32] + ([torch.bfloat16] if device == "cuda" else [])
            cases = [(c, str(dt).split(".")[1]) for dt in dtypes for c in op_cases(device, dt, not args.no_compile)]
            cases += [(c, "float32") for c in optimizer_cases(device, not args.no_compile)]
            cases += [(model_case(device, mlp), "float32") for mlp in ("gelu", "swiglu")]
            for case, dtype in cases:
                if args.only not in case.name:
                    continue
                emit(case, measure(case, device, args.rounds), device, dtype, peak)
        finally:
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
