"""`mshpc prepare` against `datasets.map(batched=True, num_proc=W)` on the same generated JSONL
corpus with the same byte-level BPE (issue #39): MB/s side by side, and mshpc's peak memory on the
corpus against its peak on a tenth of it (streaming: it must not grow with the corpus). A third
side, the `tokenizers` engine alone (encode_batch_fast on W processes, nothing written), is the
ratio a prepare spending nothing but that engine's time would reach; mshpc goes past it where its
faster engine for byte-level BPEs applies (mshpc/data/fast_bpe.py: tiktoken's, same ids).

    .venv/bin/python benchmarks/prepare.py                 # 1,000 MB corpus against 100 MB, 2 workers, 1 round
    .venv/bin/python benchmarks/prepare.py --mb 50 --rounds 3
    .venv/bin/python benchmarks/prepare.py --mb 400 --small-mb 100 --memory-only

Each contender runs as its own process tree; its wall time includes reading the JSONL, and its
peak memory is the largest sum over the tree of each process's proportional set size (PSS: pages
shared by the forked workers counted once), sampled every 0.1 s; the sum of resident sizes (RSS,
shared pages counted in each process) comes with it. The baseline is the Hugging Face way:
`load_dataset("json")` (to Arrow), then `map` with the tokenizer's batch encode on W processes,
writing Arrow. Both sides run each worker on one thread (TOKENIZERS_PARALLELISM=false; mshpc's
workers set it themselves), so each uses W cores. The BPE is trained on a separate 10 MB corpus.
Everything goes under a temporary folder in --dir (HF_HOME too) and is removed at the end.
"""

from __future__ import annotations

import argparse
import json
import os
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
# The `tokenizers` engine alone: the same tokenizer's encode_batch_fast on the same records, on W
# forked processes (each parses its own lines), nothing kept or written: the best ratio a prepare
# driving that engine can reach.
ENCODE_ONLY = """
import json, sys, multiprocessing
from tokenizers import Tokenizer
corpus, tok_path, workers = sys.argv[1], sys.argv[2], int(sys.argv[3])
tok = Tokenizer.from_file(tok_path)
def encode(lines):
    return len(tok.encode_batch_fast([json.loads(line)["text"] for line in lines]))
def blocks(size=1000):
    with open(corpus, "rb") as f:
        block = []
        for line in f:
            block.append(line)
            if len(block) == size:
                yield block
                block = []
        if block:
            yield block
with multiprocessing.get_context("fork").Pool(workers) as pool:
    sum(pool.imap(encode, blocks()))
"""
TOKENIZER_CORPUS_MB = 10.0
SAMPLE_S = 0.1


def write_corpus(path: Path, mb: float, seed: int = 0) -> Path:
    """A JSONL corpus of about `mb` MB of Zipf-distributed made-up words, documents of 50-1500 words."""
    rng = np.random.default_rng(seed)
    syllables = np.array(["ka", "to", "ri", "en", "ma", "lo", "ne", "sa", "ti", "ur", "ba", "de", "fi", "go", "hu",
                          "ja", "ke", "li", "mo", "nu", "pa", "qu", "ro", "se", "ta", "vi", "wa", "xe", "yo", "za"])
    words = ["".join(rng.choice(syllables, size=int(rng.integers(1, 4)))) for _ in range(30_000)]
    cdf = np.cumsum(1.0 / np.arange(1, len(words) + 1))
    target, written = int(mb * 1e6), 0
    with open(path, "w") as f:
        while written < target:  # words drawn for 1,000 documents at a time: one at a time is slow
            sizes = rng.integers(50, 1500, size=1000)
            drawn = np.searchsorted(cdf, rng.random(int(sizes.sum())) * cdf[-1], side="right").tolist()
            ends = np.cumsum(sizes).tolist()
            for n, end in zip(sizes.tolist(), ends, strict=True):
                line = json.dumps({"text": " ".join(words[i] for i in drawn[end - n:end])}) + "\n"
                f.write(line)
                written += len(line)
                if written >= target:
                    break
    return path


def _tree(pid: int) -> list[int]:
    """`pid` and every descendant (/proc/PID/task/TID/children)."""
    found, todo = [], [pid]
    while todo:
        p = todo.pop()
        found.append(p)
        try:
            todo += [int(c) for t in Path(f"/proc/{p}/task").iterdir() for c in (t / "children").read_text().split()]
        except (OSError, ValueError):
            continue
    return found


def tree_memory(pid: int) -> tuple[int, int]:
    """(PSS, RSS) bytes summed over `pid` and its descendants; a process gone meanwhile counts 0."""
    pss = rss = 0
    for p in _tree(pid):
        try:
            for line in Path(f"/proc/{p}/smaps_rollup").read_text().splitlines():
                if line.startswith(("Pss:", "Rss:")):
                    kib = int(line.split()[1]) * 1024
                    pss, rss = (pss + kib, rss) if line.startswith("Pss:") else (pss, rss + kib)
        except (OSError, ValueError):
            continue
    return pss, rss


