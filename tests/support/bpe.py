"""A tiny byte-level BPE tokenizer file, trained here (nothing downloaded), for the tests of
the BPE paths."""

from pathlib import Path


def train_bpe(path: Path, special_tokens: list[str]):
    """A tiny byte-level BPE tokenizer saved to `path`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    hf = Tokenizer(models.BPE(unk_token="<unk>"))
    hf.pre_tokenizer = pre_tokenizers.ByteLevel()
    hf.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", *special_tokens])
    hf.train_from_iterator(["hello world def f(x): return x + 1"] * 10, trainer=trainer)
    hf.save(str(path))
    return hf
