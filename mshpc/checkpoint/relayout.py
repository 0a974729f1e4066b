"""Resume at another tensor- or pipeline-parallel layout (a dp change needs nothing: ZeRO
shards are flat ranges, and reader.py reads any range).

tp: a tp-split weight is saved per tp rank, as `<prefix>/<name>@tp<r>` (state.py), with the
rule that cut it in the manifest's extras. At another tp a rank joins the old parts of each
weight it holds into the whole weight and cuts out its own part under its new key. A restore at
another tp is rare (a restart on other hardware), so a rank reads every old part of each weight
it touches, not only the ranges it needs: up to tp times its usual restore.

pp: names are the full model's at every pp, so a stage finds its layers whatever stage wrote
them. The one exception is the tied embedding's copy on the last stage (`lm_head.weight`), which
a checkpoint written at pp=1 holds only as `tok_embeddings.weight`: the same values, since
the copies' gradients are summed every step. That copy is read under its partner's name.

Everything else (tp-replicated norms, `optim.step`, RNG) is named alike at every layout.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from mshpc.checkpoint.reader import CheckpointReader, Request
from mshpc.errors import CheckpointError
from mshpc.parallel.pipeline import TIED
from mshpc.parallel.tp_split import TpSplit
from mshpc.tensor_slice import SliceReader

SPLITS_KEY = "tp_splits"  # manifest extras: {parameter name: TpSplit.to_json()}, written at tp > 1


def splits_extra(splits: dict[str, TpSplit]) -> dict[str, list]:
    return {name: split.to_json() for name, split in sorted(splits.items())}


@dataclass(frozen=True)
class Source:
    """What the saved checkpoint holds of one tensor this rank wants."""

    names: list[str]  # saved tensors, in old tp-rank order when split is set
    split: TpSplit | None  # join `names` and cut this rank's part; None: names[0] is the tensor


@dataclass(frozen=True)
class Relayout:
    """Maps the names this rank asks for onto what the checkpoint saved; the identity when the
    layouts agree."""

    old_tp: int
    new_tp: int
    new_rank: int  # this rank's tp rank at new_tp
    splits: dict[str, TpSplit] = field(default_factory=dict)  # by parameter name
    aliases: dict[str, str] = field(default_factory=dict)  # parameter name -> the name it was saved as

    @staticmethod
    def build(reader: CheckpointReader, new_tp: int, new_rank: int, current: dict[str, TpSplit],
              tied: frozenset[str]) -> Relayout:
        """`current`: how this run's model is cut (empty at tp=1); the checkpoint's own rule
        wins where it wrote at tp > 1. `tied`: this stage's copy of the tied embedding, if any."""
        old_tp = reader.catalog.head.layout.get("tp", 1)
        partner = {TIED[0]: TIED[1], TIED[1]: TIED[0]}
        aliases = {n: partner[n] for n in tied if not reader.names(f"master/{n}")}
        if old_tp == new_tp:
            return Relayout(old_tp, new_tp, new_rank, aliases=aliases)
        if old_tp == 1:
            return Relayout(old_tp, new_tp, new_rank, dict(current), aliases)
        raw = reader.catalog.head.extras.get(SPLITS_KEY)
        if raw is None:
            raise CheckpointError(f"{reader.folder} was written at parallel.tp={old_tp} without its tp split "
                                  f"rules (an older mshpc); resume it at parallel.tp={old_tp}")
        return Relayout(old_tp, new_tp, new_rank, {n: TpSplit.from_json(v) for n, v in raw.items()}, aliases)

    def source(self, name: str) -> Source | None:
        """Where new-layout tensor `name` (`<prefix>/<key>`) comes from; None: saved as `name`."""
        if "/" not in name:
            return None
        prefix, key = name.split("/", 1)
        base, _, tp_rank = key.partition("@tp")
        saved = self.aliases.get(base, base)
        split = self.splits.get(base) if self.old_tp != self.new_tp else None
        if split is not None:
            if self.old_tp == 1:
                return Source([f"{prefix}/{saved}"], split)
            return Source([f"{prefix}/{saved}@tp{k}" for k in range(self.old_tp)], split)
        if saved == base:
            return None
        return Source([f"{prefix}/{saved}" + (f"@tp{tp_rank}" if tp_rank else "")], None)

    def _cut(self, source: Source, parts: list[torch.Tensor]) -> torch.Tensor:
        if source.split is None:
            return parts[0]
        whole = parts[0] if self.old_tp == 1 else source.split.join(parts)
        return whole if self.new_tp == 1 else source.split.part(whole, self.new_rank, self.new_tp)

    def shape(self, reader: CheckpointReader, name: str) -> tuple[int, ...]:
        """The global shape tensor `name` has at this layout (worked out on meta tensors: no bytes read)."""
        source = self.source(name)
        if source is None:
            return reader.global_shape(name)
        parts = [torch.empty(reader.global_shape(n), device="meta") for n in source.names]
        return tuple(self._cut(source, parts).shape)

    def requests(self, reader: CheckpointReader, request: Request) -> list[Request]:
        """What the saved checkpoint must supply for `request`, a range of a new-layout tensor."""
        name, start, numel = request
        source = self.source(name)
        if source is None:
            return [request]
        if source.split is None:
            return [(source.names[0], start, numel)]
        return [reader.whole(n) for n in source.names]

    def reader(self, reader: CheckpointReader) -> SliceReader:
        """`reader.read`, answering for new-layout names."""
        def read(name: str, start: int, numel: int) -> torch.Tensor:
            source = self.source(name)
            if source is None:
                return reader.read(name, start, numel)
            if source.split is None:
                return reader.read(source.names[0], start, numel)
            local = self._cut(source, [reader.read_whole(n) for n in source.names])
            return local.reshape(-1)[start:start + numel]
        return read