def run(cmd: list[str], env: dict[str, str]) -> tuple[float, float, int, int]:
    """(wall seconds, CPU seconds, peak PSS, peak RSS of the process tree) of `cmd`, which must
    succeed. The CPU seconds (user + system of it and the children it waited for) compare the
    sides' work even where a loaded machine stretches their wall time."""
    start, peak_pss, peak_rss = time.perf_counter(), 0, 0
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
    try:
        while True:
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                break
            pss, rss = tree_memory(proc.pid)
            peak_pss, peak_rss = max(peak_pss, pss), max(peak_rss, rss)
            time.sleep(SAMPLE_S)
    except BaseException:  # interrupted: take the tree down with us
        for p in reversed(_tree(proc.pid)):
            os.kill(p, 9)
        proc.wait()
        raise
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"{cmd[:4]} failed: {proc.stderr.read()[-2000:]}")  # type: ignore[union-attr]
    return time.perf_counter() - start, usage.ru_utime + usage.ru_stime, peak_pss, peak_rss


def mib(n: float) -> float:
    return round(n / 2**20, 1)


class Contest:
    """The corpus files, the tokenizer and how each side is run, under one work folder."""

    def __init__(self, work: Path, workers: int) -> None:
        self.work, self.workers = work, workers
        self.env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "HF_HOME": str(work / "hf-home")}
        self.mshpc = [sys.executable, "-m", "mshpc"]

    def train_tokenizer(self, vocab: int) -> None:
        corpus = write_corpus(self.work / "tok.jsonl", TOKENIZER_CORPUS_MB, seed=2)
        subprocess.run([*self.mshpc, "tokenizer", "train", str(corpus), "--vocab", str(vocab), "--out",
                        str(self.work / "tok")], check=True, capture_output=True, env=self.env)

    def prepare(self, corpus: Path) -> tuple[float, float, int, int]:
        out = self.work / "mshpc-out"
        try:
            return run([*self.mshpc, "prepare", str(corpus), "--out", str(out), "--tokenizer", str(self.work / "tok"),
                        "--workers", str(self.workers)], self.env)
        finally:
            shutil.rmtree(out, ignore_errors=True)

    def encode_only(self, corpus: Path) -> tuple[float, float, int, int]:
        return run([sys.executable, "-c", ENCODE_ONLY, str(corpus), str(self.work / "tok" / "tokenizer.json"),
                    str(self.workers)], self.env)

    def datasets_map(self, corpus: Path) -> tuple[float, float, int, int]:
        out = self.work / "datasets-out"
        try:
            return run([sys.executable, "-c", BASELINE, str(corpus), str(out), str(self.work / "tok" / "tokenizer.json"),
                        str(self.workers)], self.env)
        finally:
            shutil.rmtree(out, ignore_errors=True)


def throughput(contest: Contest, corpus: Path, rounds: int, vocab: int) -> tuple[int, int]:
    """The three sides on `corpus`, taking turns; emits mshpc's MB/s against datasets.map's, then the
    `tokenizers` engine alone's against datasets.map's; mshpc's peak (PSS, RSS)."""
    mb = corpus.stat().st_size / 1e6
    sides = {"mshpc": contest.prepare, "datasets": contest.datasets_map, "encode_only": contest.encode_only}
    seconds: dict[str, list[float]] = {k: [] for k in sides}
    cpu: dict[str, list[float]] = {k: [] for k in sides}
    peaks: dict[str, list[tuple[int, int]]] = {k: [] for k in sides}
    for order in turns(list(sides), rounds):
        for name in order:
            took, cpu_s, pss, rss = sides[name](corpus)
            seconds[name].append(took)
            cpu[name].append(cpu_s)
            peaks[name].append((pss, rss))
    rates = {k: [mb / s for s in v] for k, v in seconds.items()}
    common = {"corpus_mb": round(mb), "workers": contest.workers, "vocab": vocab,
              "peak_pss_mib": {k: mib(max(v)[0]) for k, v in peaks.items()},
              "mb_per_cpu_s": {k: round(mb / float(np.median(v)), 3) for k, v in cpu.items()}}
    for name, metric in (("mshpc", "mb_per_s_vs_datasets_map"), ("encode_only", "tokenizers_alone_mb_per_s_vs_datasets_map")):
        line = record("prepare", metric, float(np.median(rates[name])), "MB/s", float(np.median(rates["datasets"])),
                      **common, load=load_average())
        emit({**line, **paired(rates[name], rates["datasets"])})
    return max(peaks["mshpc"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mb", type=float, default=1000.0, help="corpus size in MB (default 1000)")
    parser.add_argument("--small-mb", type=float, help="the corpus whose peak memory is compared (default --mb / 10)")
    parser.add_argument("--memory-only", action="store_true", help="only mshpc's peak memory at --mb vs --small-mb")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=16_000)
    parser.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()))
    add_rounds(parser, 1)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="mshpc-prepare-bench-", dir=args.dir))
    try:
        contest = Contest(work, args.workers)
        contest.train_tokenizer(args.vocab)
        big = write_corpus(work / "big.jsonl", args.mb)
        big_pss, big_rss = contest.prepare(big)[2:] if args.memory_only else throughput(contest, big, args.rounds,
                                                                                          args.vocab)
        small = write_corpus(work / "small.jsonl", args.small_mb or args.mb / 10, seed=1)
        _, _, small_pss, small_rss = contest.prepare(small)
        sizes = [round(p.stat().st_size / 1e6) for p in (big, small)]
        emit(record("prepare", f"peak_pss_{sizes[0]}mb_vs_{sizes[1]}mb", mib(big_pss), "MiB", mib(small_pss),
                    peak_rss_sum_mib=[mib(big_rss), mib(small_rss)],
                    workers=args.workers, load=load_average()))
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
