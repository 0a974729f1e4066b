"""Admin mode (`--drain`): drain each failing node in Slurm with a prefixed reason, never
overwriting a reason another tool (or an admin) set. Not for the quick level, which must be safe
inside a prolog or HealthCheckProgram, where calling scontrol can deadlock slurmctld."""

from __future__ import annotations

import subprocess

REASON_PREFIX = "mshpc-preflight:"
REASON_CHARS = 200  # Slurm keeps long reasons, but sinfo and squeue show the start


def current_reason(node: str) -> str | None:
    """The node's drain/down reason, or None when it has none."""
    out = subprocess.run(["sinfo", "--noheader", "--Node", f"--nodes={node}", "--format=%E"],
                         capture_output=True, text=True, timeout=30, check=True).stdout.strip()
    return None if out in ("", "none") else out


def drain(reasons: dict[str, str]) -> list[str]:
    """Drain each node with REASON_PREFIX + its reason; one line per node saying what was done."""
    done = []
    for node, why in reasons.items():
        try:
            existing = current_reason(node)
            if existing is not None and not existing.startswith(REASON_PREFIX):
                done.append(f"not draining {node}: it has another reason already ({existing!r})")
                continue
            reason = f"{REASON_PREFIX} {why}"[:REASON_CHARS]
            subprocess.run(["scontrol", "update", f"NodeName={node}", "State=DRAIN", f"Reason={reason}"],
                           capture_output=True, text=True, timeout=30, check=True)
            done.append(f"drained {node}: {reason}")
        except (OSError, subprocess.SubprocessError) as exc:
            stderr = getattr(exc, "stderr", "") or ""
            done.append(f"could not drain {node}: {exc} {stderr.strip()}".strip())
    return done
