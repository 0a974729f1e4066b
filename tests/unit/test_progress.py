"""Rank 0's console: each step's line with elapsed time, ETA, learning rate, tokens/s and MFU; a
line of its own for each validation and data epoch; log records never glued to the bar; one
summary at the end."""

import io
import logging
from pathlib import Path

from mshpc.progress import CLEAR_LINE, Kept, Progress, RunTally, summary_lines


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def screen(text: str) -> list[str]:
    """What a terminal shows of `text`: a carriage return goes back to the line's start, the
    erase sequence clears the line; characters written after a return overwrite from there."""
    lines, line = [], ""
    for i, chunk in enumerate(text.replace(CLEAR_LINE, "\r\x00").split("\r")):
        if i and chunk.startswith("\x00"):
            line, chunk = "", chunk[1:]
        elif i:
            line = ""  # a bare return: the bar redraws the whole line
        for j, part in enumerate(chunk.split("\n")):
            if j:
                lines.append(line)
                line = ""
            line += part
    return lines + ([line] if line else [])


def test_each_step_shows_elapsed_eta_lr_tokens_and_mfu():
    out, clock = io.StringIO(), Clock()
    progress = Progress(10, "lines", out, now=clock)
    for done in range(1, 5):
        clock.t += 2.0
        progress.update(done, 3.1 - done / 10, 12_345.6, 0.031, 1.5e-3)
    lines = out.getvalue().splitlines()
    assert lines[0] == "step 1/10 loss 3.0000 lr 1.50e-03 12,346 tok/s mfu 3.1% elapsed 0:02"  # no ETA yet
    # 2 s a step since the first (which may compile): 6 steps left, 12 s
    assert lines[3] == "step 4/10 loss 2.7000 lr 1.50e-03 12,346 tok/s mfu 3.1% elapsed 0:08 eta 0:12"


def test_validation_and_epoch_notices_are_lines_of_their_own():
    out = io.StringIO()
    progress = Progress(6, "lines", out, windows_per_epoch=10, global_batch=4, now=Clock())
    for done in range(1, 7):
        progress.update(done, 2.0, 1.0, None)
        if done == 2:
            progress.validation(done, {"val_loss": 2.25, "val_ppl": 9.49, "eval_s": 0.4})
    lines = out.getvalue().splitlines()
    assert lines[2] == "step 2/6 val_loss 2.2500 val_ppl 9.49 (0.4 s)"
    # 4 windows a step out of 10: step 3 reads windows 8-11, the second pass's first two
    notices = [line for line in lines if line.startswith("data:")]
    assert notices == ["data: epoch 2 began at step 3 (every one of the 10 training windows read 1 time; "
                       "now in a new order)",
                       "data: epoch 3 began at step 6 (every one of the 10 training windows read 2 times; "
                       "now in a new order)"]


def test_a_log_record_is_never_glued_to_the_bar():
    out = io.StringIO()
    handler = logging.StreamHandler(out)  # the terminal's other stream, here the same buffer
    handler.setFormatter(logging.Formatter("mshpc: %(message)s"))
    root = logging.getLogger()
    root.addHandler(handler)
    try:
        progress = Progress(3, "bar", out, now=Clock())
        progress.update(1, 2.5, 100.0, None, 1e-3)
        logging.getLogger("mshpc.test").warning("straggler: rank 1")
        progress.update(2, 2.4, 100.0, None, 1e-3)
        progress.update(3, 2.3, 100.0, None, 1e-3)
        progress.close()
    finally:
        root.removeHandler(handler)
    shown = screen(out.getvalue())
    assert shown[0] == "mshpc: straggler: rank 1"  # the bar was wiped, then redrawn below it
    assert shown[1].startswith("[########################] step 3/3 loss 2.3000") and len(shown) == 2
    assert not handler.filters  # closing the progress takes its filter off


def test_the_summary_says_steps_tokens_time_losses_checkpoints_and_the_report(tmp_path):
    tally = RunTally(first_step=100, steps=100, last_loss=1.2345, val=[(120, 1.6), (160, 1.41), (200, 1.45)])
    lines = summary_lines(tally, 200, 65.0, 4096, Path("runs/tiny"), Kept(Path("runs/tiny/checkpoints"), 200, 3))
    assert lines == [
        "finished steps 101-200 of 200: 409,600 tokens in 1:05 (6,302 tok/s); last loss 1.2345",
        "validation: best val_loss 1.4100 at step 160, last 1.4500 at step 200",
        "checkpoints: runs/tiny/checkpoints (latest step 200, 3 kept)",
        "run directory: runs/tiny (metrics.jsonl, events.jsonl); report: `mshpc diagnose runs/tiny` writes "
        "runs/tiny/report/index.html",
    ]
    none = summary_lines(RunTally(first_step=0, steps=2), 2, 1.0, 10, Path("r"), Kept(Path("r/c"), None, 0))
    assert none[1] == "checkpoints: none (checkpoint.interval_steps=0)"
