"""Claim: no logger (TensorBoard, W&B offline) and no configured validation adds more than 1% to
the time of the steps that do not evaluate, against metrics.jsonl alone; and where the time
that remains goes, as CPU seconds per step of each process and thread.

Side by side in one run: real `mshpc train` runs of configs/tiny.yaml on 2 ranks, one per
variant per round, the order rotated every round so that machine noise falls on all alike:

    jsonl        run.loggers [jsonl], eval off (the baseline)
    eval         [jsonl], eval.interval_steps set (configured; only its not-due steps count)
    tensorboard  [jsonl, tensorboard]
    wandb        [jsonl, wandb] (WANDB_MODE=offline)
    all          [jsonl, tensorboard, wandb] and eval
    all_nice0    all, with run.logger_nice_increment=0 (the loggers at the loop's priority)
    wandb_sdk_in_rank0  [jsonl], and an idle W&B run inside rank 0's process (a sitecustomize
                 starts it): where W&B ran before the loggers got a process of their own

A step's time is the gap between consecutive steps in rank 0's timings file: everything the loop
does for the step, the loggers' writes included; runs with eval count only steps that neither
evaluate nor follow an evaluation. Per variant, the headline: `pooled_ratio`, the median step
of all its rounds pooled / the jsonl runs' pooled median, with a 90% interval from resampling
whole rounds; and the median of its per-round ratios (its run's median step / that round's
jsonl run's median step) with their min and max. Now and then a whole run here takes about 10%
longer per step, whatever its variant (jsonl alone too: `run_median_step_s` lines, with each
run's CPU, page faults and the hypervisor's steal), so a few rounds can put a variant 5-8% up
or down by chance: take many rounds (--rounds 8) and read the interval.

While a run trains, its process tree is read from /proc twice a second: the CPU seconds per
steady-state step of rank 0's loop thread, rank 0's other threads (gloo's), rank 1, rank 0's
logger process (TensorBoard, W&B's SDK), W&B's service process (wandb-core and its children) and
the rest (supervisor, node relay).
On 2 cores that 2 ranks fill, CPU another process takes is time a rank waits for, and the step
waits for its slowest rank.

Last, noise-free because it counts CPU seconds, not wall time: each logger set's CPU per row:
the writing process's (the loop's pipe write), the logger process's and W&B's service process's
together, and what that adds to a step whose work is rank 1's CPU per step in the jsonl runs.

    .venv/bin/python benchmarks/loggers_eval.py [--rounds 3] [--steps 60] [--interval 10]
    .venv/bin/python benchmarks/loggers_eval.py --rows-only 0.354   # the CPU per row alone
    .venv/bin/python benchmarks/loggers_eval.py --variants jsonl,wandb,wandb_sdk_in_rank0
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from mshpc.bench import harness
from mshpc.bench.harness import REPO, paired_round_interval

WARMUP = 5  # steps whose time is start-up, not steady state
BASE = ["run.progress=none", "checkpoint.interval_steps=0", "train.cpu_threads=1"]
TICK_S = 1 / os.sysconf("SC_CLK_TCK")
POLL_S = 0.5
SETTLE_S = 3.0
VARIANTS = {
    "jsonl": ([], False),
    "eval": ([], True),
    "tensorboard": (["run.loggers=[jsonl,tensorboard]"], False),
    "wandb": (["run.loggers=[jsonl,wandb]"], False),
    "all": (["run.loggers=[jsonl,tensorboard,wandb]"], True),
    # the same at the loop's own priority: what run.logger_nice_increment buys
    "all_nice0": (["run.loggers=[jsonl,tensorboard,wandb]", "run.logger_nice_increment=0"], True),
    # jsonl alone, but rank 0's process holds an idle W&B run (wandb.init, no row), as it did
    # before the loggers had a process of their own: what the SDK's mere presence in a rank costs
    "wandb_sdk_in_rank0": ([], False),
}
# Loaded by every process whose PYTHONPATH starts with its folder: only rank 0's `mshpc train`
# starts a W&B run, before training starts (sys.argv is ["-m", "train", ...] there).
SDK_IN_RANK0 = """import os, sys
if os.environ.get("RANK") == "0" and sys.argv[1:2] == ["train"]:
    import wandb
    os.makedirs(os.environ["WANDB_DIR"], exist_ok=True)
    _run = wandb.init(project="bench", dir=os.environ["WANDB_DIR"], mode="offline",
                      settings=wandb.Settings(silent=True, console="off"))
