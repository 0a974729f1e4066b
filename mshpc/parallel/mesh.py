"""The 3D mesh: which (pp, dp, tp) coordinates a global rank has.

tp is innermost, so the ranks of one tensor-parallel group are consecutive and sit on one node
(their all-gathers and reduce-scatters are the most frequent and need the fastest link); dp is
next; pp is outermost (Megatron-LM's order; MegaScale sec. 3.2). The process groups are built
on top of this by the parallelism code; this module only does the arithmetic, so the
supervisor and the diagnosis can name a rank's coordinates without any process group.
"""

from __future__ import annotations

from dataclasses import dataclass

from mshpc.errors import ConfigError


@dataclass(frozen=True)
class Coords:
    pp: int
    dp: int
    tp: int

    def __str__(self) -> str:
        return f"(dp={self.dp}, tp={self.tp}, pp={self.pp})"


@dataclass(frozen=True)
class MeshShape:
    pp: int
    dp: int
    tp: int

    @property
    def world_size(self) -> int:
        return self.pp * self.dp * self.tp

    def coords(self, rank: int) -> Coords:
        """The coordinates of global `rank`."""
        if not 0 <= rank < self.world_size:
            raise ConfigError(f"rank {rank} is outside a mesh of {self.world_size} ranks {self}")
        return Coords(pp=rank // (self.dp * self.tp), dp=(rank // self.tp) % self.dp, tp=rank % self.tp)

    def rank(self, c: Coords) -> int:
        """The global rank at coordinates `c`."""
        return (c.pp * self.dp + c.dp) * self.tp + c.tp
