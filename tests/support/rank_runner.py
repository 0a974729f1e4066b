"""Run a test function on N gloo ranks, each in its own spawned process.

Each failure comes back tagged with its rank; when one rank fails the others get a short grace
and are then killed (they are usually stuck in a collective the failed rank never entered);
at the timeout every unfinished rank dumps its Python stacks and is killed. So a hung
collective fails one test, not the suite. The timeout counts from when every rank has joined
the group, not from the spawn: importing torch takes seconds on a busy machine, and a test's
timeout should not have to hold them. Results travel as JSON, not pickle.
"""

from __future__ import annotations

import faulthandler
import importlib.util
import inspect
import json
import multiprocessing as mp
import os
import signal
import tempfile
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

STARTUP_S = 180.0  # spawn, imports and joining the group, before a test's own timeout starts
GLOO_TIMEOUT_MARGIN_S = 30.0


class RankError(AssertionError):
    """One or more ranks failed or hung; the message holds each one's traceback or stacks."""


def _rank_main(file: str, qualname: str, rank: int, world: int, store: str, dump: str,
               timeout_s: float, args: tuple, conn: Connection) -> None:
    import torch
    import torch.distributed as dist

    from mshpc.cpu_ranks.tunings import select_cpu_tunings
    from mshpc.launch.rendezvous import connect_lazily

    faulthandler.register(signal.SIGUSR1, file=open(dump, "w"), all_threads=True)
    torch.set_num_threads(1)  # ranks share the machine's cores
    try:
        spec = importlib.util.spec_from_file_location(f"_rank_target_{rank}", file)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        fn = module
        for part in qualname.split("."):
            fn = getattr(fn, part)
        connect_lazily()  # as launch.rendezvous.init_distributed: gloo pairs connect on first use
        # gloo's own timeout comes later than the runner's: a rank stuck in a collective is then
        # reported by the runner as hung, with its stacks, not as a gloo error raced against it
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                                timeout=timedelta(seconds=timeout_s + GLOO_TIMEOUT_MARGIN_S))
        select_cpu_tunings(torch.device("cpu"))  # as a CPU rank of `mshpc train` does at start-up
        conn.send_bytes(json.dumps({"started": True}).encode())  # the runner's clock starts
        result = fn(rank, world, *args)
        conn.send_bytes(json.dumps({"ok": result}).encode())
    except BaseException:  # noqa: BLE001 - everything goes back to the parent, tagged
        conn.send_bytes(json.dumps({"error": traceback.format_exc()}).encode())
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        conn.close()


def run_ranks(fn: Callable[..., Any], world: int, *args: Any, timeout_s: float = 60.0,
              grace_s: float = 5.0) -> list[Any]:
    """Call fn(rank, world, *args) on `world` processes joined in a gloo default group and return
    each rank's (JSON-able) result in rank order. fn must be a module-level function; args are
    handed over by multiprocessing. Raises RankError naming every rank that failed or hung; after
    a first failure the others get `grace_s` to report their own error. `timeout_s` counts from
    when the last rank joined the group (at most STARTUP_S after the spawn)."""
    ctx = mp.get_context("spawn")  # fork would inherit the parent's thread pools mid-use
    with tempfile.TemporaryDirectory(prefix="ranks-") as tmp:
        dumps = [Path(tmp, f"stacks-{r}.txt") for r in range(world)]
        conns, procs = [], []
        for rank in range(world):
            recv, send = ctx.Pipe(duplex=False)
            proc = ctx.Process(target=_rank_main, daemon=True, args=(
                inspect.getfile(fn), fn.__qualname__, rank, world, str(Path(tmp, "store")),
                str(dumps[rank]), timeout_s, args, send))
            proc.start()
            send.close()
            conns.append(recv)
            procs.append(proc)
        try:
            outcomes, started = _collect(conns, procs, timeout_s, grace_s)
            hung = [r for r in range(world) if r not in outcomes]
            for rank in hung:
                if procs[rank].is_alive() and procs[rank].pid is not None:
                    os.kill(procs[rank].pid, signal.SIGUSR1)  # faulthandler: write all stacks
            time.sleep(0.5 if hung else 0)
            failed = any("error" in o for o in outcomes.values())
            why = ("killed after another rank failed" if failed
                   else f"timed out after {timeout_s:.0f} s" if len(started) == world
                   else f"not all ranks joined the group within {STARTUP_S:.0f} s")
            for rank in hung:
                stacks = dumps[rank].read_text() if dumps[rank].exists() else ""
                outcomes[rank] = {"error": f"{why}; its stacks:\n{stacks}"}
        finally:
            for proc in procs:
                if proc.is_alive():
                    proc.kill()
                proc.join(5)
    errors = [f"rank {r}: {outcomes[r]['error']}" for r in range(world) if "error" in outcomes[r]]
    if errors:
        raise RankError(f"{len(errors)} of {world} ranks failed\n" + "\n".join(errors))
    return [outcomes[r]["ok"] for r in range(world)]


def _collect(conns: list[Connection], procs: list[mp.process.BaseProcess], timeout_s: float,
             grace_s: float) -> tuple[dict[int, dict], set[int]]:
    """Each rank's outcome, until all reported, or the timeout after all started (STARTUP_S
    after the spawn at most), or the grace after a failure; and the ranks that started."""
    outcomes: dict[int, dict] = {}
    started: set[int] = set()
    deadline = time.monotonic() + STARTUP_S
    while len(outcomes) < len(conns) and time.monotonic() < deadline:
        for rank, conn in enumerate(conns):
            if rank in outcomes:
                continue
            if conn.poll(0.05):
                try:
                    message = json.loads(conn.recv_bytes())
                except EOFError:
                    message = {"error": "exited without a result"}
                if "started" in message:
                    started.add(rank)
                    if len(started) == len(conns):
                        deadline = min(deadline, time.monotonic() + timeout_s)
                    continue
                outcomes[rank] = message
                if "error" in outcomes[rank]:
                    deadline = min(deadline, time.monotonic() + grace_s)
            elif not procs[rank].is_alive() and not conn.poll(0):
                outcomes[rank] = {"error": f"exited with code {procs[rank].exitcode} without a result"}
                deadline = min(deadline, time.monotonic() + grace_s)
    return outcomes, started