"""


def offline_env(tmp: Path, sdk_in_rank0: bool = False) -> dict[str, str]:
    path = [str(REPO)]
    if sdk_in_rank0:
        (tmp / "sdk_in_rank0").mkdir(exist_ok=True)
        (tmp / "sdk_in_rank0" / "sitecustomize.py").write_text(SDK_IN_RANK0)
        path.insert(0, str(tmp / "sdk_in_rank0"))
    env = dict(os.environ, WANDB_MODE="offline", PYTHONPATH=os.pathsep.join(path))
    for var in ("WANDB_DIR", "WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        env[var] = str(tmp / var.lower())
    return env


def _read(path: str) -> str | None:
    try:
        with open(path, "rb") as f:
            return f.read().decode(errors="replace")
    except OSError:  # gone between listing and reading
        return None


def _cpu_ticks(stat: str) -> int:
    fields = stat[stat.rfind(")") + 2:].split()  # after "pid (comm) "
    return int(fields[11]) + int(fields[12])  # utime + stime


def descendants(pid: int) -> Iterator[int]:
    for tid in os.listdir(f"/proc/{pid}/task") if os.path.isdir(f"/proc/{pid}/task") else []:
        for child in (_read(f"/proc/{pid}/task/{tid}/children") or "").split():
            yield int(child)
            yield from descendants(int(child))


class TreeCpu:
    """Samples the CPU ticks of a process tree by part, on a side thread, until stopped."""

    def __init__(self, root: int) -> None:
        self.root, self.samples = root, []  # (unix s, {part: ticks})
        self.kinds: dict[int, str] = {}
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _kind(self, pid: int, comm: str) -> str:
        if pid not in self.kinds:
            env = (_read(f"/proc/{pid}/environ") or "").split("\0")
            rank = next((e[5:] for e in env if e.startswith("RANK=")), None)
            service = "wandb" in comm or "gpu_stats" in comm
            logger = "mshpc.loggers.logger_process" in (_read(f"/proc/{pid}/cmdline") or "")
            kind = "wandb_service" if service else "logger_process" if logger else f"rank{rank}" if rank else "other"
            if kind == "other":  # perhaps a rank between fork and exec: look again next time
                return kind
            self.kinds[pid] = kind
        return self.kinds[pid]

    def sample(self) -> dict[str, int]:
        parts: dict[str, int] = {}
        for pid in descendants(self.root):
            stat = _read(f"/proc/{pid}/stat")
            if stat is None:
                continue
            kind = self._kind(pid, stat[stat.find("(") + 1:stat.rfind(")")])
            if self.kinds.get(self._parent(stat)) == "wandb_service":
                kind = self.kinds[pid] = "wandb_service"
            if kind == "rank0":  # its loop thread (tid = pid) apart from its other threads
                main = _read(f"/proc/{pid}/task/{pid}/stat")
                main_ticks = _cpu_ticks(main) if main else 0
                parts["rank0_loop_thread"] = parts.get("rank0_loop_thread", 0) + main_ticks
                parts["rank0_other_threads"] = parts.get("rank0_other_threads", 0) + _cpu_ticks(stat) - main_ticks
            else:
                parts[kind] = parts.get(kind, 0) + _cpu_ticks(stat)
        return parts

    @staticmethod
    def _parent(stat: str) -> int:
        return int(stat[stat.rfind(")") + 2:].split()[1])

    def _run(self) -> None:
        while not self.done.wait(POLL_S):
            self.samples.append((time.time(), self.sample()))

    def stop(self) -> None:
        self.done.set()
        self.thread.join()

    def per_step(self, start: float, end: float, steps: int) -> dict[str, float]:
        """CPU seconds per step between unix times start and end: the CPU rate between the first
        and last samples inside that window (a sample after `end` can miss ranks that have
        exited), times the mean step time."""
        inside = [s for s in self.samples if start <= s[0] <= end]
        (t0, first), (t1, last) = inside[0], inside[-1]
        return {k: (last[k] - first.get(k, 0)) * TICK_S / (t1 - t0) * (end - start) / steps for k in sorted(last)}


def steal_s() -> float:
    """Seconds the hypervisor ran something else while this VM's CPUs wanted to run (/proc/stat)."""
    fields = (_read("/proc/stat") or "cpu 0 0 0 0 0 0 0 0").splitlines()[0].split()
    return int(fields[8]) * TICK_S


