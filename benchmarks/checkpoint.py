"""Claim: an mshpc checkpoint costs the train loop almost nothing and persists near disk speed.

One run, one state (>= 1 GiB of fp32 "parameters + Adam moments"), side by side: blocking
time of mshpc's two-stage save vs torch.save (the median of `--rounds` saves each) vs
torch.distributed.checkpoint (sync and async_save); mshpc's full persist throughput vs the
disk's own sequential write bandwidth (dd, direct I/O, same size, same folder); restore time
of each in a fresh process with none of its files in the page cache. Then, at dp=2 and dp=8,
a training save's stage 1 on its slowest rank with the whole weights spread over the dp ranks
vs all on dp rank 0.

mshpc's stage 1 overlaps the forward and backward of the step after the save, so its blocking
time is measured as in training: the save call, then that forward and backward (of MODEL, whose
fp32 weights and Adam moments are about the state's size, on one sequence: the smallest batch,
the least time to hide the copy in), then the wait of the step's update for stage 1. In the same
rounds, the same save with stage 1 finished before the forward starts (copy first: the blocking
time had stage 1 not overlapped), and for both the whole time from the save to the update:
hiding the copy is no gain where the copy and stage 2 slow the forward and backward down as
much, on a machine whose cores are all computing. And the forward and backward during a save
vs alone.

Cold cache, the same for every reader: before each restore the files it will read are fsynced
and evicted with POSIX_FADV_DONTNEED (no root needed, and unlike drop_caches it leaves the other
users of a shared machine their cache), and `fincore` confirms that none of their pages is
resident (`resident_bytes` in the restore lines). Restores run in `--rounds` rounds, each
starting with another reader, so that neither side is always the first to read after the
writes; each line reports the median and every sample.

    .venv/bin/python benchmarks/checkpoint.py [--gib 1.0] [--rounds 3] [--dir /tmp/mshpc-ckpt-bench] [--device cuda]
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from mshpc.bench import harness
from mshpc.checkpoint.manifest import read_manifest
from mshpc.checkpoint.paths import step_dir
from mshpc.checkpoint.reader import CheckpointReader
from mshpc.checkpoint.saver import CheckpointSaver, HostSnapshot, SaveTarget
from mshpc.checkpoint.state import model_slices
from mshpc.config import ModelConfig
from mshpc.model.gpt import GPT, loss_fn
from mshpc.tensor_slice import TensorSlice

TENSOR_MB = 64  # per tensor, like one large weight matrix or its moment
MODEL = ModelConfig(n_layer=8, d_model=1024, n_head=16, seq_len=128)  # 101M parameters: 1.13 GiB with Adam


def make_state(gib: float, device: str = "cpu") -> dict[str, torch.Tensor]:
    """At least `gib` GiB: groups of (weight, exp_avg, exp_avg_sq) of TENSOR_MB each, on `device`
    (on a GPU, as in training: stage 1 is then a D2H copy into pinned memory)."""
    groups = max(1, math.ceil(gib * 1024 / (3 * TENSOR_MB)))
    numel = TENSOR_MB * 2**20 // 4
    return {f"{kind}/w{i}": torch.randn(numel, device=device)
            for i in range(groups) for kind in ("model", "exp_avg", "exp_avg_sq")}


def evict(path: Path) -> int | None:
    """Drop `path`'s files (a file or a folder's) from the page cache; return how many of their
    bytes are still resident there (None where `fincore` is missing)."""
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)  # dirty pages cannot be dropped
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    if shutil.which("fincore") is None:
        return None
    out = subprocess.run(["fincore", "--bytes", "--noheadings", "--raw", "--output", "RES", *map(str, files)],
                         check=True, capture_output=True, text=True).stdout
    return sum(int(x) for x in out.split())


def dd_write_gbps(folder: Path, nbytes: int) -> float:
    target = folder / "dd.bin"
    count = max(1, nbytes // 2**20)
    start = time.perf_counter()
    subprocess.run(["dd", "if=/dev/zero", f"of={target}", "bs=1M", f"count={count}", "oflag=direct",
                    "conv=fsync", "status=none"], check=True)
    elapsed = time.perf_counter() - start
    target.unlink()
    return count * 2**20 / elapsed / 1e9


def forward_backward(device: str) -> Callable[[], float]:
    """The next step's forward and backward: MODEL on one sequence. Returns a function that runs
    it and returns its seconds (on a GPU, until the compute stream is done: not the copy's)."""
    torch.manual_seed(0)
    model = GPT(MODEL).to(device)
    tokens = torch.randint(0, MODEL.vocab_size, (1, MODEL.seq_len + 1), device=device)

    def run() -> float:
        start = time.perf_counter()
        loss_fn(model(tokens[:, :-1]), tokens[:, 1:]).backward()
        if device == "cuda":
            torch.cuda.current_stream().synchronize()
        return time.perf_counter() - start

    run()  # warm-up: the first backward builds its buffers
    return run


def bench_mshpc(state: dict[str, torch.Tensor], root: Path, rounds: int,
                next_step: Callable[[], float]) -> dict[str, Any]:
    group = dist.new_group(backend="gloo")
    # keep every save: pruning the oldest (freeing its blocks) is housekeeping after the commit,
    # not persisting, and would land in the next save's persist time
    target = SaveTarget(root=root, keep=3 * rounds + 1, layout={"dp": 1, "tp": 1, "pp": 1}, config_hash="bench")
    saver = CheckpointSaver(target, rank=0, group=group, async_save=True)
    slices = {k: TensorSlice.whole(v) for k, v in state.items()}
    tensors = list(state.values())
    steps = iter(range(1, 3 * rounds + 2))

    def wait_stage1() -> float:
        start = time.perf_counter()
        saver.release()
        if tensors[0].is_cuda:  # the stream waits on the device: time that wait too
            torch.cuda.current_stream().synchronize()
        return time.perf_counter() - start

    def save_in_training(overlap: bool) -> tuple[float, float]:
        """A save, the next forward and backward, the update: the seconds the loop was blocked
        (the save call, then the update's wait for stage 1) and the forward and backward took.
        Without overlap stage 1 ends before the forward starts, as a blocking copy would."""
        blocked = saver.save(next(steps), slices, extras={})
        if not overlap:
            blocked += wait_stage1()
        seconds = next_step()
        blocked += wait_stage1()
        torch._foreach_add_(tensors, 1.0)  # the update writes every tensor of the state
        saver.wait()
        return blocked, seconds

    # The first save also allocates the host buffers that every later save reuses; a training
    # run saves many times, so the steady state is the later saves.
    first_blocking, _ = save_in_training(overlap=True)
    overlapped: list[tuple[float, float]] = []
    copy_first: list[tuple[float, float]] = []
    for r in range(rounds):  # alternating which goes first
        for overlap in (r % 2 == 0, r % 2 == 1):
            (overlapped if overlap else copy_first).append(save_in_training(overlap))
    alone = [next_step() for _ in range(rounds)]
    persist = []
    for _ in range(rounds):  # persist alone: a save and its wait
        start = time.perf_counter()
        saver.save(next(steps), slices, extras={})
        saver.wait()
        persist.append(time.perf_counter() - start)
    return {"first_blocking_s": first_blocking, "overlapped": overlapped, "copy_first": copy_first,
            "fwd_bwd_alone_s": alone, "persist_s": persist, "path": step_dir(root, 3 * rounds + 1)}


def bench_torch_save(state: dict[str, torch.Tensor], folder: Path, rounds: int) -> dict[str, Any]:
    """Each round writes a new file, as a job saving step after step does (overwriting one file
    is slower on ext4: it frees the old blocks first), and starts with none of the file system's
    pages dirty, as mshpc's saves do (O_DIRECT); the older file is deleted outside the timing."""
    blocking, path = [], None
    for r in range(rounds):
        previous, path = path, folder / f"state-{r}.pt"
        start = time.perf_counter()
        torch.save(state, path)
        blocking.append(time.perf_counter() - start)
        evict(path)
        if previous is not None:
            previous.unlink()
    return {"blocking_s": blocking, "path": path}


def bench_dcp(state: dict[str, torch.Tensor], folder: Path) -> dict[str, float]:
    start = time.perf_counter()
    dcp.save(state, checkpoint_id=str(folder / "sync"))
    sync_s = time.perf_counter() - start
    start = time.perf_counter()
    future = dcp.async_save(state, checkpoint_id=str(folder / "async"))
    async_blocking = time.perf_counter() - start
    future.result()
    async_persist = time.perf_counter() - start
    return {"sync_s": sync_s, "async_blocking_s": async_blocking, "async_persist_s": async_persist,
            "path": folder / "sync"}


def restore_in_fresh_process(kind: str, path: Path, device: str) -> tuple[float, int | None]:
    """A restore happens after a restart: time it in a new process, from a cold page cache."""
    resident = evict(path)
    out = subprocess.run([sys.executable, __file__, "--restore", kind, str(path), "--device", device],
                         check=True, capture_output=True, text=True)
    return float(out.stdout.split()[-1]), resident


def restore_rounds(paths: dict[str, Path], rounds: int, device: str) -> dict[str, list[tuple[float, int | None]]]:
    """Every reader `rounds` times; round r starts with reader r (mod their number)."""
    kinds = list(paths)
    samples: dict[str, list[tuple[float, int | None]]] = {k: [] for k in kinds}
    for r in range(rounds):
        for kind in kinds[r % len(kinds):] + kinds[:r % len(kinds)]:
            samples[kind].append(restore_in_fresh_process(kind, paths[kind], device))
    return samples


def restore(kind: str, path: Path, device: str) -> float:
    """Read every tensor of the state into freshly allocated memory on `device`, as a restarted
    job does."""
    if device == "cuda":
        torch.cuda.init()  # the context's start-up is no part of a restore
    start = time.perf_counter()
    if kind == "mshpc":
        reader = CheckpointReader(path, read_manifest(path))
        reader.load(reader.entries_for([reader.whole(name) for name in reader.names()]))  # as a resume does
        state = {name: reader.read_whole(name).to(device) for name in reader.names()}
        reader.close()
    elif kind == "torch":
        state = torch.load(path, weights_only=True, map_location=device)
    else:
        meta = dcp.FileSystemReader(str(path)).read_metadata()
        state = {name: torch.empty(m.size, dtype=m.properties.dtype, device=device)
                 for name, m in meta.state_dict_metadata.items()}
        dcp.load(state, checkpoint_id=str(path))
    if device == "cuda":
        torch.cuda.synchronize()
    assert state
    return time.perf_counter() - start


def stage1_seconds(slices: dict[str, TensorSlice], repeats: int = 3) -> float:
    """One rank's steady-state stage 1: the median of `repeats` copies into its host buffers,
    after the first (which allocates them)."""
    snapshot = HostSnapshot()
    snapshot.take(slices)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        snapshot.take(slices)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def bench_weights_spread(dp: int, device: str) -> dict[str, Any]:
    """A training save at `dp`: each rank copies its 1/dp of the fp32 masters and Adam moments
    (stand-ins of the ZeRO shards' size) plus the whole weights it saves for inference. Spread
    (state.model_slices) vs dp rank 0 saving all of them; the save blocks the loop until its
    slowest rank's stage 1 is done, so each side's figure is its slowest rank's. The ranks are
    timed one after another here, as on separate hosts they would run side by side."""
    model = GPT(MODEL).to(device)
    n = sum(p.numel() for p in model.parameters())
    zero = {f"{kind}/shard": TensorSlice(torch.randn(n // dp, device=device), (n,), 0)
            for kind in ("master", "optim.exp_avg", "optim.exp_avg_sq")}
    spread = [stage1_seconds({**zero, **model_slices(model, dp_rank=r, dp=dp)}) for r in range(dp)]
    rank0 = [stage1_seconds({**zero, **(model_slices(model) if r == 0 else {})}) for r in range(dp)]
    return {"spread": max(spread), "rank0": max(rank0), "params": n}


def samples_line(metric: str, ours: list[float], theirs: list[float]) -> dict[str, Any]:
    """Medians, with every sample beside them (the two kinds ran one after the other, not in
    turns, so no paired interval)."""
    return line(metric, statistics.median(ours), "s", statistics.median(theirs),
                samples=[round(t, 3) for t in ours], baseline_samples=[round(t, 3) for t in theirs])


def line(metric: str, value: float, unit: str, baseline: float, **extra: object) -> dict[str, Any]:
    return harness.record("checkpoint", metric, value, unit, baseline, **extra)


def restore_line(baseline: str, ours: list[tuple[float, int | None]],
                 theirs: list[tuple[float, int | None]]) -> dict[str, Any]:
    """The readers took turns round by round (restore_rounds), so the ratio has a paired interval."""
    low, high = harness.paired_round_interval([[t] for t, _ in ours], [[t] for t, _ in theirs])
    return line(f"restore_time_vs_{baseline}", statistics.median(t for t, _ in ours), "s",
                statistics.median(t for t, _ in theirs), ratio_90pct=[round(low, 3), round(high, 3)],
                samples=[round(t, 3) for t, _ in ours], baseline_samples=[round(t, 3) for t, _ in theirs],
                resident_bytes=[r for _, r in ours], baseline_resident_bytes=[r for _, r in theirs])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gib", type=float, default=1.0, help="state size in GiB (at least)")
    harness.add_rounds(parser, 3, "saves and restores of each kind")
    parser.add_argument("--dir", type=Path, default=Path("/tmp/mshpc-ckpt-bench"))
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where the state lives")
    parser.add_argument("--restore", nargs=2, metavar=("KIND", "PATH"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.restore:
        print(restore(args.restore[0], Path(args.restore[1]), args.device))
        return
    shutil.rmtree(args.dir, ignore_errors=True)
    args.dir.mkdir(parents=True)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    state = make_state(args.gib, args.device)
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    try:
        disk = dd_write_gbps(args.dir, nbytes)
        ours = bench_mshpc(state, args.dir / "mshpc", args.rounds, forward_backward(args.device))
        plain = bench_torch_save(state, args.dir, args.rounds)
        ref = bench_dcp(state, args.dir / "dcp")
        del state
        restores = restore_rounds({"mshpc": ours["path"], "dcp": ref["path"], "torch": plain["path"]}, args.rounds,
                                  args.device)
    finally:
        dist.destroy_process_group()
        shutil.rmtree(args.dir, ignore_errors=True)
    spreads = {dp: bench_weights_spread(dp, args.device) for dp in (2, 8)}
    harness.emit(harness.record("checkpoint", "state_size", nbytes / 2**30, "GiB", digits=3, device=args.device,
                                load_avg=harness.load_average()))
    blocking_s = [b for b, _ in ours["overlapped"]]
    blocking, persist = statistics.median(blocking_s), statistics.median(ours["persist_s"])
    harness.emit(samples_line("blocking_time_vs_torch_save", blocking_s, plain["blocking_s"]))
    harness.emit(line("first_save_blocking_time_vs_torch_save", ours["first_blocking_s"], "s",
               statistics.median(plain["blocking_s"])))
    harness.emit(samples_line("copy_first_blocking_time_vs_torch_save", [b for b, _ in ours["copy_first"]],
                       plain["blocking_s"]))
    # what a save costs the loop in all: blocked plus the next forward and backward, which
    # stage 1 (overlapped) and stage 2 (both) slow down where they share the cores
    harness.emit(samples_line("save_to_update_time_overlapped_vs_copy_first", [b + f for b, f in ours["overlapped"]],
                       [b + f for b, f in ours["copy_first"]]))
    harness.emit(samples_line("next_fwd_bwd_time_during_save_vs_alone", [f for _, f in ours["overlapped"]],
                       ours["fwd_bwd_alone_s"]))
    harness.emit(line("blocking_time_vs_dcp_sync_save", blocking, "s", ref["sync_s"]))
    harness.emit(line("blocking_time_vs_dcp_async_save", blocking, "s", ref["async_blocking_s"]))
    harness.emit(line("persist_throughput_vs_dd_direct_write", nbytes / persist / 1e9, "GB/s", disk,
               persist_samples=[round(t, 3) for t in ours["persist_s"]]))
    harness.emit(line("persist_time_vs_dcp_async_save", persist, "s", ref["async_persist_s"]))
    for dp, r in spreads.items():
        harness.emit(line(f"slowest_rank_blocking_at_dp{dp}_weights_spread_vs_on_dp_rank0", r["spread"], "s", r["rank0"],
                   params=r["params"]))
    harness.emit(restore_line("dcp_load", restores["mshpc"], restores["dcp"]))
    harness.emit(restore_line("torch_load", restores["mshpc"], restores["torch"]))


if __name__ == "__main__":
    main()
