"""Weights & Biases: online where its server answers, else offline (a run folder under
<run dir>/wandb/ to `wandb sync` later). Training never waits on the network: the probe is bounded
and wandb uploads from its own process."""

from __future__ import annotations

import hashlib
import html
import logging
import math
import socket
import threading
from pathlib import Path
from typing import Any, Literal

from mshpc.config import RunConfig
from mshpc.errors import ConfigError, RunEnvironmentError
from mshpc.loggers.sinks import describe
from mshpc.loggers.tensorboard_log import tag

log = logging.getLogger(__name__)

INSTALL = "pip install 'mshpc[wandb]' (or pip install wandb)"
SERVER = ("api.wandb.ai", 443)
PROBE_S = 2.0  # the most start-up waits to learn that there is no network


def reachable(address: tuple[str, int] = SERVER, timeout_s: float = PROBE_S) -> bool:
    """Whether a TCP connection to `address` opens within `timeout_s` (name lookup included: it
    runs on a side thread, since getaddrinfo itself has no timeout)."""
    result: list[bool] = []

    def probe() -> None:
        try:
            socket.create_connection(address, timeout=timeout_s).close()
            result.append(True)
        except OSError:
            result.append(False)

    thread = threading.Thread(target=probe, name="mshpc-wandb-probe", daemon=True)
    thread.start()
    thread.join(timeout_s)
    return bool(result and result[0])


class WandbLogger:
    """Rows as wandb history at their step; events as text (and a 1 under events/<kind>) with the
    next row. The run id is the run directory's, so a resumed attempt continues the same run."""

    def __init__(self, run_dir: Path, start_step: int, *, run: RunConfig, config_record: dict[str, Any]) -> None:
        try:
            import wandb
        except ImportError:
            raise ConfigError(f"run.loggers names 'wandb' but the wandb package is not installed: {INSTALL}") from None
        self.wandb = wandb
        # None leaves the choice to wandb (WANDB_MODE, its settings): online unless told otherwise
        mode: Literal["offline"] | None = None if reachable() else "offline"
        run_id = f"{run.name}-{hashlib.sha256(str(run_dir.resolve()).encode()).hexdigest()[:8]}"
        try:
            self.run = wandb.init(project=run.wandb_project, name=run.name, id=run_id,
                                  dir=str(run_dir), config=config_record, mode=mode, resume="allow",
                                  # silent: one log line below says where it logs; console off:
                                  # no capture of the process's output, which every log line would pay
                                  settings=wandb.Settings(silent=True, console="off"))
        except OSError as exc:
            raise RunEnvironmentError(f"run.loggers 'wandb': cannot write {run_dir} ({exc.strerror})") from None
        except wandb.Error as exc:
            raise ConfigError(f"run.loggers 'wandb' could not start: {str(exc).splitlines()[0]} "
                              "(log in with `wandb login`, or set WANDB_MODE=offline)") from None
        log.info("wandb: %s run %s in %s", self.run.settings.mode, run_id, run_dir / "wandb")

    def write(self, row: dict[str, Any]) -> None:
        numbers: dict[str, Any] = {tag(k): v for k, v in row.items() if k != "step" and isinstance(v, (int, float))
                   and not isinstance(v, bool) and math.isfinite(v)}
        # a list of numbers (a MoE layer's tokens per expert): a histogram of their spread
        numbers.update({tag(k): self.wandb.Histogram(v) for k, v in row.items() if isinstance(v, list) and v
                        and all(isinstance(x, (int, float)) for x in v)})
        self.run.log(numbers, step=row["step"])

    def event(self, record: dict[str, Any], step: int) -> None:
        kind = record.get("kind", "event")
        # commit=False: carried by the next row, whose step is past this one's (wandb drops a
        # step that goes back)
        self.run.log({f"events/{kind}": 1, "events/text": self.wandb.Html(f"<pre>{html.escape(describe(record))}</pre>")},
                     commit=False)

    def close(self) -> None:
        self.run.finish()
        # finish() can return before wandb's service process has written the run's last records;
        # stopping the service waits for them (only this process of the run uses it)
        self.wandb.teardown()
