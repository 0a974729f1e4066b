"""Chaos: supervised 2-rank runs under faults drawn at random, against the same run undisturbed:
today's path (every recovery a restart from the newest checkpoint) and recovery in place
(`recovery.in_place`: a lost or hung rank replaced inside the running job from in-memory
snapshots), side by side under the same faults.

The faults (kinds and steps drawn from --seed, which is printed) are those an operator meets:
  kill     kill -9 of a rank                       (the supervisor restarts from a checkpoint)
  stop     SIGSTOP of a rank                       (a hang: found by its silence, restarted)
  sigterm  SIGTERM to the launcher, then a rerun   (a stop checkpoint, then a resume)
  flip     a flipped byte in the newest checkpoint, then kill -9 of a rank, so the restart reads it
  enospc   the run directory's file system full for a moment (a tmpfs: needs root), then a rerun
The driver injects each from outside, as a person would, once training has passed its step, and
reruns `mshpc train` whenever it exits before the last step (the operator's part).

JSON lines: one per fault and path (what mshpc did, seconds to detect and to recover, for a rank's
kill its time to that rank's next completed step, steps trained again), then a summary per path:
parameters and losses bitwise equal to the undisturbed run, `mshpc ckpt verify` on the latest
checkpoint, processes left behind, each recovery against 2x a fresh start-up of the same run,
the effective training time ratio; and the paths compared: kill -9 to the next completed step and
effective time, recovery in place over the restart.

    .venv/bin/python benchmarks/chaos.py [--steps 200] [--faults 10] [--seed S] [--paths disk,in_place]
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import h5py
import numpy as np

from mshpc.bench import disk_fill, harness
from mshpc.bench.harness import REPO
from mshpc.bench.processes import ancestors
from mshpc.run_dir import read_metrics

# configs/tiny.yaml's model (a step takes a good fraction of a second on 2 CPU ranks, so faults
# land in the step they are drawn for); timings flushed often: they tell the driver the step
SMALL = ["run.progress=none", "train.cpu_threads=1", "diagnose.flush_interval_s=0.2"]
# Short heartbeats, a rank silent for 4 of them frozen, and a 10 s hang floor, as
# benchmarks/recovery.py, and a 30 s one for saves of this small model (a SIGSTOP may land in
# one); enough restarts for every fault; no eviction: these faults hit processes, not nodes (two
# blamed kills would evict a slot).
SUPERVISED = ["checkpoint.interval_steps=10", "checkpoint.keep=3", "supervisor.heartbeat_interval_s=0.5",
              "supervisor.heartbeat_timeout_s=2", "supervisor.timeout_floor_s=10", "supervisor.checkpoint_timeout_s=30",
              "supervisor.stop_grace_s=2", "supervisor.max_restarts=20", "supervisor.evict_after=100"]
KINDS = ("kill", "stop", "sigterm", "flip", "enospc")
# what each path adds to SUPERVISED
PATHS = {"disk": [], "in_place": ["recovery.in_place=true"]}
POLL_S = 0.05
FULL_DISK_S = 5.0  # how long the run directory stays full: long enough that a write falls in it
WAIT_S = 300.0  # the most any one wait may take before the benchmark calls the run stuck
MAX_RERUNS = 20


@dataclass
class Fault:
    kind: str
    step: int
    rank: int  # drawn with the fault, so each path gets the same: the rank a kill, stop or flip hits
    flip_seed: int  # which byte of which tensor a flip changes
    injected_at: float = 0.0
    detected_at: float | None = None
    how: str = ""  # what mshpc did, in a few words
    detect_s: float | None = None
    recover_s: float | None = None
    to_next_step_s: float | None = None  # kill, flip: from the kill to that rank's next completed step
    retrained: int | None = None  # steps trained again after it


@dataclass
class Launch:
    at: float
    proc: subprocess.Popen
    exit_code: int | None = None


@dataclass
class ChaosRun:
    """One run directory trained by successive `mshpc train --nproc 2` launches."""

    out: Path
    cache: Path
    name: str
    steps: int
    sets: list[str] = field(default_factory=list)  # the path's own settings
    launches: list[Launch] = field(default_factory=list)

    @property
    def run_dir(self) -> Path:
        return self.out / self.name

    @property
    def current(self) -> Launch:
        return self.launches[-1]

    def launch(self) -> None:
        sets = [*SMALL, *SUPERVISED, *self.sets, f"train.steps={self.steps}", f"run.out_dir={self.out}",
                f"run.name={self.name}", f"data.cache_dir={self.cache}"]
        argv = [sys.executable, "-m", "mshpc", "train", str(REPO / "configs/tiny.yaml"),
                *[a for s in sets for a in ("--set", s)], "--nproc", "2"]
        env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "MSHPC_"))}
        log = open(self.out.parent / f"{self.name}-launch{len(self.launches)}.log", "w")  # the child writes it; closed when this process ends
        proc = subprocess.Popen(argv, env=env, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
        self.launches.append(Launch(time.time(), proc))

    def exited(self) -> bool:
        code = self.current.proc.poll()
        if code is not None and self.current.exit_code is None:
            self.current.exit_code = code
        return code is not None

    def last_step(self) -> int:
        metrics = self.run_dir / "metrics.jsonl"
        rows = read_metrics(metrics) if metrics.exists() else []  # torn lines skipped
        return rows[-1]["step"] if rows else 0

    def attempt_step(self) -> int:
        """The last step the running attempt has trained (rank 0's timings after its newest header
        of this launch), 0 before it trains one: a fault lands in training, not in a start-up
        that an older launch's metrics would make look far along."""
        step, since = 0, False
        for kind, at, number in self.timings():
            if kind == "header":
                step, since = 0, at >= self.current.at
            elif since:
                step = number
        return step

    def rank_pids(self) -> dict[int, int]:
        """The ranks of the attempt now running, by rank, as the supervisor's `resumed` or
        `recovered` event names them (forked by the launcher's fork server, a rank is none of the
        supervisor's children, and its RANK is no variable it was started with); empty from a
        failure's detection until its recovery in place has trained a step: a fault injected then
        would hit a rank already being replaced (the supervisor's detection may come just before
        its recover_in_place)."""
        story = ("attempt_start", "resumed", "failure_detected", "recover_in_place", "recovered")
        since = [e for e in self.events() if e["time"] >= self.current.at and e["kind"] in story]
        last = since[-1] if since else {"kind": "attempt_start"}
        if last["kind"] == "recovered" or (last["kind"] == "resumed" and last["recovery"] != "in_place"):
            return {r: pid for r, pid in enumerate(last["pids"]) if pid is not None}
        return {}

    def events(self) -> list[dict]:
        path = self.run_dir / "events.jsonl"
        out = []
        for line in path.read_text().splitlines() if path.exists() else []:
            try:
                out.append(json.loads(line))
            except ValueError:
                continue
        return out

    def timings(self, rank: int = 0) -> list[tuple[str, float, int]]:
        """("header"|"step", unix time, step) of each line of a rank's timings file, in order."""
        path = self.run_dir / "timings" / f"rank-{rank:05d}.jsonl"
        out = []
        for line in path.read_text().splitlines() if path.exists() else []:
            try:
                record = json.loads(line)
            except ValueError:
                continue
            out.append(("header" if "rank" in record else "step", record["time"], record.get("step", 0)))
        return out


