"""`data.record_windows`: each rank appends one line per step it trains, the sha256 of the token
windows the loader gave it, so that two runs (a resumed one and an uninterrupted one, say) can be
shown to have read the same windows step for step without keeping the tokens themselves."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from mshpc.batch import Batch
from mshpc.regular_files import open_regular


def record_path(run_dir: Path, rank: int) -> Path:
    """Where rank `rank` of the run in `run_dir` records its windows."""
    return run_dir / "windows" / f"rank-{rank:05d}.jsonl"


class WindowRecord:
    """An append-only JSON-lines file of {"step", "dp_rank", "sha256"} (step 0-based); a resumed
    run appends the steps it trains again, so the last line of a step is the one that counts."""

    def __init__(self, path: Path, dp_rank: int) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        # one os.write per line, O_APPEND: a line is whole on disk before the step trains on it,
        # whatever kills the process later
        self._fd = open_regular(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644, own=True)
        self.dp_rank = dp_rank

    def write(self, step: int, batch: Batch) -> None:
        tokens = batch.tokens.detach().cpu().contiguous().numpy()
        line = {"step": step, "dp_rank": self.dp_rank, "sha256": hashlib.sha256(tokens.tobytes()).hexdigest()}
        os.write(self._fd, (json.dumps(line) + "\n").encode())

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def read_record(path: Path) -> dict[int, str]:
    """step -> sha256 of the windows the rank trained on at that step (the last attempt's)."""
    steps: dict[int, str] = {}
    for line in path.read_text().splitlines():
        row = json.loads(line)
        steps[int(row["step"])] = str(row["sha256"])
    return steps
