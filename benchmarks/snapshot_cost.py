"""What in-memory snapshots cost a step (`recovery.in_place`: every step's state copied to host
memory and kept by a buddy on another node), on 2 CPU ranks: the same engine's steps with a
snapshot after each one and without, taking turns in every round, at the tiny and gpt-125m shapes.

The snapshot runs as training runs it (mshpc/snapshot/keeper.py): its copies overlap the next
step's forward and backward, whose update waits only for what they did not hide; the seal (the
checksum) and the hand-over to the buddy run on in the snapshot's thread. The local ranks are
each their own simulated node, so the buddy keeps its copy through shared memory (exchange.py).
The gpt-125m shape keeps its width and depth but trains short windows (--seq-125m), as
benchmarks/compile_vs_ddp.py does, so a round takes seconds: at its real 2,048 tokens a step is
longer and the snapshot's share smaller. JSON lines: ratio = with / without (1.0 = free).

    .venv/bin/python benchmarks/snapshot_cost.py [--shapes tiny,gpt-125m] [--rounds 6] [--steps 3]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import time
from datetime import timedelta

from mshpc.bench import harness
from mshpc.bench.harness import REPO, WORKER_TIMEOUT_S, time_rounds

CONTENDERS = ("snapshots", "no_snapshots")


def worker(rank: int, port: int, shape: str, args: argparse.Namespace, out: mp.Queue) -> None:
    import torch
    import torch.distributed as dist

    from mshpc.config import RecoveryConfig, load_config
    from mshpc.cpu_ranks.tunings import select_cpu_tunings
    from mshpc.mesh_shape import MeshShape
    from mshpc.model.gpt import GPT, loss_fn
    from mshpc.optim.schedule import build_scheduler
    from mshpc.parallel.apply import parallelize
    from mshpc.parallel.mesh import build_mesh
    from mshpc.snapshot.keeper import SnapshotKeeper
    from mshpc.snapshot.state import TrainState

    torch.set_num_threads(1)  # two ranks on this machine's cores
    select_cpu_tunings(torch.device("cpu"))  # as a CPU rank of `mshpc train` runs
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=WORKER_TIMEOUT_S))
    overrides = ["parallel.dp=2"] + ([f"model.seq_len={args.seq_125m}"] if shape == "gpt-125m" else [])
    cfg = load_config(REPO / f"configs/{shape}.yaml", overrides)
    micro_batch = args.micro_batch_125m if shape == "gpt-125m" else args.micro_batch
    batch = torch.randint(0, cfg.model.vocab_size, (micro_batch, cfg.model.seq_len + 1),
                          generator=torch.Generator().manual_seed(rank))
    x, y = batch[:, :-1], batch[:, 1:]
    torch.manual_seed(0)
    shape_ = MeshShape(pp=1, dp=2, tp=1)
    engine = parallelize(GPT(cfg.model), build_mesh(shape_), model_cfg=cfg.model, parallel=cfg.parallel,
                         train=cfg.train, optim=cfg.optim).engine
    state = TrainState(engine, build_scheduler(engine.optimizer, cfg.optim, 10**6))
    keeper = SnapshotKeeper(RecoveryConfig(in_place=True), f"node{rank}", torch.device("cpu"))
    keeper.begin(state, shape_, 0, restore=False)
    done = [0]
    taken: list[float] = []

    def step(snapshot: bool) -> None:
        engine.backward(loss_fn(engine.model(x), y))
        engine.step(cfg.optim.grad_clip)
        state.scheduler.step()
        done[0] += 1
        if snapshot:
            began = time.perf_counter()
            keeper.after_step(done[0], state)
            taken.append(time.perf_counter() - began)

    def settle() -> None:
        assert keeper.store is not None
        keeper.store.settle()
        engine.wait_params()

    cpu = {name: [0.0, 0] for name in CONTENDERS}  # CPU seconds of this process (its threads too), steps

    def counted(name: str, fn, steps: int):
        def run() -> None:
            began = time.process_time()
            fn()
            cpu[name][0] += time.process_time() - began
            cpu[name][1] += steps
        return run

    steps = {"snapshots": (counted("snapshots", lambda: step(True), 1), counted("snapshots", settle, 0)),
             "no_snapshots": (counted("no_snapshots", lambda: step(False), 1),
                              counted("no_snapshots", engine.wait_params, 0))}
    times = time_rounds(steps, args.rounds, args.steps)
    assert keeper.store is not None
    if rank == 0:
        out.put(json.dumps({"round_s": times, "cpu_s": {n: c / k for n, (c, k) in cpu.items()},
                            "snapshot_mib": keeper.store.layout.nbytes / 2**20,
                            "exchange": type(keeper.store.exchange).__name__, "take_s": statistics.median(taken),
                            "params": sum(p.numel() for p in GPT(cfg.model).parameters()),
                            "seq_len": cfg.model.seq_len, "micro_batch": micro_batch}))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="tiny,gpt-125m")
    harness.add_rounds(parser, 6)
    parser.add_argument("--steps", type=int, default=3, help="timed steps per contender per round")
    parser.add_argument("--micro-batch", type=int, default=8, help="sequences per rank per step at tiny")
    parser.add_argument("--micro-batch-125m", type=int, default=1, help="sequences per rank per step at gpt-125m")
    parser.add_argument("--seq-125m", type=int, default=64, help="window length at the gpt-125m shape")
    args = parser.parse_args()
    for shape in args.shapes.split(","):
        load = harness.load_average()
        r = harness.run_local_ranks(worker, 2, (shape, args))
        ours, base = r["round_s"]["snapshots"], r["round_s"]["no_snapshots"]
        harness.emit({"bench": "snapshot_cost", "metric": "step_time_snapshot_every_step_vs_none", "unit": "s",
                      **harness.paired(ours, base), "shape": shape, "params": r["params"], "seq_len": r["seq_len"],
                      "micro_batch_per_rank": r["micro_batch"], "dp": 2,
                      "snapshot_mib_per_rank": round(r["snapshot_mib"], 1), "exchange": r["exchange"],
                      "take_s_blocking": round(r["take_s"], 5), "steps_per_round": args.steps,
                      # the CPU a step costs this rank's process, the snapshot's thread included: what
                      # the load of a shared machine moves least
                      "cpu_s_per_step": round(r["cpu_s"]["snapshots"], 4),
                      "baseline_cpu_s_per_step": round(r["cpu_s"]["no_snapshots"], 4),
                      "cpu_ratio": round(r["cpu_s"]["snapshots"] / r["cpu_s"]["no_snapshots"], 3),
                      "load_avg": [load, harness.load_average()]})


if __name__ == "__main__":
    main()
