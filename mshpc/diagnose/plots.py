"""The report's figures, drawn with matplotlib (Agg: no display needed) into PNG files."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only; must precede pyplot's import

import matplotlib.pyplot as plt
import numpy as np

from mshpc.diagnose.analysis import Analysis, RankSummary, tflops_series
from mshpc.diagnose.by_node import by_host, slowest_first, slowest_per_group
from mshpc.diagnose.timers import CATEGORIES
from mshpc.diagnose.timings import RankInfo

DPI = 110
COLOURS = {"compute": "#4878d0", "communication": "#ee854a", "data wait": "#6acc64", "bubble": "#d65f5f",
           "checkpoint": "#956cb4", "eval": "#8c613c", "other": "#bbbbbb"}
VAL = "#d62728"  # the validation curve beside the training loss
SLOW = "#c0392b"  # a straggler's label
MAX_LABELLED_RANKS = 64  # past this, per-rank labels would overprint: rows become nodes
NAMED_NODES = 8  # slowest nodes named on a per-node heatmap
SHOWN_SLOWEST = 16  # ranks in the breakdown past MAX_LABELLED_RANKS (and the median one)
NAMED_IN_MESH = 3  # slowest ranks marked on a mesh too large to label every cell


def rank_label(info: RankInfo) -> str:
    c = info.coords
    return f"r{info.rank} {info.host} (dp{c.dp} tp{c.tp} pp{c.pp})"


def _save(fig: plt.Figure, path: Path) -> Path:
    fig.savefig(path, dpi=DPI, bbox_inches="tight")
    plt.close(fig)
    return path


def loss_and_mfu(a: Analysis, path: Path) -> Path:
    """Training loss with the validation loss beside it (eval.*), and MFU (or achieved TFLOP/s
    per device where no peak is known) over steps."""
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 5), sharex=True)
    logged = [r for r in a.metrics if r.get("loss") is not None]
    top.plot([r["step"] for r in logged], [r["loss"] for r in logged], color="#333333", lw=1, label="training")
    val = [(r["step"], r["val_loss"]) for r in a.metrics if r.get("val_loss") is not None]
    if val:
        top.plot(*zip(*val, strict=True), color=VAL, lw=1.5, marker="o", ms=3, label="validation")
        top.legend(fontsize=8, frameon=False)
    top.set_ylabel("loss")
    mfu = [(r["step"], r["mfu"]) for r in a.metrics if r.get("mfu") is not None]
    if mfu:
        bottom.plot(*zip(*mfu, strict=True), color=COLOURS["compute"], lw=1)
        bottom.set_ylabel("MFU")
    else:
        bottom.plot(*tflops_series(a), color=COLOURS["compute"], lw=1)
        bottom.set_ylabel("TFLOP/s per device\n(no peak known: no MFU)")
    for e in a.events:
        if e.get("kind") == "mfu_decline":
            bottom.axvline(e["step"], color=SLOW, ls="--", lw=1)
    bottom.set_xlabel("step")
    top.set_title(("training and validation loss" if val else "loss") + " and MFU" + ("  (dashed: MFU decline events)" if any(
        e.get("kind") == "mfu_decline" for e in a.events) else ""))
    return _save(fig, path)


def compute_heatmap(a: Analysis, path: Path) -> Path:
    """Per-rank compute time over steps: the straggler view (MegaScale Fig. 10). Past
    MAX_LABELLED_RANKS a row is a node (its slowest rank), and the slowest nodes are named."""
    t = a.timings
    assert t is not None
    compute = t.category("compute") * 1e3  # (ranks, steps) ms
    cols = a.steady_columns
    lo, hi = np.nanpercentile(compute[:, cols], [1, 99])
    per_node = len(t.ranks) > MAX_LABELLED_RANKS
    nodes = by_host(t.ranks)
    rows = slowest_per_group(compute, nodes) if per_node else compute
    height = 1.5 + 0.3 * min(len(rows), MAX_LABELLED_RANKS)
    fig, ax = plt.subplots(figsize=(9, height))
    image = ax.imshow(rows, aspect="auto", interpolation="nearest", cmap="magma", vmin=lo, vmax=hi,
                      extent=(t.steps[0] - 0.5, t.steps[-1] + 0.5, len(rows) - 0.5, -0.5))
    fig.colorbar(image, ax=ax, label="compute per step (ms)" + (", the node's slowest rank" if per_node else ""))
    slow = {s.rank for s in a.stragglers}
    if per_node:
        scores = _scores_in_rank_order(a)
        ranked = slowest_first(scores, nodes)
        # the stragglers' nodes and the nodes below the threshold; at least the slowest one
        named = [(g, r) for g, r in ranked[:NAMED_NODES]
                 if t.ranks[r].rank in slow or scores[r] < a.diagnose.straggler_threshold] or ranked[:1]
        index = {g.name: n for n, g in enumerate(nodes)}
        ticks = [(index[g.name], f"{g.name}: {rank_label(t.ranks[r])} score {scores[r]:.2f}",
                  t.ranks[r].rank in slow) for g, r in named]
        ax.set_ylabel(f"{len(nodes)} nodes (rows, in rank order); named: the slowest")
    else:
        ticks = [(i, rank_label(r) + ("  ◀ straggler" if r.rank in slow else ""), r.rank in slow)
                 for i, r in enumerate(t.ranks)]
    ax.set_yticks([row for row, _, _ in ticks], [label for _, label, _ in ticks])
    if per_node:  # a row is one pixel or less at 1,536 nodes: point at the named ones
        ax.plot([t.steps[0] - 0.5] * len(ticks), [row for row, _, _ in ticks], ">", color=SLOW, ms=9, clip_on=False)
    for label, (_, _, flagged) in zip(ax.get_yticklabels(), ticks, strict=True):
        if flagged:
            label.set_color(SLOW)
            label.set_fontweight("bold")
    ax.set_xlabel("step")
    ax.set_title("compute time per " + ("node" if per_node else "rank") + " and step (bright = slow)")
    return _save(fig, path)


def _scores_in_rank_order(a: Analysis) -> np.ndarray:
    """(ranks,) each rank's relative compute score, indexed like a.timings.ranks."""
    assert a.timings is not None
    by_rank = {r.info.rank: r.relative_score for r in a.ranks}
    return np.array([by_rank[r.rank] for r in a.timings.ranks])


