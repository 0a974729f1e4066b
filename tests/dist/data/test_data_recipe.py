"""The README's Data recipe end to end with a BPE tokenizer (issue #42, item 1): a tokenizer
trained by `mshpc tokenizer train`, a JSONL corpus prepared with it, `mshpc train` with only
data.path set, then `mshpc generate` prints text in that tokenizer and `mshpc export --hf` ships
it, so that transformers' AutoTokenizer encodes the ids the model trained on."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from support.cli_runner import mshpc, train_args

CORPUS = [f"def f{i}(x):\n    return x + {i}  # hello world {i % 7}" for i in range(400)]


@pytest.fixture(scope="module")
def recipe(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("recipe")
    (root / "corpus.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in CORPUS))
    done = mshpc("tokenizer", "train", str(root / "corpus.jsonl"), "--vocab", "300", "--out", str(root / "tok"))
    assert done.returncode == 0, done.stderr
    done = mshpc("prepare", str(root / "corpus.jsonl"), "--out", str(root / "ds"), "--tokenizer", str(root / "tok"),
                 "--workers", "2")
    assert done.returncode == 0, done.stderr
    # LayerNorm + GeLU + parallel block: exported as GPTNeoXForCausalLM
    sets = [f"data.path={root / 'ds'}", "model.vocab_size=320", "model.norm=layernorm", "train.steps=3",
            "checkpoint.interval_steps=3", "checkpoint.async_save=false", "eval.interval_steps=0"]
    done = mshpc(*train_args(root, root / "cache", *sets, name="bpe"), "--nproc", "1")
    assert done.returncode == 0, done.stderr
    return {"root": root, "run": root / "bpe", "tok": root / "tok"}


def test_training_adopts_the_datasets_tokenizer_and_generate_speaks_it(recipe: dict[str, Path]) -> None:
    from mshpc.data.tokenizer import build_tokenizer
    from mshpc.generate import SampleOptions, decode, find_checkpoint, load_model

    run = recipe["run"]
    assert (run / "tokenizer" / "tokenizer.json").read_bytes() == (recipe["tok"] / "tokenizer.json").read_bytes()
    done = mshpc("generate", str(run), "--prompt", "def f", "--greedy", "--max-new-tokens", "12")
    assert done.returncode == 0, done.stderr
    # the same decoding in this process, with the BPE tokenizer: the command printed exactly that
    tok = build_tokenizer(str(recipe["tok"]))
    folder, cfg = find_checkpoint(run)
    prompt = tok.encode("def f").tolist()
    new = decode(load_model(folder, cfg.model), prompt, SampleOptions(max_new_tokens=12, greedy=True),
                 stop_id=tok.eos_id, vocab=tok.vocab_size)
    assert done.stdout.rstrip("\n") == tok.decode(prompt + new) and "\ufffd" not in done.stdout


def test_export_ships_the_tokenizer_that_autotokenizer_reads(recipe: dict[str, Path]) -> None:
    from transformers import AutoTokenizer

    from mshpc.data.tokenizer import build_tokenizer

    out = recipe["root"] / "hf"
    done = mshpc("export", str(recipe["run"]), "--hf", str(out))
    assert done.returncode == 0, done.stderr
    hf, ours = AutoTokenizer.from_pretrained(out), build_tokenizer(str(recipe["tok"]))
    for text in CORPUS[:5] + ["hello world, ünïcode"]:
        assert hf(text)["input_ids"] == ours.encode(text).tolist()
    assert json.loads((out / "config.json").read_text())["eos_token_id"] == ours.eos_id == hf.eos_token_id


def test_a_conflicting_data_tokenizer_is_refused_in_one_line(recipe: dict[str, Path]) -> None:
    root = recipe["root"]
    done = mshpc(*train_args(root, root / "cache", f"data.path={root / 'ds'}", "model.vocab_size=320",
                             "data.tokenizer=byte", "train.steps=1", name="conflict"), "--nproc", "1")
    assert done.returncode == 2
    [line] = [x for x in done.stderr.splitlines() if "error" in x.lower()]
    assert "data.tokenizer='byte' is not the tokenizer" in line and "leave data.tokenizer at auto" in line


def test_a_model_smaller_than_the_tokenizer_is_refused_in_one_line(recipe: dict[str, Path]) -> None:
    root = recipe["root"]
    done = mshpc(*train_args(root, root / "cache", f"data.path={root / 'ds'}", "model.vocab_size=256",
                             "train.steps=1", name="small-vocab"), "--nproc", "1")
    assert done.returncode == 2
    [line] = [x for x in done.stderr.splitlines() if "error" in x.lower()]
    assert "model.vocab_size=256 is smaller than the tokenizer's vocabulary (300)" in line
    assert "set model.vocab_size >= 300" in line
    assert not list((root / "small-vocab").glob("checkpoints/*"))  # stopped before any step
