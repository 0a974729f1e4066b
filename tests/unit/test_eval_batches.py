"""Issue #42, item 6: a held-out split of fewer windows than eval.batches x the global batch is
scored without repeating a window, and said so in one line (it used to score the same 9 windows
about 7 times each, silently)."""

from mshpc.evaluate import eval_batches


def test_a_split_that_holds_every_batch_is_scored_as_asked_without_a_word():
    assert eval_batches(n_windows=1000, global_batch=16, wanted=10, seq_len=128) == (10, None)
    assert eval_batches(n_windows=160, global_batch=16, wanted=10, seq_len=128) == (10, None)


def test_a_smaller_split_scores_its_whole_batches_none_twice_and_says_so():
    batches, line = eval_batches(n_windows=100, global_batch=16, wanted=10, seq_len=128)
    assert batches == 6 and batches * 16 <= 100  # every window scored at most once
    assert line == ("validation: the held-out split has 100 windows of 129 tokens, fewer than eval.batches x the "
                    "global batch = 10 x 16: each evaluation scores 6 batches (96 windows, none twice) instead of 10")


def test_a_split_below_one_batch_is_one_batch_and_names_the_repeats_and_the_fix():
    batches, line = eval_batches(n_windows=9, global_batch=64, wanted=8, seq_len=128)
    assert batches == 1
    assert line is not None and "\n" not in line
    assert "1 batch of 64 windows, only 9 of them distinct (the rest repeats)" in line
    assert "--val-fraction" in line
