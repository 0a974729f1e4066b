"""`mshpc diagnose RUN_DIR`: report/index.html with its PNGs (one page that opens from disk: no
server, no script, no CDN), and a short summary for the terminal."""

from __future__ import annotations

import html
import json
import time
from pathlib import Path

import numpy as np

from mshpc.diagnose import plots
from mshpc.diagnose.analysis import Analysis, RankSummary, analyse, mfu_trend
from mshpc.diagnose.by_node import by_host, slowest_first
from mshpc.diagnose.expert_plots import expert_layers, expert_load, expert_summary
from mshpc.diagnose.timers import CATEGORIES

REPORT_DIR = "report"
SHOWN_RANKS = 3  # slowest ranks named in the summary


def _coords(r: RankSummary) -> str:
    c = r.info.coords
    return f"(dp={c.dp}, tp={c.tp}, pp={c.pp})"


def summary_lines(a: Analysis) -> list[str]:
    """What the terminal shows: run, slowest ranks, biggest phase, MFU trend."""
    p = a.parallel
    lines = [f"run {a.run_dir}: {p.world_size} ranks (dp={p.dp}, tp={p.tp}, pp={p.pp})"]
    if a.timings is None:
        return lines + ["no timings/ (diagnose.timers was off): no per-rank view"]
    steps = a.timings.steps
    lines[0] += f", steps {steps.min()}-{steps.max()}"
    if a.earlier_layout_ranks:
        lines.append(f"resumed at another layout: the per-rank view is of the last one (dp={p.dp}, tp={p.tp}, "
                     f"pp={p.pp}); {a.earlier_layout_ranks} rank(s) trained only at an earlier one, left out")
    flagged = {s.rank: s for s in a.stragglers}
    lines.append("slowest ranks (relative compute score: the other ranks' median time over its own):")
    for r in a.ranks[:SHOWN_RANKS]:
        line = (f"  rank {r.info.rank} on {r.info.host} {_coords(r)}: compute {1e3 * r.categories['compute']:.1f} "
                f"ms/step, score {r.relative_score:.2f}")
        s = flagged.get(r.info.rank)
        if s is not None:
            line += (f"  STRAGGLER since step {s.since_step} ({s.category} score {s.relative_score:.2f} at the end, "
                     f"mostly {s.phase}); candidate for eviction")
        lines.append(line)
    if not flagged:
        d = a.diagnose
        lines.append("  no straggler: no rank is persistently slower than its peers below the warning floor "
                     f"(score < {d.straggler_warn_below}; flags under {d.straggler_threshold} above it are events only)")
    lines.append(_biggest_phase(a))
    lines.append(_mfu_line(a))
    val = [(r["step"], r["val_loss"]) for r in a.metrics if r.get("val_loss") is not None]
    if val:
        lines.append(f"validation loss: {val[0][1]:.4g} at step {val[0][0]} -> {val[-1][1]:.4g} at step "
                     f"{val[-1][0]} ({len(val)} evaluations)")
    return lines


def _biggest_phase(a: Analysis) -> str:
    name, share = next(iter(a.phase_share.items()))
    totals = {c: sum(r.categories[c] for r in a.ranks) for c in CATEGORIES}
    whole = sum(totals.values()) or 1.0
    split = ", ".join(f"{c} {100 * v / whole:.0f}%" for c, v in totals.items())
    return f"biggest phase: {name}, {100 * share:.0f}% of a step; all ranks: {split}"


def _mfu_line(a: Analysis) -> str:
    trend = mfu_trend(a)
    if trend is None:
        return "MFU trend: too few logged steps"
    first, last = trend
    peak = a.peak_tflops or _peak_from_metrics(a)
    unit = f"MFU {first / peak:.3f} -> {last / peak:.3f}" if peak else f"{first:.3g} -> {last:.3g} TFLOP/s per device"
    declines = [e for e in a.events if e.get("kind") == "mfu_decline"]
    change = 100 * (last - first) / first if first else 0.0
    return (f"MFU trend: {unit} ({change:+.0f}%, first vs last window)"
            + (f"; {len(declines)} decline event(s), first at step {declines[0]['step']}" if declines else ""))


def _peak_from_metrics(a: Analysis) -> float | None:
    """The peak the run used, recovered from a logged (mfu, tflops) pair."""
    for r in reversed(a.metrics):
        if r.get("mfu") and r.get("tflops"):
            return r["tflops"] / r["mfu"]
    return None


def _table(head: list[str], rows: list[list[str]]) -> str:
    cells = "".join(f"<th>{html.escape(h)}</th>" for h in head)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>" for row in rows)
    return f"<table><tr>{cells}</tr>{body}</table>"