def processes_mentioning(text: str) -> list[int]:
    """The processes whose command line holds `text`, but for this one and its ancestors: a script
    that runs this benchmark with --keep names the same folder, and must not be ended with the run."""
    found, mine = [], ancestors()
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if text in cmdline.read_bytes().decode(errors="replace") and int(cmdline.parent.name) not in mine:
                found.append(int(cmdline.parent.name))
        except OSError:
            continue
    return found


def wait_for(check, what: str, timeout_s: float = WAIT_S) -> None:
    deadline = time.time() + timeout_s
    while not check():
        if time.time() > deadline:
            raise SystemExit(f"chaos: stuck: {what} did not happen within {timeout_s:.0f} s")
        time.sleep(POLL_S)


# ---------------------------------------------------------------- the faults


def flip_byte(ckpt_root: Path, seed: int) -> str:
    """Flip one byte inside a tensor of the newest checkpoint (a master or a model tensor); returns
    which."""
    rng = random.Random(seed)
    shards = sorted((ckpt_root / "latest").glob("shard-*.h5"))
    shard = rng.choice(shards)
    with h5py.File(shard, "r") as f:
        names = [f"{group}/{n}" for group in ("master", "model") if group in f for n in f[group]
                 if f[group][n].size >= 64]
        name = rng.choice(sorted(names))
        offset, nbytes = f[name].id.get_offset(), f[name].id.get_storage_size()
    with open(shard, "r+b") as f:
        f.seek(offset + rng.randrange(nbytes))
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x01]))
    return f"{shard.name}:{name}"


