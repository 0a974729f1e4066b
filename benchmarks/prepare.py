"""`mshpc prepare` against `datasets.map(batched=True, num_proc=W)` on the same generated JSONL
corpus with the same byte-level BPE (issue #39): MB/s side by side, and mshpc's peak memory on the
corpus against its peak on a tenth of it (streaming: it must not grow with the corpus).

    .venv/bin/python benchmarks/prepare.py                 # 1,000 MB corpus, 2 workers, 1 round
    .venv/bin/python benchmarks/prepare.py --mb 50 --rounds 3

Each contender runs as its own process tree; its wall time includes reading the JSONL, and its
peak memory is the largest sum of the tree's resident memory, sampled every 0.2 s. The baseline
is the Hugging Face way: `load_dataset("json")` (to Arrow), then `map` with the tokenizer's batch
encode on W processes, writing Arrow. The corpora go under --dir and are removed at the end.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from mshpc.bench.harness import add_rounds, emit, load_average, paired, record, turns

BASELINE = """
import sys, datasets
from tokenizers import Tokenizer
datasets.disable_progress_bars()
corpus, cache, tok_path, workers = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
tok = Tokenizer.from_file(tok_path)
def encode(batch):
    return {"input_ids": [e.ids for e in tok.encode_batch_fast(batch["text"])]}
ds = datasets.load_dataset("json", data_files=corpus, split="train", cache_dir=cache)
ds.map(encode, batched=True, num_proc=workers, remove_columns=ds.column_names)
"""


def write_corpus(path: Path, mb: float, seed: int = 0) -> Path:
    """A JSONL corpus of about `mb` MB of Zipf-distributed made-up words, documents of 50-1500 words."""
    rng = np.random.default_rng(seed)
    syllables = np.array(["ka", "to", "ri", "en", "ma", "lo", "ne", "sa", "ti", "ur", "ba", "de", "fi", "go", "hu",
                          "ja", "ke", "li", "mo", "nu", "pa", "qu", "ro", "se", "ta", "vi", "wa", "xe", "yo", "za"])
    words = np.array(["".join(rng.choice(syllables, size=int(rng.integers(1, 4)))) for _ in range(30_000)])
    p = 1.0 / np.arange(1, len(words) + 1)
    target, written = int(mb * 1e6), 0
    with open(path, "w") as f:
        while written < target:
            text = " ".join(words[rng.choice(len(words), size=int(rng.integers(50, 1500)), p=p / p.sum())])
            line = json.dumps({"text": text}) + "\n"
            f.write(line)
            written += len(line)
    return path


def tree_rss(pid: int) -> int:
    """Resident bytes of `pid` and every descendant."""
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        try:
            total += int(Path(f"/proc/{p}/statm").read_text().split()[1]) * 4096
            todo += [int(c) for t in Path(f"/proc/{p}/task").iterdir()
                     for c in (t / "children").read_text().split()]
        except (OSError, ValueError):
            continue
    return total


def run(cmd: list[str]) -> tuple[float, int]:
    """(wall seconds, peak resident bytes of the process tree) of `cmd`, which must succeed."""
    start, peak = time.perf_counter(), 0
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    while proc.poll() is None:
        peak = max(peak, tree_rss(proc.pid))
        time.sleep(0.2)
    if proc.returncode != 0:
        raise SystemExit(f"{cmd[:4]} failed: {proc.stderr.read()[-2000:]}")
    return time.perf_counter() - start, peak


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mb", type=float, default=1000.0, help="corpus size in MB (default 1000)")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=16_000)
    parser.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()))
    add_rounds(parser, 1)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="mshpc-prepare-bench-", dir=args.dir))
    try:
        big = write_corpus(work / "big.jsonl", args.mb)
        small = write_corpus(work / "small.jsonl", args.mb / 10, seed=1)
        mshpc = [sys.executable, "-m", "mshpc"]
        subprocess.run([*mshpc, "tokenizer", "train", str(small), "--vocab", str(args.vocab), "--out",
                        str(work / "tok")], check=True, capture_output=True)
        mb = big.stat().st_size / 1e6
        seconds: dict[str, list[float]] = {"mshpc": [], "datasets": []}
        peaks: list[int] = []
        for r, order in enumerate(turns(list(seconds), args.rounds)):
            for name in order:
                out = work / f"{name}-{r}"
                if name == "mshpc":
                    took, peak = run([*mshpc, "prepare", str(big), "--out", str(out), "--tokenizer", str(work / "tok"),
                                      "--workers", str(args.workers)])
                    peaks.append(peak)
                else:
                    took, _ = run([sys.executable, "-c", BASELINE, str(big), str(out), str(work / "tok" / "tokenizer.json"),
                                   str(args.workers)])
                seconds[name].append(took)
                shutil.rmtree(out, ignore_errors=True)
        _, small_peak = run([*mshpc, "prepare", str(small), "--out", str(work / "small-ds"), "--tokenizer",
                             str(work / "tok"), "--workers", str(args.workers)])
        rates = {k: [mb / s for s in v] for k, v in seconds.items()}
        stats = paired(rates["mshpc"], rates["datasets"])
        line = record("prepare", "mb_per_s_vs_datasets_map", float(np.median(rates["mshpc"])), "MB/s",
                      float(np.median(rates["datasets"])), corpus_mb=round(mb), workers=args.workers,
                      vocab=args.vocab, load=load_average())
        emit({**line, **stats})
        emit(record("prepare", f"peak_rss_{round(mb)}mb_vs_{round(mb / 10)}mb", max(peaks) / 2**20, "MiB",
                    small_peak / 2**20, workers=args.workers, load=load_average()))
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
