"""A dataset's token ids are checked against the model's vocabulary as they are read (issue #43,
finding 11; built by the data branch in data/window_reader.py): an id at or past
model.vocab_size is one line naming the dataset, not an IndexError in the embedding blamed on a node
(on a GPU, a device-side assert)."""

import re

import pytest
from support.token_data import make_random_dataset

from mshpc.data.sampler import SequenceSampler
from mshpc.data.shards import TokenDataset
from mshpc.data.window_reader import WindowReader
from mshpc.errors import DataError


def test_a_token_id_past_the_vocabulary_is_one_line(tmp_path):
    dataset = TokenDataset.open(make_random_dataset(tmp_path))  # bytes 'a'-'z' (97-122) and eos 256
    sampler = SequenceSampler(dataset.n_tokens, 32, 4, 0)
    assert WindowReader(dataset, sampler, 1, None, vocab_size=257).batch(0, 0).tokens.max() < 257
    with pytest.raises(DataError) as err:
        WindowReader(dataset, sampler, 1, None, vocab_size=110).batch(0, 0)
    assert "\n" not in str(err.value)
    assert re.fullmatch(rf"{tmp_path / 'ds'}: token id \d+ in window \d+ is >= model.vocab_size=110 \(.*\)", str(err.value))