def inject(run: ChaosRun, fault: Fault) -> None:
    fault.injected_at = time.time()
    if fault.kind in ("kill", "stop", "flip"):
        pid = run.rank_pids()[fault.rank]
        if fault.kind == "flip":
            fault.how = f"flipped {flip_byte(run.run_dir / 'checkpoints', fault.flip_seed)}; "
        os.kill(pid, signal.SIGSTOP if fault.kind == "stop" else signal.SIGKILL)
    elif fault.kind == "sigterm":
        run.current.proc.send_signal(signal.SIGTERM)
    elif fault.kind == "enospc":
        filler = disk_fill.fill(run.out)
        time.sleep(FULL_DISK_S)
        filler.unlink()


def observe(run: ChaosRun, fault: Fault) -> None:
    """Wait until mshpc has dealt with the fault: the supervisor's detection (a restart follows),
    or the launcher's exit (the driver reruns it); fill in what happened."""
    def detected() -> dict | None:
        return next((e for e in run.events() if e["kind"] == "failure_detected" and e["time"] > fault.injected_at),
                    None)

    if fault.kind == "sigterm":
        wait_for(run.exited, "the launcher's exit after SIGTERM", 120)
        fault.detected_at = fault.injected_at  # the signal is the decision; the stop follows
        fault.how += f"launcher stopped in {time.time() - fault.injected_at:.1f} s, exit {run.current.exit_code}"
        return
    if fault.kind == "enospc":
        # a write may or may not have fallen in the full moment (the disk is free again by now):
        # wait a few steps for its effect, not long, or the run may end before the next fault
        deadline = time.time() + 5
        while time.time() < deadline and detected() is None and not run.exited():
            time.sleep(POLL_S)
    else:
        wait_for(lambda: detected() is not None or run.exited(), f"detection of {fault.kind}")
    event = detected()
    if event is not None:
        fault.detected_at = event["time"]
        fault.how += f"detected {event['failure']} on rank {event['rank']}"
    elif run.exited() and run.current.exit_code == 0:
        fault.how += "none: the run had finished"
    elif run.exited():
        fault.detected_at = time.time()
        fault.how += f"launcher exited {run.current.exit_code}"
    else:
        fault.how += "no write fell in the full moment: nothing to detect"


def recovered_at(run: ChaosRun, after: float, rank: int = 0) -> float | None:
    """The first step trained after a (re)start that came after `after`: the rank's timings."""
    restarted = False
    for kind, at, _ in run.timings(rank):
        restarted = restarted or (kind == "header" and at > after)
        if restarted and kind == "step":
            return at
    return None


def retrained(run: ChaosRun, fault: Fault) -> int | None:
    """Steps trained again after a rank's fault: from the step it struck to where training
    resumed (the supervisor's `failure_detected` and the next `resumed`)."""
    evs = [e for e in run.events() if e["time"] >= fault.injected_at]
    detected = next((e for e in evs if e["kind"] == "failure_detected"), None)
    resumed = next((e for e in evs if e["kind"] == "resumed" and detected and e["time"] >= detected["time"]), None)
    if detected is None or resumed is None:
        return None
    return max(0, detected["step"] - 1 - resumed["from_step"])  # its step was in progress, not done


# ---------------------------------------------------------------- the run


def drive(run: ChaosRun, faults: list[Fault]) -> None:
    run.launch()
    pending = list(faults)
    while True:
        if run.exited():
            if run.last_step() >= run.steps and run.current.exit_code == 0:
                return
            if len(run.launches) > MAX_RERUNS:
                raise SystemExit(f"chaos: gave up after {MAX_RERUNS} reruns; see {run.out.parent}/*.log")
            run.launch()  # the operator's rerun: resume from the latest good checkpoint
        if pending and run.attempt_step() >= pending[0].step and len(run.rank_pids()) == 2:
            fault = pending.pop(0)
            inject(run, fault)
            observe(run, fault)
        time.sleep(POLL_S)


