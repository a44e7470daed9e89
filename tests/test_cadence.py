"""Save cadence by steps and by (fake) wall-clock time; nothing here sleeps."""

from __future__ import annotations

import pytest

from ckpt_lesson.errors import CheckpointError
from ckpt_lesson.runs.cadence import SaveCadence, should_save, validate_cadence


class FakeClock:
    def __init__(self, start: float = 100.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now


def _due(step, now, last_step=None, last_time=0.0, every_steps=None, every_seconds=None):
    return should_save(
        step,
        now,
        last_step=last_step,
        last_time=last_time,
        every_steps=every_steps,
        every_seconds=every_seconds,
    )


def test_step_cadence_fires_on_multiples_only():
    fired = [s for s in range(0, 31) if _due(s, 0.0, every_steps=10)]
    assert fired == [10, 20, 30]


def test_step_zero_is_never_saved():
    assert not _due(0, 1e9, every_steps=1, every_seconds=1.0)


def test_the_same_step_is_never_saved_twice():
    assert not _due(10, 1e9, last_step=10, every_steps=10, every_seconds=1.0)


def test_time_cadence_fires_once_the_interval_has_passed():
    assert not _due(3, 59.9, last_time=0.0, every_seconds=60)
    assert _due(3, 60.0, last_time=0.0, every_seconds=60)


def test_time_cadence_without_a_reference_time_does_not_fire():
    assert not _due(3, 1e9, last_time=None, every_seconds=60)


def test_either_rule_is_enough_when_both_are_set():
    assert _due(10, 1.0, last_time=0.0, every_steps=10, every_seconds=60)
    assert _due(7, 61.0, last_time=0.0, every_steps=10, every_seconds=60)
    assert not _due(7, 1.0, last_time=0.0, every_steps=10, every_seconds=60)


def test_save_cadence_with_a_fake_clock_saves_every_interval_of_wall_time():
    clock = FakeClock()
    cadence = SaveCadence(every_seconds=30.0, clock=clock)
    saved = []
    for step in range(1, 21):
        clock.now += 7.0  # each step takes 7 s
        if cadence.should_save(step):
            cadence.mark_saved(step)
            saved.append(step)
    # 30 s / 7 s per step: due after the 5th step (35 s), then every 5 steps.
    assert saved == [5, 10, 15, 20]


def test_save_cadence_mark_saved_restarts_the_timer_and_blocks_the_same_step():
    clock = FakeClock()
    cadence = SaveCadence(every_steps=5, every_seconds=10.0, clock=clock)
    clock.now += 11.0
    assert cadence.should_save(3)
    cadence.mark_saved(3)
    assert not cadence.should_save(3)
    assert not cadence.should_save(4)
    assert cadence.should_save(5)


@pytest.mark.parametrize(
    ("steps", "seconds", "match"),
    [
        (0, None, "every_steps must be"),
        (2.5, None, "every_steps must be"),
        (True, None, "every_steps must be"),
        (None, 0, "every_seconds must be"),
        (None, -1.0, "every_seconds must be"),
        (None, float("nan"), "every_seconds must be"),
        (None, float("inf"), "every_seconds must be"),
        (None, None, "set every_steps, every_seconds or both"),
    ],
)
def test_invalid_cadence_settings_are_refused_with_a_clear_message(steps, seconds, match):
    with pytest.raises(CheckpointError, match=match):
        validate_cadence(steps, seconds)
    with pytest.raises(CheckpointError, match=match):
        SaveCadence(every_steps=steps, every_seconds=seconds)
