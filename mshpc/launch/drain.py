"""Admin mode: drain a node in Slurm with an mshpc reason, so no job lands on it until a person
looks: an evicted node (`supervisor.drain: true`) or a node failing `mshpc preflight --drain`.
Another tool's or an admin's reason is never overwritten; ours (any reason starting with 'mshpc')
may be replaced by a newer one. Never from a prolog or HealthCheckProgram: scontrol there can
deadlock slurmctld."""

from __future__ import annotations

import subprocess

OURS = "mshpc"  # "mshpc: ..." from the supervisor, "mshpc-preflight: ..." from preflight
REASON_CHARS = 200  # Slurm keeps long reasons, but sinfo and squeue show the start


def current_reason(node: str) -> str | None:
    """The node's drain/down reason, or None when it has none."""
    out = subprocess.run(["sinfo", "--noheader", "--Node", f"--nodes={node}", "--format=%E"],
                         capture_output=True, text=True, timeout=30, check=True).stdout.strip()
    return None if out in ("", "none") else out


def drain(node: str, reason: str) -> str:
    """Drain `node` with `reason` (which starts with OURS) unless another reason is set there;
    one line saying what was done."""
    try:
        existing = current_reason(node)
        if existing is not None and not existing.startswith(OURS):
            return f"not draining {node}: it has another reason already ({existing!r})"
        reason = reason[:REASON_CHARS]
        subprocess.run(["scontrol", "update", f"NodeName={node}", "State=DRAIN", f"Reason={reason}"],
                       capture_output=True, text=True, timeout=30, check=True)
        return f"drained {node}: {reason}"
    except (OSError, subprocess.SubprocessError) as exc:
        stderr = getattr(exc, "stderr", "") or ""
        return f"could not drain {node}: {exc} {stderr.strip()}".strip()