def startup_s(run: ChaosRun) -> float:
    first = next(at for kind, at, _ in run.timings() if kind == "step")
    return first - run.launches[0].at


def final_state(run: ChaosRun) -> tuple[dict[str, np.ndarray], list[float]]:
    params = {}
    for shard in sorted((run.run_dir / "checkpoints" / "latest").glob("shard-*.h5")):
        with h5py.File(shard, "r") as f:
            params.update({k: f["model"][k][()] for k in f.get("model", {})})
    records = read_metrics(run.run_dir / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(1, run.steps + 1)), "metrics: not every step exactly once"
    return params, [r["loss"] for r in records]


def effective_ratio(run: ChaosRun, ended: float) -> float:
    records = read_metrics(run.run_dir / "metrics.jsonl")
    return sum(r["step_time_s"] for r in records) / (ended - run.launches[0].at)


def emit(**fields: object) -> None:
    harness.emit({"bench": "chaos", **fields})


def draw(rng: random.Random, n: int, steps: int, kinds: tuple[str, ...]) -> list[Fault]:
    at = sorted(rng.sample(range(10, steps - 10), n))
    faults = [Fault(rng.choice(kinds), step, 0, 0) for step in at]  # the draws of every earlier version
    for fault in faults:  # then what each fault hits, the same on every path
        fault.rank, fault.flip_seed = rng.randrange(2), rng.randrange(2**31)
    return faults


def mount_tmpfs(path: Path) -> str | None:
    """A 1 GiB tmpfs for the chaos run's directory, so it can be filled; the reason when not."""
    path.mkdir(parents=True)
    if os.geteuid() != 0:
        return "not root: cannot mount a tmpfs to fill"
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1g", "tmpfs", str(path)], capture_output=True, text=True)
    return None if done.returncode == 0 else f"mount failed: {done.stderr.strip()}"


@contextlib.contextmanager
def workdir(keep: Path | None) -> Iterator[str]:
    if keep is None:
        with tempfile.TemporaryDirectory(prefix="bench-chaos-") as tmp:
            yield tmp
    else:
        keep.mkdir(parents=True)
        yield str(keep.resolve())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--faults", type=int, default=10)
    p.add_argument("--seed", type=int, default=None, help="default: drawn, and printed")
    p.add_argument("--kinds", default=",".join(KINDS), help="which faults to draw from")
    p.add_argument("--paths", default=",".join(PATHS), help="which recovery paths to run, side by side")
    p.add_argument("--keep", type=Path, default=None, help="work in this new folder and keep it (logs, runs)")
    args = p.parse_args()
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(2**31)
    paths = args.paths.split(",")
    if not paths or not set(paths) <= set(PATHS):
        raise SystemExit(f"chaos: --paths {args.paths!r}: choose from {', '.join(PATHS)}")
    with workdir(args.keep) as tmp:
        cache = Path(tmp, "cache")
        outs = {path: Path(tmp, f"chaos-{path}") for path in paths}
        no_full_disk = next((why for why in map(mount_tmpfs, outs.values()) if why), None)
        kinds = tuple(k for k in args.kinds.split(",") if not (k == "enospc" and no_full_disk))
        if not set(kinds) <= set(KINDS) or not kinds:
            raise SystemExit(f"chaos: --kinds {args.kinds!r}: choose from {', '.join(KINDS)}")
        drawn = draw(random.Random(seed), args.faults, args.steps, kinds)
        emit(seed=seed, steps=args.steps, faults=[(f.kind, f.step) for f in drawn], kinds=kinds, paths=paths,
             enospc_left_out=no_full_disk, load_avg=harness.load_average())
        try:
            reference = ChaosRun(Path(tmp, "ref"), cache, "ref", args.steps)
            drive(reference, [])
            ref_end = time.time()
            summaries = {}
            for path in paths:
                faults = [dataclasses.replace(f) for f in drawn]
                chaos = ChaosRun(outs[path], cache, "chaos", args.steps, PATHS[path])
                drive(chaos, faults)
                summaries[path] = report(reference, ref_end, chaos, time.time(), faults, path)
            compare(summaries)
        finally:
            for pid in processes_mentioning(tmp):
                os.kill(pid, signal.SIGKILL)
            if not no_full_disk:
                for path, out in outs.items():
                    if args.keep:  # the tmpfs goes: keep a copy of what the run wrote there
                        shutil.copytree(out, Path(tmp, f"chaos-{path}-run"), symlinks=True, dirs_exist_ok=True)
                    subprocess.run(["umount", "-l", str(out)], check=False)


