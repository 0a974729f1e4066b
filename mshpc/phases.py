"""The train loop's phase names: one vocabulary for the phase timers (diagnose/timers.py), the
heartbeat (launch/heartbeat.py) and hang detection (launch/timeouts.py).

The heartbeat says which phase a rank is in (setup, data, step or compile, eval, checkpoint); the
timers split a step into forward, backward and optimizer (and each collective, "comm.<op>")."""

from __future__ import annotations

SETUP = "setup"  # the heartbeat, before the first step: imports, rendezvous, resume
DATA = "data"  # waiting for the step's batch
STEP = "step"  # the heartbeat: forward, backward and update; the timers split it:
FORWARD, BACKWARD, OPTIMIZER = "forward", "backward", "optimizer"
COMPILE = "compile"  # the heartbeat: train.compile's first step, which compiles the blocks
EVAL = "eval"  # validation, every eval.interval_steps
CHECKPOINT = "checkpoint"  # a save's blocking part, and a failing rank's wait for the save in flight
OTHER = "other"  # the timers: what no phase covers
# Long and rare: hang detection gives them supervisor.checkpoint_timeout_s as their floor
LONG = frozenset({CHECKPOINT, EVAL, COMPILE})
