"""`mshpc tokenizer train CORPUS --vocab N --out DIR`: a byte-level BPE (GPT-2's scheme) trained
with the `tokenizers` library on any corpus `mshpc prepare` reads, written as a Hugging Face
tokenizer folder that `mshpc prepare --tokenizer DIR` and `AutoTokenizer.from_pretrained(DIR)` load."""

from __future__ import annotations

import json
import logging
import os
import shutil
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path

from mshpc.data.records import Reading, input_files, read_jobs
from mshpc.data.tokenize_pool import job_texts
from mshpc.errors import DataError

log = logging.getLogger(__name__)

EOS = "<|endoftext|>"
MIN_VOCAB = 257  # the 256 bytes and the end-of-document token


def _texts(corpus: Sequence[Path], reading: Reading) -> Iterator[str]:
    skipped = 0
    for job in read_jobs(input_files(corpus), reading):
        texts, bad, _ = job_texts(job, reading)
        skipped += bad
        yield from texts
    if skipped:
        log.warning("skipped %d bad records (--skip-bad-records)", skipped)


def train_tokenizer(corpus: Sequence[Path], out_dir: Path, vocab: int, reading: Reading | None = None) -> Path:
    """Train a byte-level BPE of `vocab` ids (`<|endoftext|>` is id 0) on `corpus` into the new
    folder `out_dir`, written whole or not at all."""
    reading = reading or Reading()
    if vocab < MIN_VOCAB:
        raise DataError(f"--vocab {vocab} must be >= {MIN_VOCAB} (the 256 bytes and {EOS})")
    if out_dir.exists():
        raise DataError(f"output {out_dir} already exists (remove it or choose another folder)")
    try:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    except ImportError:
        raise DataError("mshpc tokenizer train needs the tokenizers package: pip install tokenizers") from None
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=[EOS], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    bpe.train_from_iterator(_texts(corpus, reading), trainer=trainer)
    if bpe.get_vocab_size() <= MIN_VOCAB - 1:
        raise DataError(f"no text in {', '.join(map(str, corpus))} to train on")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_dir.parent / f".{out_dir.name}.tmp-{uuid.uuid4().hex[:12]}"
    tmp.mkdir()
    try:
        bpe.save(str(tmp / "tokenizer.json"))
        config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": EOS, "bos_token": None,
                  "unk_token": None, "add_bos_token": False, "add_eos_token": False,
                  "clean_up_tokenization_spaces": False}
        (tmp / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
        os.rename(tmp, out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log.info("trained a byte-level BPE of %d ids on %s", bpe.get_vocab_size(), ", ".join(map(str, corpus)))
    return out_dir
