"""What `mshpc preflight` was asked to do (level and outputs), checked before any rank starts."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from mshpc.errors import ConfigError
from mshpc.preflight.tiers import Tier, tier

VERDICT_FAIL_EXIT = 3  # 0: pass (warnings allowed); 1: a crash; 2: a user error; 3: a node failed


@dataclass(frozen=True)
class Options:
    level: str
    json_path: Path | None = None
    exclude_path: Path | None = None
    drain: bool = False


def check_options(opts: Options) -> Tier:
    """The level's tier; stops on a bad combination before any rank starts."""
    chosen = tier(opts.level)
    if opts.drain and opts.level == "quick":
        raise ConfigError("--drain cannot run with --level quick: the quick level is for prologs and "
                          "HealthCheckProgram, which must not call scontrol (use --level standard or extended)")
    return chosen
