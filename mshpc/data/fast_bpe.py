"""A faster engine for GPT-2's kind of tokenizer.json (a byte-level BPE), used only where it gives
the `tokenizers` library's own ids: tiktoken's BPE, about 3x the `tokenizers` engine on one core
(`mshpc prepare` spends ~90% of its time in the tokenizer).

The two engines merge differently. `tokenizers` merges the adjacent pair that comes first in the
merges list; tiktoken merges the adjacent pair whose concatenation has the lowest id, listed or not,
and takes a whole pre-tokenized word that is in the vocabulary as one token. They give the same ids
on every word when
  (a) every token a merge makes has a larger id than the tokens earlier merges make, and
  (b) every token t that tiktoken knows is what `tokenizers` makes of t's own bytes: [t].
Why: a token that `tokenizers` forms inside a word is formed from its own bytes alone (no merge
crosses its edges), the same way it is when t is the whole word; so under (b) an adjacent pair x, y
whose concatenation t is in the vocabulary but is not a listed merge never comes up (on t alone it
would end [x, y]). The pairs the two engines can merge are then the same, in the same order by (a),
leftmost first in both. Tokens that fail (b) are never made by `tokenizers` at all (the same
argument), so they are left out of tiktoken's table rather than giving up the engine. Both
conditions, and the rest of the pipeline (no normalizer, ByteLevel splitting with GPT-2's pattern,
nothing added after), are checked when the engine is built; a tokenizer that fails any of them keeps
the `tokenizers` engine.

What is left is the splitting pattern: `tokenizers` runs it on Oniguruma, tiktoken on fancy-regex,
whose Unicode tables may differ. So only ASCII texts take the fast engine (there the two agree,
checked at build on every pair of ASCII characters); a text with any other character, or holding an
added token's text (`<|endoftext|>`: `tokenizers` splits on those first), takes `tokenizers`.
"""

from __future__ import annotations

import json
import re
from typing import Any

import numpy as np

from mshpc.data.byte_level import bytes_to_unicode

# ByteLevel's pattern in `tokenizers` (pre_tokenizers/byte_level.rs), which GPT-2's encoder.py wrote.
GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
# Every pair of ASCII characters, each pair cut off from the next by a letter run: the two
# splitting engines must agree on all of it before the fast engine is used.
ASCII_PROBE_PIECES = [chr(a) + chr(b) + " ab" for a in range(128) for b in range(128)]


class FastBPE:
    """tiktoken's engine over a `tokenizers` byte-level BPE, for the texts it gives the same ids on."""

    def __init__(self, encoding: Any, added: list[str]) -> None:
        self._encoding = encoding
        self._added = re.compile("|".join(map(re.escape, added))) if added else None

    def takes(self, text: str) -> bool:
        """Whether `text` is one the fast engine encodes exactly as `tokenizers` does."""
        return text.isascii() and (self._added is None or self._added.search(text) is None)

    def encode(self, text: str) -> list[int]:
        return self._encoding.encode_ordinary(text)


def _byte_level_only(config: dict[str, Any]) -> bool:
    """Whether the pipeline around the model is GPT-2's: no normalizer, ByteLevel splitting with its
    own pattern and no prefix space, nothing added after, no truncation or padding."""
    pre = config.get("pre_tokenizer") or {}
    post = config.get("post_processor")
    model = config.get("model") or {}
    return (config.get("normalizer") is None and config.get("truncation") is None and config.get("padding") is None
            and pre.get("type") == "ByteLevel" and pre.get("use_regex", True) and not pre.get("add_prefix_space")
            and (post is None or post.get("type") == "ByteLevel")
            and model.get("type") == "BPE" and model.get("dropout") is None
            and not model.get("continuing_subword_prefix") and not model.get("end_of_word_suffix")
            and not model.get("ignore_merges") and not model.get("byte_fallback"))


def _ranks(rust_tokenizer: Any, config: dict[str, Any]) -> dict[bytes, int] | None:
    """tiktoken's table for the model: every token condition (b) holds for, by its bytes; None where
    a byte has no token or condition (a) fails."""
    model, added = config["model"], {a["content"] for a in config.get("added_tokens", ())}
    byte_of = {ch: b for b, ch in bytes_to_unicode().items()}
    vocab: dict[str, int] = {t: i for t, i in model["vocab"].items() if t not in added}
    if any(ch not in vocab for ch in byte_of):
        return None
    bpe = rust_tokenizer.model
    live = {t for t in vocab if len(t) == 1 or [tok.id for tok in bpe.tokenize(t)] == [vocab[t]]}  # (b)
    last = -1
    for merge in model["merges"]:
        made = "".join(merge.split(" ", 1) if isinstance(merge, str) else merge)
        if made in live:
            if vocab[made] <= last:  # (a)
                return None
            last = vocab[made]
    try:
        return {bytes(byte_of[ch] for ch in t): vocab[t] for t in live}
    except KeyError:  # a token with a character outside the byte table: not a byte-level vocabulary
        return None


def build(rust_tokenizer: Any) -> FastBPE | None:
    """The fast engine for a `tokenizers.Tokenizer`, or None where it would not give the same ids
    (or tiktoken is not installed)."""
    try:
        import tiktoken
    except ImportError:
        return None
    config = json.loads(rust_tokenizer.to_str())
    if not _byte_level_only(config):
        return None
    ranks = _ranks(rust_tokenizer, config)
    if ranks is None:
        return None
    encoding = tiktoken.Encoding("mshpc-byte-level-bpe", pat_str=GPT2_PATTERN, mergeable_ranks=ranks,
                                 special_tokens={})
    fast = FastBPE(encoding, [a["content"] for a in config.get("added_tokens", ())])
    probe = "".join(piece for piece in ASCII_PROBE_PIECES if fast.takes(piece))  # an added token's text aside
    if not fast.takes(probe) or fast.encode(probe) != rust_tokenizer.encode(probe, add_special_tokens=False).ids:
        return None
    return fast


def encode_batch(fast: FastBPE | None, rust_tokenizer: Any, texts: list[str]) -> list[np.ndarray]:
    """The ids of each text as `rust_tokenizer.encode_batch_fast` gives them: through `fast` for the
    texts it takes, the rest in one call into `tokenizers`."""
    if fast is None:
        return [np.asarray(e.ids, dtype=np.uint32) for e in rust_tokenizer.encode_batch_fast(texts)]
    out: list[np.ndarray | None] = []
    slow: list[int] = []
    for i, text in enumerate(texts):
        if fast.takes(text):
            out.append(np.asarray(fast.encode(text), dtype=np.uint32))
        else:
            out.append(None)
            slow.append(i)
    if slow:
        for i, e in zip(slow, rust_tokenizer.encode_batch_fast([texts[i] for i in slow]), strict=True):
            out[i] = np.asarray(e.ids, dtype=np.uint32)
    return out  # type: ignore[return-value]
