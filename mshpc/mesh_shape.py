"""The 3D mesh's arithmetic: which (pp, dp, tp) coordinates a global rank has, and which ranks
share each of its groups. Torch-free, so the supervisor, the heartbeat and the offline diagnosis
name a rank's coordinates without importing torch.distributed; `mshpc.parallel.mesh` builds the
process groups from it.

tp is innermost, so the ranks of one tensor-parallel group are consecutive and sit on one node
(their all-gathers and reduce-scatters are the most frequent and need the fastest link); dp is
next; pp is outermost (Megatron-LM's order; MegaScale sec. 3.2).

Expert parallelism (ep) is carved out of dp, as Megatron-Core does: the ep consecutive dp ranks
of a block (same pp and tp) split a mixture of experts' experts between them, and each expert
is replicated over the dp / ep blocks, its expert-data-parallel (edp) group.
"""

from __future__ import annotations

from dataclasses import dataclass

from mshpc.errors import ConfigError

# The order build_mesh creates groups in; every rank creates all of them, in this order (see there).
GROUP_NAMES = ("tp", "dp", "pp", "mp", "embed", "ep", "edp")


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
    ep: int = 1  # expert parallelism, a divisor of dp (the dp ranks it is carved out of)

    def __post_init__(self) -> None:
        if self.dp % self.ep:
            raise ConfigError(f"parallel.ep={self.ep} does not divide dp={self.dp} (expert parallelism is carved "
                              "out of the data-parallel ranks)")

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

    def group_ranks(self, rank: int) -> dict[str, tuple[int, ...]]:
        """The global ranks of each of `rank`'s groups, by name (GROUP_NAMES): tp, dp and pp vary
        one coordinate; mp (model parallel) is every rank with this dp coordinate, the group
        whose ranks together hold one copy of the model; embed is the first and last pp stage of
        this rank's pipeline (they both hold the tied embedding), a middle stage alone; ep is the
        block of ep consecutive dp ranks this rank's experts are split over, edp the dp ranks that
        hold the same experts (one per block)."""
        c = self.coords(rank)
        at = self.rank
        last = self.pp - 1
        embed = sorted({at(Coords(0, c.dp, c.tp)), at(Coords(last, c.dp, c.tp))})
        block = c.dp - c.dp % self.ep
        return {
            "tp": tuple(at(Coords(c.pp, c.dp, t)) for t in range(self.tp)),
            "dp": tuple(at(Coords(c.pp, d, c.tp)) for d in range(self.dp)),
            "pp": tuple(at(Coords(p, c.dp, c.tp)) for p in range(self.pp)),
            "mp": tuple(at(Coords(p, c.dp, t)) for p in range(self.pp) for t in range(self.tp)),
            "embed": tuple(embed) if c.pp in (0, last) else (rank,),
            "ep": tuple(at(Coords(c.pp, block + e, c.tp)) for e in range(self.ep)),
            "edp": tuple(at(Coords(c.pp, d, c.tp)) for d in range(c.dp % self.ep, self.dp, self.ep)),
        }

    def all_groups(self) -> dict[str, list[tuple[int, ...]]]:
        """Every group of the job, by name: what a rank that creates all of them walks."""
        out: dict[str, list[tuple[int, ...]]] = {name: [] for name in GROUP_NAMES}
        for rank in range(self.world_size):
            for name, ranks in self.group_ranks(rank).items():
                if ranks not in out[name]:
                    out[name].append(ranks)
        return out
