"""Every shell command in README.md runs as written on a fresh clone: the cheap ones are run here
(`--help`, `plan`, `prepare` and `tokenizer train` on small inputs), in a scratch folder that has the checkout's
configs/; every other one is matched by a rule below that says why it is not run here and which
test runs its kind instead. A README command that no rule names fails, so a new one is classified
when it is added. Links from README.md and docs/ to files of the checkout must resolve."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"

# (first words of a command, why it is not run here). Checked in order; the first match decides.
SKIPPED = [
    (("make",), "the set-up itself: this test runs inside what `make setup-test` built"),
    (("source",), "changes the calling shell only"),
    (("pip", "install"), "downloads packages: `make setup-test` installs the same extras"),
    (("mshpc", "train", "--help"), None),  # cheap: run
    (("mshpc", "train"), "trains for tens of seconds to minutes: tests/dist (train, resume, layouts) runs it"),
    (("mpiexec",), "an MPI launch of training: tests/dist/launch/test_bootstrap_mpi.py"),
    (("srun",), "a Slurm step: tests/slurm, against the local Slurm"),
    (("torchrun",), "a torchrun launch of training: tests/dist/launch"),
    (("sbatch",), "a Slurm job: tests/slurm/test_train_sbatch.py"),
    (("mshpc", "submit"), "a Slurm job through submitit: tests/slurm"),
    (("mshpc", "ckpt"), "reads a run's checkpoints: tests/dist/checkpoint and tests/unit/checkpoint"),
    (("mshpc", "generate"), "reads a run's checkpoint: tests/dist/test_generate.py"),
    (("mshpc", "export"), "reads a run's checkpoint: tests/dist/interop"),
    (("mshpc", "import"), "reads an exported folder: tests/dist/interop"),
    (("mshpc", "diagnose"), "reads a run's timings: tests/unit/diagnose"),
    (("mshpc", "preflight"), "times devices and links for tens of seconds: tests/dist/preflight"),
    (("tail", "-f"), "follows a file until interrupted"),
    (("tensorboard",), "starts a web server"),
]


def shell_commands(text: str) -> list[str]:
    """Each command of the ```sh blocks, continuation lines joined, comments dropped."""
    commands = []
    for block in re.findall(r"```sh\n(.*?)```", text, re.S):
        for line in block.replace("\\\n", " ").splitlines():
            words = shlex.split(line, comments=True)
            if words:
                commands.append(shlex.join(words))
    return commands


def _is_cheap(command: str) -> bool:
    try:
        return rule_for(command) is None
    except KeyError:
        return False  # reported by the classification test


def rule_for(command: str) -> str | None:
    """Why `command` is skipped, or None to run it; KeyError when no rule names it."""
    words = shlex.split(command)
    for prefix, why in SKIPPED:
        if tuple(words[:len(prefix)]) == prefix:
            return why
    if words[0] == "mshpc" and (words[1:2] in (["plan"], ["prepare"]) or words[1:3] == ["tokenizer", "train"]
                                or "--help" in words):
        return None
    raise KeyError(command)


COMMANDS = shell_commands(README.read_text())
CHEAP = [c for c in COMMANDS if _is_cheap(c)]


def test_every_readme_command_is_run_here_or_skipped_for_a_stated_reason():
    unnamed = []
    for command in COMMANDS:
        try:
            rule_for(command)
        except KeyError:
            unnamed.append(command)
    assert not unnamed, "README commands no rule of this test names (run them here or say why not):\n" + \
        "\n".join(unnamed)
    assert any(rule_for(c) is None for c in COMMANDS), "no README command is cheap enough to run here"


@pytest.fixture(scope="module")
def scratch(tmp_path_factory) -> Path:
    """A folder like a fresh clone's root for the commands: configs/, a few text files, JSONL
    records. The commands run in the README's order, so a later one may read what an
    earlier one wrote (`mshpc prepare --tokenizer tok/` after `mshpc tokenizer train --out tok/`)."""
    root = tmp_path_factory.mktemp("readme")
    (root / "configs").symlink_to(REPO / "configs")
    texts = root / "my_texts"
    texts.mkdir()
    for i in range(200):  # enough documents that a 1% held-out split is not empty
        (texts / f"doc{i}.txt").write_text(f"document {i}: def f(x): return x + {i}\n" * 3)
    with (root / "corpus.jsonl").open("w") as f:
        for i in range(200):
            f.write(json.dumps({"text": f"record {i}: def f(x): return x * {i}\n" * 3}) + "\n")
    return root


@pytest.mark.parametrize("command", CHEAP)
def test_a_cheap_readme_command_runs_as_written(command, scratch):
    words = shlex.split(command)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "PMI", "OMPI_"))}
    done = subprocess.run([sys.executable, "-m", "mshpc", *words[1:]], cwd=scratch, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"{command}\nexit {done.returncode}\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}"


LINK = re.compile(r"\[[^\]]*\]\(([^)#\s]+)(?:#[^)]*)?\)")


def test_links_from_the_readme_and_the_guides_resolve():
    pages = [README, *sorted((REPO / "docs").rglob("*.md"))]
    broken = [f"{page.relative_to(REPO)}: {target}" for page in pages for target in LINK.findall(page.read_text())
              if "://" not in target and not (page.parent / target).exists()]
    assert not broken, "links to files that do not exist:\n" + "\n".join(broken)