def phase_breakdown(a: Analysis, path: Path) -> Path:
    """Seconds per step of each category, per rank, stacked; past MAX_LABELLED_RANKS, the
    SHOWN_SLOWEST slowest ranks and the median one (12,288 bars would be a grey wall)."""
    ranks = sorted(a.ranks, key=lambda r: r.info.rank)
    if len(ranks) > MAX_LABELLED_RANKS:
        ranks = [*a.ranks[:SHOWN_SLOWEST], a.ranks[len(a.ranks) // 2]]  # a.ranks: slowest first
    fig, ax = plt.subplots(figsize=(8, 1.2 + 0.35 * min(len(ranks), MAX_LABELLED_RANKS)))
    left = np.zeros(len(ranks))
    for cat in CATEGORIES:
        width = np.array([r.categories[cat] for r in ranks]) * 1e3
        ax.barh(range(len(ranks)), width, left=left, color=COLOURS[cat], label=cat)
        left += width
    if len(ranks) <= MAX_LABELLED_RANKS:
        labels = [rank_label(r.info) for r in ranks]
        if len(a.ranks) > MAX_LABELLED_RANKS:
            labels[-1] += "  (the median rank)"
        ax.set_yticks(range(len(ranks)), labels)
    ax.invert_yaxis()
    ax.set_xlabel("median ms per step")
    ax.legend(ncol=3, fontsize=8, loc="lower center", bbox_to_anchor=(0.5, 1.0), frameon=False)
    return _save(fig, path)


def mesh_view(a: Analysis, path: Path) -> Path:
    """One panel per pipeline stage, dp rows x tp columns; each cell a rank, coloured by its
    relative compute score, with the peer it waits on most (its slowest dependency)."""
    p = a.parallel
    by_coords = {r.info.coords: r for r in a.ranks}
    fig, axes = plt.subplots(1, p.pp, figsize=(min(4 + 2.2 * p.tp * p.pp, 18), min(1 + 1.1 * p.dp, 9)),
                             squeeze=False)
    norm = plt.Normalize(0.5, 1.0)
    cmap = plt.get_cmap("RdYlGn")
    labelled = p.world_size <= MAX_LABELLED_RANKS
    for stage, ax in enumerate(axes[0]):
        grid = np.full((p.dp, p.tp), np.nan)
        for c, r in by_coords.items():
            if c.pp == stage:
                grid[c.dp, c.tp] = r.relative_score
        ax.imshow(grid, cmap=cmap, norm=norm, aspect="auto")
        ax.set_title(f"stage pp={stage}" if p.pp > 2 else f"mesh dp={p.dp} tp={p.tp} pp={p.pp}: stage pp={stage}")
        ax.set_xticks(range(p.tp), [f"tp{t}" if p.pp <= 2 else str(t) for t in range(p.tp)])
        if p.dp <= MAX_LABELLED_RANKS:
            ax.set_yticks(range(p.dp), [f"dp{d}" for d in range(p.dp)])
        elif stage == 0:
            ax.set_ylabel(f"dp 0-{p.dp - 1} (a row: one tp group, one node)")
        for coords, r in by_coords.items():
            if coords.pp == stage and labelled:
                dep = f"\nwaits on r{r.dependency.rank} ({r.dependency.group})" if r.dependency else ""
                ax.text(coords.tp, coords.dp, f"r{r.info.rank} {r.info.host}\nscore {r.relative_score:.2f}{dep}",
                        ha="center", va="center", fontsize=7)
    if p.pp > 2:
        fig.suptitle(f"mesh dp={p.dp} x tp={p.tp} (columns) in each of pp={p.pp} stages")
    if not labelled:  # the stragglers, or else the slowest rank: circling healthy ranks says nothing
        flagged = {s.rank for s in a.stragglers}
        _mark_slowest(axes[0], [r for r in a.ranks if r.info.rank in flagged][:NAMED_IN_MESH] or a.ranks[:1])
    fig.colorbar(plt.cm.ScalarMappable(norm=norm, cmap=cmap), ax=axes[0].tolist(),
                 label="relative compute score (1 = the other ranks' median)")
    return _save(fig, path)


def _mark_slowest(axes: np.ndarray, slowest: list[RankSummary]) -> None:
    """Circle and name the slowest ranks on their stage's panel (cells too small for text)."""
    for r in slowest:
        c = r.info.coords
        ax = axes[c.pp]
        ax.scatter([c.tp], [c.dp], s=160, facecolors="none", edgecolors="black", linewidths=1.5)
        ax.annotate(f"r{r.info.rank} {r.info.host}\nscore {r.relative_score:.2f}", (c.tp, c.dp),
                    xytext=(6, 6), textcoords="offset points", fontsize=7, fontweight="bold")