def report(reference: ChaosRun, ref_end: float, chaos: ChaosRun, chaos_end: float, faults: list[Fault],
           path: str) -> dict:
    time.sleep(3.0)  # what a stopped run leaves must be gone by now
    left = processes_mentioning(str(chaos.out))
    fresh = startup_s(reference)
    for fault in faults:
        if fault.detected_at is not None:
            fault.detect_s = fault.detected_at - fault.injected_at
            back = recovered_at(chaos, fault.detected_at)
            fault.recover_s = None if back is None else back - fault.detected_at
        if fault.kind in ("kill", "flip", "stop"):
            fault.retrained = retrained(chaos, fault)
        if fault.kind in ("kill", "flip"):
            back = recovered_at(chaos, fault.injected_at, fault.rank)
            fault.to_next_step_s = None if back is None else back - fault.injected_at
        emit(path=path, fault={k: v for k, v in asdict(fault).items() if k not in ("injected_at", "detected_at", "flip_seed")},
             within_2x_fresh_startup=None if fault.recover_s is None else fault.recover_s <= 2 * fresh)
    want, got = final_state(reference), final_state(chaos)
    bitwise = want[0].keys() == got[0].keys() and all(np.array_equal(want[0][k], got[0][k]) for k in want[0])
    verify = subprocess.run([sys.executable, "-m", "mshpc", "ckpt", "verify",
                             str(chaos.run_dir / "checkpoints" / "latest")], capture_output=True, text=True, cwd=REPO)
    recoveries = [f.recover_s for f in faults if f.recover_s is not None]
    kills = [f.to_next_step_s for f in faults if f.to_next_step_s is not None]
    again = [f.retrained for f in faults if f.retrained is not None]
    summary = {"effective_time_ratio": effective_ratio(chaos, chaos_end), "kill_to_next_step_s": kills,
               "retrained": again}
    emit(path=path, metric="summary", final_step=chaos.last_step(), bitwise_equal_params=bitwise,
         bitwise_equal_losses=want[1] == got[1], ckpt_verify_clean=verify.returncode == 0,
         processes_left=len(left), launches=len(chaos.launches), fresh_startup_s=round(fresh, 2),
         max_recover_s=round(max(recoveries), 2) if recoveries else None,
         all_within_2x_fresh_startup=all(r <= 2 * fresh for r in recoveries),
         effective_time_ratio=round(summary["effective_time_ratio"], 4),
         effective_time_ratio_undisturbed=round(effective_ratio(reference, ref_end), 4),
         kill_to_next_step_s=[round(k, 2) for k in kills], max_steps_retrained_per_rank_fault=max(again, default=None))
    return summary


def compare(summaries: dict[str, dict]) -> None:
    """Recovery in place against today's restart, under the same faults: ratio = in place / disk."""
    if set(summaries) != set(PATHS):
        return
    ours, base = summaries["in_place"], summaries["disk"]
    if ours["kill_to_next_step_s"] and base["kill_to_next_step_s"]:
        value, baseline = statistics.median(ours["kill_to_next_step_s"]), statistics.median(base["kill_to_next_step_s"])
        emit(metric="kill_to_next_step_in_place_vs_disk_restart", value=round(value, 3), unit="s",
             baseline=round(baseline, 3), ratio=round(value / baseline, 3),
             worst_in_place_s=round(max(ours["kill_to_next_step_s"]), 3))
    emit(metric="effective_time_in_place_vs_disk_restart", value=round(ours["effective_time_ratio"], 4), unit="ratio",
         baseline=round(base["effective_time_ratio"], 4),
         ratio=round(ours["effective_time_ratio"] / base["effective_time_ratio"], 3))


if __name__ == "__main__":
    main()
