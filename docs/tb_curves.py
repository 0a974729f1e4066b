"""Draw a run's TensorBoard scalars, read back from its event files with TensorBoard's own reader,
into one PNG laid out like TensorBoard's scalar dashboard (docs/tensorboard-tiny.png). No browser
can be fetched here to screenshot the dashboard itself, so this shows the same data.

    .venv/bin/python docs/tb_curves.py runs/tiny/tb docs/tensorboard-tiny.png
"""

from __future__ import annotations

import sys

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

TAGS = ["train/loss", "val/loss", "val/ppl", "train/lr", "train/grad_norm", "perf/tokens_per_s"]


def main(logdir: str, out: str) -> None:
    acc = EventAccumulator(logdir)
    acc.Reload()
    fig, axes = plt.subplots(2, 3, figsize=(12, 6))
    for ax, tag in zip(axes.flat, TAGS, strict=True):
        events = acc.Scalars(tag)
        ax.plot([e.step for e in events], [e.value for e in events], color="#ff7043" if tag.startswith("val") else "#425066",
                lw=1.2, marker="o" if tag.startswith("val") else None, ms=3)
        ax.set_title(tag, loc="left", fontsize=10)
        ax.grid(alpha=0.3)
        ax.set_xlabel("step", fontsize=8)
    texts = len(acc.Tensors("events/text_summary")) if "events/text_summary" in acc.Tags()["tensors"] else 0
    fig.suptitle(f"TensorBoard scalars of `make run` (configs/tiny.yaml, 200 steps, 2 ranks), read from "
                 f"{logdir.rstrip('/').split('/')[-2]}/tb; {texts} event text(s)", fontsize=10)
    fig.tight_layout()
    fig.savefig(out, dpi=100)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
