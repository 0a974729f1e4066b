"""Admin mode: drain an evicted node in Slurm (`supervisor.drain: true`), so no job lands on it
until a person looks. Another tool's reason on the node is never overwritten."""

from __future__ import annotations

import logging
import subprocess

log = logging.getLogger(__name__)

REASON_PREFIX = "mshpc:"


def node_reason(host: str) -> str:
    """The node's current Reason ('' when none)."""
    out = subprocess.run(["scontrol", "-o", "show", "node", host], capture_output=True, text=True, timeout=30)
    fields = out.stdout.strip()
    if "Reason=" not in fields:
        return ""
    # Reason is the one field whose value holds spaces; it runs until the next " Key=" or the end.
    value = fields.split("Reason=", 1)[1]
    return value.split(" [", 1)[0].strip()


def drain(host: str, why: str) -> str:
    """Drain `host` with reason 'mshpc: WHY' unless another tool's reason is set; says what it did."""
    current = node_reason(host)
    if current and not current.startswith(REASON_PREFIX):
        log.warning("not draining %s: it has another tool's reason %r", host, current)
        return f"skipped: {host} has another reason ({current})"
    reason = f"{REASON_PREFIX} {why}"[:200]
    out = subprocess.run(["scontrol", "update", f"NodeName={host}", "State=DRAIN", f"Reason={reason}"],
                         capture_output=True, text=True, timeout=30)
    if out.returncode != 0:
        log.error("scontrol drain %s failed: %s", host, out.stderr.strip())
        return f"failed: {out.stderr.strip()}"
    return f"drained: {reason}"
