"""Which steps end in a checkpoint save: the one rule the checkpointer and the heartbeat share."""

from mshpc.config import load_config
from mshpc.save_schedule import SaveSchedule


def test_saves_every_interval_and_at_the_last_step():
    schedule = SaveSchedule(interval_steps=2, last_step=5)
    assert [step for step in range(1, 8) if schedule.due(step)] == [2, 4, 5, 6]


def test_interval_zero_never_saves_not_even_at_the_end():
    assert not any(SaveSchedule(interval_steps=0, last_step=5).due(step) for step in range(1, 8))


def test_built_from_the_checkpoint_and_train_sections():
    cfg = load_config(None, ["checkpoint.interval_steps=3", "train.steps=7"])
    assert SaveSchedule.of(checkpoint=cfg.checkpoint, train=cfg.train) == SaveSchedule(interval_steps=3, last_step=7)
