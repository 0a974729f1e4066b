"""A tokenizer/ folder: a tokenizer's files under fixed names with a manifest of their sha256,
kept inside each dataset `mshpc prepare` writes and each run directory that trains on one.

    mshpc_tokenizer.json  {"kind": "hf", "name": "<what it was built from>", "vocab_size": V,
                           "eos_id": E, "files": {"tokenizer.json": "<sha256>", ...}}
    tokenizer.json, tokenizer_config.json   (kind hf)
    tokenizer.model                         (kind sentencepiece)
    ranks.tiktoken                          (kind tiktoken)

A dataset or run thus carries the very tokenizer its ids came from: training adopts it, and
`mshpc generate` and `mshpc export` read it from the run, never from a path named in a config.
A folder is untrusted input: only these names are read, each size-bounded and checked.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path

from mshpc.data.tokenizer import ByteTokenizer, Tokenizer
from mshpc.errors import DataError

MANIFEST = "mshpc_tokenizer.json"
TOKENIZER_DIR = "tokenizer"  # its name inside a dataset folder or a run directory
# kind -> (the file that defines its ids, the other files it may have)
KIND_FILES = {"byte": (None, ()), "hf": ("tokenizer.json", ("tokenizer_config.json",)),
              "sentencepiece": ("tokenizer.model", ()), "tiktoken": ("ranks.tiktoken", ())}
_MAX_MANIFEST_BYTES = 1 << 20


@dataclass(frozen=True)
class Fingerprint:
    """What makes two tokenizers give the same ids: the kind, the defining file's sha256 and the
    end-of-document id (a tokenizer_config.json may name another one)."""

    kind: str
    sha256: str | None
    eos_id: int
    vocab_size: int


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def fingerprint(tokenizer: Tokenizer) -> Fingerprint:
    main = KIND_FILES[tokenizer.kind][0]
    sha = _sha256(tokenizer.files()[main]) if main is not None else None
    return Fingerprint(tokenizer.kind, sha, tokenizer.eos_id, tokenizer.vocab_size)


def describe(tokenizer: Tokenizer) -> str:
    """One phrase naming a tokenizer in messages and logs."""
    if tokenizer.kind == "byte":
        return "the byte tokenizer"
    return f"{tokenizer.kind} tokenizer {tokenizer.name} (vocabulary {tokenizer.vocab_size}, eos {tokenizer.eos_id})"


def save_tokenizer_dir(tokenizer: Tokenizer, dest: Path) -> Path:
    """Write `tokenizer` as a tokenizer/ folder `dest` (which must not exist), atomically."""
    tmp = dest.parent / f".{dest.name}.tmp-{uuid.uuid4().hex[:12]}"
    tmp.mkdir(parents=True)
    try:
        hashes = {}
        for name, src in tokenizer.files().items():
            shutil.copyfile(src, tmp / name)
            hashes[name] = _sha256(tmp / name)
        manifest = {"kind": tokenizer.kind, "name": tokenizer.name, "vocab_size": tokenizer.vocab_size,
                    "eos_id": tokenizer.eos_id, "files": hashes}
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
        os.rename(tmp, dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest


def _read_manifest(folder: Path) -> dict:
    path = folder / MANIFEST
    if path.stat().st_size > _MAX_MANIFEST_BYTES:
        raise DataError(f"{path}: larger than any tokenizer manifest")
    try:
        manifest = json.loads(path.read_text())
    except (ValueError, OSError) as exc:
        raise DataError(f"{path}: unreadable ({exc})") from None
    if not isinstance(manifest, dict) or manifest.get("kind") not in KIND_FILES:
        raise DataError(f"{path}: 'kind' is missing or not one of {', '.join(KIND_FILES)}")
    main, extra = KIND_FILES[manifest["kind"]]
    files = manifest.get("files")
    allowed = {main, *extra} - {None}
    if not isinstance(files, dict) or not set(files) <= allowed or (main is not None and main not in files):
        raise DataError(f"{path}: 'files' must name {main} (and at most {', '.join(extra) or 'nothing else'})")
    return manifest


def load_tokenizer_dir(folder: Path) -> Tokenizer:
    """The tokenizer of a tokenizer/ folder, its files checked against the manifest."""
    from mshpc.data import tokenizer_libs as libs

    manifest = _read_manifest(folder)
    for name, sha in manifest["files"].items():
        if not (folder / name).is_file() or _sha256(folder / name) != sha:
            raise DataError(f"{folder / name}: missing, or its sha256 is not the one {MANIFEST} records")
    kind, name = manifest["kind"], str(manifest.get("name", folder))
    tokenizer: Tokenizer
    if kind == "byte":
        tokenizer = ByteTokenizer()
    elif kind == "hf":
        tokenizer = libs.HFTokenizer(folder / "tokenizer.json", folder / "tokenizer_config.json", name)
    elif kind == "sentencepiece":
        tokenizer = libs.SentencePieceTokenizer(folder / "tokenizer.model", name)
    else:
        tokenizer = libs.TiktokenTokenizer(folder / "ranks.tiktoken", name)
    if (tokenizer.vocab_size, tokenizer.eos_id) != (manifest.get("vocab_size"), manifest.get("eos_id")):
        raise DataError(f"{folder / MANIFEST}: vocab_size/eos_id {manifest.get('vocab_size')}/"
                        f"{manifest.get('eos_id')} are not the tokenizer's {tokenizer.vocab_size}/{tokenizer.eos_id}")
    return tokenizer


def record_tokenizer(tokenizer: Tokenizer, run_dir: Path, fresh: bool) -> Path:
    """Keep `tokenizer` in the run directory (what generate and export read). A resumed run
    (`fresh` False) must have trained with the same one; a fresh run replaces an old run's."""
    dest = run_dir / TOKENIZER_DIR
    if (dest / MANIFEST).is_file():
        old = load_tokenizer_dir(dest)
        if fingerprint(old) == fingerprint(tokenizer):
            return dest
        if not fresh:
            raise DataError(f"{run_dir} trained with {describe(old)}, but its data now holds ids of "
                            f"{describe(tokenizer)} (train on this data under a new run.name)")
    if dest.exists():
        trash = run_dir / f".{TOKENIZER_DIR}.old-{uuid.uuid4().hex[:12]}"
        os.rename(dest, trash)
        shutil.rmtree(trash, ignore_errors=True)
    return save_tokenizer_dir(tokenizer, dest)


def run_tokenizer(run_dir: Path, spec: str) -> Tokenizer:
    """The tokenizer a run trained with: the one its directory keeps; for a run from before runs
    kept one, data.tokenizer `spec` ("auto" was the byte tokenizer then)."""
    if (run_dir / TOKENIZER_DIR / MANIFEST).is_file():
        return load_tokenizer_dir(run_dir / TOKENIZER_DIR)
    from mshpc.data.tokenizer import build_tokenizer

    return build_tokenizer("byte" if spec == "auto" else spec)