def train(tmp: Path, name: str, overrides: list[str], steps: int) -> tuple[Path, TreeCpu, dict[str, float]]:
    sets = [*BASE, f"run.out_dir={tmp}", f"run.name={name}", f"train.steps={steps}", *overrides]
    cmd = [sys.executable, "-m", "mshpc", "train", str(REPO / "configs/tiny.yaml"), "--nproc", "2",
           *[a for s in sets for a in ("--set", s)]]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env=offline_env(tmp, name.startswith("wandb_sdk_in_rank0")), cwd=REPO)
    cpu, before, stolen = TreeCpu(proc.pid), resource.getrusage(resource.RUSAGE_CHILDREN), steal_s()
    _, err = proc.communicate(timeout=1800)
    cpu.stop()
    if proc.returncode != 0:
        raise SystemExit(f"{name} failed:\n{err[-3000:]}")
    after = resource.getrusage(resource.RUSAGE_CHILDREN)  # the whole run's tree: each parent waited
    usage = {"user_s": round(after.ru_utime - before.ru_utime, 2), "sys_s": round(after.ru_stime - before.ru_stime, 2),
             "minor_faults": after.ru_minflt - before.ru_minflt, "steal_s": round(steal_s() - stolen, 2)}
    return tmp / name, cpu, usage


def step_times(run_dir: Path) -> dict[int, float]:
    lines = (run_dir / "timings" / "rank-00000.jsonl").read_text().splitlines()[1:]
    return {r["step"]: r["time"] for r in map(json.loads, lines)}


def step_gaps(times: dict[int, float], interval: int) -> list[float]:
    """Seconds between consecutive steps on rank 0, leaving out evaluating steps and the next."""
    evaluates = (lambda s: interval > 0 and s % interval == 0)
    return [times[s] - times[s - 1] for s in sorted(times)
            if s > WARMUP and s - 1 in times and not evaluates(s) and not evaluates(s - 1)]


def children_cpu_s() -> float:
    """CPU seconds of this process's child processes (the logger process, W&B's service), from /proc."""
    ticks = 0
    for pid in descendants(os.getpid()):
        stat = _read(f"/proc/{pid}/stat")
        ticks += _cpu_ticks(stat) if stat else 0
    return ticks * TICK_S


def row_cpu_s(tmp: Path, loggers_set: str, rows: int = 300, idle_s: float = 10.0) -> dict[str, float]:
    """CPU seconds, not wall time (so the machine's other load does not enter), of one row written
    through `loggers_set` from this process: this process's (the loop's), the logger process's
    and W&B's service's per row, and theirs per second while no row comes."""
    os.environ.update(offline_env(tmp))
    from mshpc.config import load_config, to_dict
    from mshpc.loggers.sinks import build_loggers
    from mshpc.run_dir import MetricsLog

    run_dir = tmp / f"rows-{loggers_set.replace(',', '-')}"
    run_dir.mkdir()
    cfg = load_config(None, [f"run.loggers=[{loggers_set}]"])
    loggers = build_loggers(run_dir, MetricsLog(run_dir / "metrics.jsonl", 0), 0, run=cfg.run,
                            config_record=to_dict(cfg))
    row = {"loss": 2.5, "lr": 1e-3, "grad_norm": 0.7, "tokens_per_s": 3000.0, "step_time_s": 0.7, "mfu": 0.01,
           "tflops": 0.02, "data_wait_s": 1e-5, "ckpt_blocking_s": None, "ckpt_stage1_wait_s": None,
           "max_memory_gib": None}
    service = children_cpu_s()
    time.sleep(idle_s)
    idle = (children_cpu_s() - service) / idle_s
    service, start, wall = children_cpu_s(), time.process_time(), time.perf_counter()
    for step in range(1, rows + 1):
        loggers.write({"step": step, **row})
    time.sleep(SETTLE_S)  # the logger process and the service finish the rows (well under a second)
    threads = (time.process_time() - start) / rows
    served = children_cpu_s() - service - idle * (time.perf_counter() - wall)
    loggers.close()
    return {"loop_s_per_row": threads, "logger_processes_s_per_row": max(0.0, served / rows),
            "logger_processes_idle_s_per_s": idle}


def emit(**fields: object) -> None:
    harness.emit({"bench": "loggers_eval", **fields})


Measured = tuple[dict[str, list[list[float]]], dict[str, list[dict[str, float]]], dict[str, dict[int, list[float]]]]