def _rank_rows(a: Analysis) -> list[list[str]]:
    flagged = {s.rank for s in a.stragglers}
    rows = []
    for r in sorted(a.ranks, key=lambda r: r.info.rank):
        dep = f"r{r.dependency.rank} ({r.dependency.group})" if r.dependency else "-"
        ind = "-" if r.individual_score is None else f"{r.individual_score:.2f}"
        rows.append([str(r.info.rank), r.info.host, _coords(r), f"{1e3 * r.step_s:.1f}",
                     *(f"{1e3 * r.categories[c]:.1f}" for c in CATEGORIES),
                     f"{r.relative_score:.2f}", ind, dep, "STRAGGLER" if r.info.rank in flagged else ""])
    return rows


RANK_HEAD = ["rank", "host", "coords", "step ms", *(f"{c} ms" for c in CATEGORIES),
             "relative", "individual", "slowest dependency", ""]


def _ranks_section(a: Analysis) -> str:
    """Every rank in one table; past MAX_LABELLED_RANKS, one line per node, slowest first, each
    opening (a <details>, no script) on its ranks."""
    rows = _rank_rows(a)  # in rank order
    if len(rows) <= plots.MAX_LABELLED_RANKS:
        return "<h2>Ranks (medians per step)</h2>" + _table(RANK_HEAD, rows)
    ranks = sorted(a.ranks, key=lambda r: r.info.rank)
    flagged = {s.rank for s in a.stragglers}
    nodes = slowest_first(np.array([r.relative_score for r in ranks]), by_host([r.info for r in ranks]))
    parts = [f"<h2>Nodes ({len(nodes)}), slowest first: open one for its ranks (medians per step)</h2>"]
    for group, worst in nodes:
        r = ranks[worst]
        mark = "  STRAGGLER" if any(ranks[i].info.rank in flagged for i in group.rows) else ""
        summary = (f"{group.name}: slowest rank {r.info.rank} {_coords(r)}, score {r.relative_score:.2f}, "
                   f"compute {1e3 * r.categories['compute']:.1f} ms{mark}")
        parts.append(f"<details{' open' if mark else ''}><summary>{html.escape(summary)}</summary>"
                     + _table(RANK_HEAD, [rows[i] for i in group.rows]) + "</details>")
    return "\n".join(parts)


def _event_rows(a: Analysis) -> list[list[str]]:
    rows = []
    for e in a.events:
        fields = {k: v for k, v in e.items() if k not in ("time", "kind")}
        rows.append([time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(e.get("time", 0))), str(e.get("kind")),
                     json.dumps(fields)])
    return rows


STYLE = ("body{font-family:sans-serif;max-width:1100px;margin:2em auto;color:#222}"
         "table{border-collapse:collapse;font-size:13px;margin:1em 0}td,th{border:1px solid #ccc;"
         "padding:3px 7px;text-align:right}th{background:#f3f3f3}pre{background:#f7f7f7;padding:1em}"
         "img{max-width:100%;display:block;margin:1em 0}summary{cursor:pointer;font-family:monospace}")


def render_html(a: Analysis, images: dict[str, str]) -> str:
    """The page: summary, figures (relative paths, beside it) and the per-rank and event tables."""
    parts = [f"<!doctype html><html><head><meta charset='utf-8'><title>mshpc diagnosis: "
             f"{html.escape(a.run_name)}</title><style>{STYLE}</style></head><body>",
             f"<h1>Diagnosis of {html.escape(a.run_name)}</h1>",
             f"<pre>{html.escape(chr(10).join(summary_lines(a)))}</pre>"]
    for title, name in images.items():
        parts.append(f"<h2>{html.escape(title)}</h2><img src='{html.escape(name)}' alt='{html.escape(title)}'>")
    if a.ranks:
        parts.append(_ranks_section(a))
    if a.phase_share:
        rows = [[p, f"{100 * s:.1f}%"] for p, s in a.phase_share.items()]
        parts.append("<h2>Phases (median rank's share of a step)</h2>" + _table(["phase", "share"], rows))
    parts.append("<h2>Events</h2>" + (_table(["time", "kind", "details"], _event_rows(a)) if a.events else
                                      "<p>none</p>"))
    return "\n".join(parts) + "</body></html>\n"


def write_report(run_dir: Path) -> tuple[Path, list[str]]:
    """Write <run_dir>/report/ (index.html and its PNGs); returns its path and the summary."""
    a = analyse(run_dir)
    out = run_dir / REPORT_DIR
    out.mkdir(exist_ok=True)
    images = {"Loss (training and validation) and MFU": plots.loss_and_mfu(a, out / "loss_mfu.png").name}
    if expert_layers(a.metrics):
        images["Expert load over steps (mixture of experts)"] = expert_load(a.metrics, out / "experts.png").name
    if a.timings is not None:
        images.update({
            "Compute time per rank (stragglers are bright rows)": plots.compute_heatmap(a, out / "heatmap.png").name,
            "Where each rank's step goes": plots.phase_breakdown(a, out / "breakdown.png").name,
            "3D mesh and slowest dependencies": plots.mesh_view(a, out / "mesh.png").name,
        })
    index = out / "index.html"
    index.write_text(render_html(a, images))
    experts = expert_summary(a.metrics)
    return index, summary_lines(a) + ([experts] if experts else [])
