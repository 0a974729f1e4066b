"""SentencePiece and tiktoken tokenizers as a `tokenizer.json` that transformers loads, made by
transformers' own converters (`transformers.convert_slow_tokenizer`), then checked: AutoTokenizer
on the written folder must give the run tokenizer's ids on every probe text (fixed texts, and
every piece of the vocabulary), or the export stops with one line naming the first text and the
first token where they differ, rather than ship a tokenizer that reads text otherwise.

- SentencePiece: `SpmConverter.build_tokenizer_from_spm_proto`, which follows the model's own
  normalizer spec (its precompiled character map, extra-whitespace removal, dummy prefix), as
  `SentencePieceProcessor.encode` does. Text that spells a control piece (`</s>`) is that piece
  to a Unigram model in `tokenizers` but characters to SentencePiece: checked too, and said in
  the export's line where it differs.
- tiktoken: `TikTokenConverter` (byte-level BPE, merges rebuilt from the ranks) with mshpc's split
  pattern (cl100k's) and `<|endoftext|>` as the next id; the ranks are read by mshpc, never
  through tiktoken's cache keyed by the path.

The written config sets `split_special_tokens`: mshpc's datasets hold special-token text as text
(SentencePiece's and tiktoken's `encode_ordinary` rule), so AutoTokenizer must not read
`<|endoftext|>` in a document as the end-of-document id.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mshpc.data.tokenizer import Tokenizer
from mshpc.data.tokenizer_libs import CL100K_PATTERN, TIKTOKEN_EOS, read_ranks
from mshpc.errors import InteropError

PROBES = (
    "hello world", "Hello, World! It's we're they'll I'd", "def f(x):\n    return x ** 2  # comment\n",
    "  leading and trailing spaces  ", "many     spaces\tand\ttabs\r\nand CRLF\n\n\nblank lines", " ", "\n",
    "déjà vu — naïve ünïcode façade", "ﬁ ＡＢＣ ① ½ ™ Ⅻ", "e\u0301 \u200b zero width", "日本語のテキスト 中文 한국어",
    "emoji 😀👍🏽 and 🇫🇷", "Ελληνικά русский עברית العربية", "1234567890 3.14159 1,000,000 0x1F",
    "<html><body class=\"x\">&amp;</body></html>", "control \x01 \x7f chars", "MiXeD CaSe WORDS",
)
PIECES_PER_PROBE = 256  # the vocabulary's pieces go in as texts of this many, space-separated


def transformers_module() -> Any:
    try:
        import transformers
    except ImportError:
        raise InteropError("exporting a SentencePiece or tiktoken tokenizer needs transformers (its converters "
                           "write the tokenizer.json): pip install transformers") from None
    return transformers


def sentencepiece_backend(model: Path) -> tuple[Any, dict[str, str]]:
    """The `tokenizers` Tokenizer of a SentencePiece model, by transformers' SpmConverter, and its
    special tokens (unk, bos, eos, pad: those the model has) as PreTrainedTokenizerFast takes them."""
    transformers_module()
    from transformers.convert_slow_tokenizer import SentencePieceExtractor, SpmConverter

    if not hasattr(SpmConverter, "build_tokenizer_from_spm_proto"):
        raise InteropError("exporting a SentencePiece tokenizer needs a transformers whose SpmConverter follows "
                           "the model's normalizer spec (build_tokenizer_from_spm_proto): pip install -U transformers")
    proto = SentencePieceExtractor(str(model)).proto
    unigram = proto.trainer_spec.model_type == 1
    vocab: Any = ([(p.piece, p.score) for p in proto.pieces] if unigram
                  else {p.piece: i for i, p in enumerate(proto.pieces)})
    backend = SpmConverter.build_tokenizer_from_spm_proto(proto, vocab)
    if backend is None:
        raise InteropError(f"tokenizer {model}: transformers' SpmConverter converts only Unigram and BPE "
                           "SentencePiece models")
    spec = proto.trainer_spec
    ids = {"unk_token": spec.unk_id, "bos_token": spec.bos_id, "eos_token": spec.eos_id, "pad_token": spec.pad_id}
    return backend, {name: proto.pieces[i].piece for name, i in ids.items() if 0 <= i < len(proto.pieces)}


def tiktoken_backend(ranks_file: Path, eos_id: int) -> tuple[Any, dict[str, str]]:
    """The `tokenizers` Tokenizer of a tiktoken ranks file, by transformers' TikTokenConverter, with
    `<|endoftext|>` at `eos_id`, and its special tokens (that one, as eos)."""
    transformers_module()
    from tokenizers import AddedToken
    from transformers.convert_slow_tokenizer import TikTokenConverter

    class LocalRanks(TikTokenConverter):
        @staticmethod
        def load_tiktoken_bpe(path: str) -> dict[bytes, int]:
            return read_ranks(Path(path))

    backend = LocalRanks(vocab_file=str(ranks_file), pattern=CL100K_PATTERN).converted()
    backend.add_special_tokens([AddedToken(TIKTOKEN_EOS, special=True, normalized=False)])
    if backend.token_to_id(TIKTOKEN_EOS) != eos_id:
        raise InteropError(f"tokenizer {ranks_file}: its ranks are not 0..{eos_id - 1} without gaps, so "
                           f"transformers would put {TIKTOKEN_EOS} at id {backend.token_to_id(TIKTOKEN_EOS)}, "
                           f"not {eos_id}")
    return backend, {"eos_token": TIKTOKEN_EOS}


def probe_texts(tokenizer: Tokenizer, known: int) -> list[str]:
    """PROBES, then the text of every piece of the vocabulary (ids below `known`), PIECES_PER_PROBE a text."""
    pieces = [tokenizer.decode([i]) for i in range(known)]
    return [*PROBES, *(" ".join(pieces[i:i + PIECES_PER_PROBE]) for i in range(0, known, PIECES_PER_PROBE))]


def first_difference(tokenizer: Tokenizer, auto: Any, texts: list[str]) -> str | None:
    """Where AutoTokenizer `auto` first gives other ids than `tokenizer` on `texts`: a phrase
    naming the text and the token; None where they agree on all."""
    theirs = auto(texts, add_special_tokens=False, verbose=False)["input_ids"]
    for text, ours, other in zip(texts, tokenizer.encode_batch(texts), theirs, strict=True):
        ours = ours.tolist()
        if ours != other:
            at = next((i for i, (a, b) in enumerate(zip(ours, other, strict=False)) if a != b), min(len(ours), len(other)))
            shown = text if len(text) <= 60 else text[:57] + "..."
            return (f"on {shown!r} from token {at}: {tokenizer.kind} gives {ours[at:at + 4]}, "
                    f"transformers {other[at:at + 4]}")
    return None


def special_probes(specials: list[str]) -> list[str]:
    """Texts that spell the special tokens, inside words and alone."""
    return [f"a{token}b {token}" for token in specials]