def measure(tmp: Path, args: argparse.Namespace) -> Measured:
    """Per variant: each round's step gaps, each round's CPU seconds per step by part, and every
    step's gap by its place between evaluations (step % interval; place 0 evaluates)."""
    names = args.variants
    gaps: dict[str, list[list[float]]] = {n: [] for n in names}
    places: dict[str, dict[int, list[float]]] = {n: {} for n in names}
    cpu: dict[str, list[dict[str, float]]] = {n: [] for n in names}
    for r in range(args.rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:  # rotated every round
            overrides, evaluates = VARIANTS[name]
            interval = args.interval if evaluates else 0
            run_dir, tree, usage = train(tmp, f"{name}-{r}", [*overrides, f"eval.interval_steps={interval}"], args.steps)
            times = step_times(run_dir)
            gaps[name].append(step_gaps(times, interval))
            for s in sorted(times):
                if s > WARMUP and s - 1 in times:
                    places[name].setdefault(s % args.interval, []).append(times[s] - times[s - 1])
            window = [s for s in times if s >= WARMUP]
            cpu[name].append(tree.per_step(times[min(window)], times[max(window)], max(window) - min(window)))
            # each run as it ends: a run cut short still leaves its rounds, and the load they saw
            emit(metric="run_median_step_s", variant=name, round=r, value=round(statistics.median(gaps[name][-1]), 4),
                 unit="s", cpu_s_per_step={k: round(v, 5) for k, v in cpu[name][-1].items()}, run_usage=usage,
                 load_avg_1m=harness.load_average())
    return gaps, cpu, places


def emit_rows(tmp: Path, step_s: float) -> None:
    """Each logger set's CPU per row, and what it adds to a step of `step_s` seconds of rank
    CPU: the rows' work beyond metrics.jsonl's, W&B's service per row, and its idle CPU over
    the step (on 2 cores that 2 ranks fill, at worst all of it lands on a step)."""
    sets = ["jsonl", "jsonl,tensorboard", "jsonl,wandb", "jsonl,tensorboard,wandb"]
    cost = {name: row_cpu_s(tmp, name) for name in sets}
    for name in sets:
        c, base = cost[name], cost["jsonl"]["loop_s_per_row"]
        added = c["loop_s_per_row"] - base + c["logger_processes_s_per_row"] + c["logger_processes_idle_s_per_s"] * step_s
        emit(metric=f"cpu_s_per_row_{name.replace(',', '_')}", unit="s",
             value={k: round(v, 6) for k, v in c.items()}, baseline=round(step_s, 4),
             added_cpu_s_per_step=round(added, 6), ratio=round(1 + added / step_s, 5))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    harness.add_rounds(parser, 3, "rounds; every variant trains once in each, the order rotated")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--interval", type=int, default=10)
    parser.add_argument("--variants", type=lambda v: v.split(","), default=list(VARIANTS),
                        help=f"comma-separated, jsonl first (default: {','.join(VARIANTS)})")
    parser.add_argument("--rows-only", type=float, metavar="STEP_S", default=None,
                        help="only the CPU per row, against a step of STEP_S seconds (no training runs)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="mshpc-loggers-") as name:
        tmp = Path(name)
        if args.rows_only is not None:
            emit_rows(tmp, args.rows_only)
            return
        gaps, cpu, places = measure(tmp, args)
        base = [statistics.median(g) for g in gaps["jsonl"]]
        pooled_base = sum(gaps["jsonl"], [])
        for variant in args.variants:
            ratios = [statistics.median(g) / b for g, b in zip(gaps[variant], base, strict=True)]
            pooled = sum(gaps[variant], [])
            low, high = paired_round_interval(gaps[variant], gaps["jsonl"])  # whole rounds: a run can be slow as a whole
            emit(metric=f"step_time_{variant}_vs_jsonl_only", value=round(statistics.median(pooled), 4),
                 unit="s", baseline=round(statistics.median(pooled_base), 4),
                 pooled_ratio=round(statistics.median(pooled) / statistics.median(pooled_base), 4),
                 pooled_ratio_90pct=[round(low, 4), round(high, 4)],
                 ratio=round(statistics.median(ratios), 4), ratio_min=round(min(ratios), 4),
                 ratio_max=round(max(ratios), 4), rounds=args.rounds, steps=len(pooled))
            parts = sorted({k for c in cpu[variant] for k in c})
            emit(metric=f"cpu_s_per_step_{variant}", unit="s",
                 value={k: round(statistics.median(c.get(k, 0.0) for c in cpu[variant]), 5) for k in parts},
                 spread={k: [round(min(c.get(k, 0.0) for c in cpu[variant]), 5),
                             round(max(c.get(k, 0.0) for c in cpu[variant]), 5)] for k in parts})
        # where between evaluations a configured evaluation's cost would fall, if it had one:
        # place 0 evaluates, place 1 follows (both left out above), the rest are the claim's
        for variant in (v for v in args.variants if VARIANTS[v][1]):
            emit(metric=f"step_time_by_place_{variant}_vs_jsonl_only", unit="ratio", interval=args.interval,
                 value={p: round(statistics.median(g) / statistics.median(pooled_base), 4)
                        for p, g in sorted(places[variant].items())})
        # a rank's CPU per step is its step's work (2 ranks, 1 thread each), less load-bound than wall time
        emit_rows(tmp, statistics.median(c["rank1"] for c in cpu["jsonl"]))


if __name__ == "__main__":
    main()
