"""Cost per accepted step, the spot budget example, checkpoint-interval formulas, and the save
cadence by steps and by (fake) wall-clock time; nothing here sleeps."""

from __future__ import annotations

import doctest
import math

import pytest

import ckpt_lesson.runs.cost as cost
from ckpt_lesson.errors import CheckpointError
from ckpt_lesson.runs.cost import (
    SaveCadence,
    compare_spot,
    cost_per_accepted_step,
    daly_interval,
    expected_wall_time,
    should_save,
    validate_cadence,
    young_interval,
)


def test_spot_at_half_price_billing_fourteen_hours_is_thirty_percent_cheaper_not_fifty():
    c = compare_spot(job_hours=10, billed_spot_hours=14, spot_price_fraction=0.5)
    assert c.on_demand_cost == 10.0
    assert c.spot_cost == 7.0
    assert c.savings_fraction == pytest.approx(0.3, abs=1e-12)
    assert c.savings_fraction != pytest.approx(0.5)


def test_spot_that_bills_more_than_twice_the_hours_at_half_price_is_dearer():
    c = compare_spot(job_hours=10, billed_spot_hours=25, spot_price_fraction=0.5)
    assert c.savings_fraction < 0


def test_cost_per_accepted_step_divides_by_unique_steps_not_executed_steps():
    # 1200 steps executed at 0.1 each, 200 of them redone: 1000 unique steps.
    executed, redone, per_step = 1200, 200, 0.1
    value = cost_per_accepted_step(
        compute_cost=executed * per_step, save_cost=5.0, transfer_cost=3.0, unique_steps=executed - redone
    )
    assert value == pytest.approx((120.0 + 5.0 + 3.0) / 1000)
    assert value > per_step  # redone work and saves make each accepted step dearer


@pytest.mark.parametrize("bad", [0, -1, 2.5, True])
def test_cost_per_accepted_step_refuses_a_step_count_below_one(bad):
    with pytest.raises(CheckpointError, match="unique_steps"):
        cost_per_accepted_step(compute_cost=1.0, unique_steps=bad)


def test_negative_costs_are_refused():
    with pytest.raises(CheckpointError, match="save_cost"):
        cost_per_accepted_step(compute_cost=1.0, save_cost=-1.0, unique_steps=1)


def test_young_interval_known_value():
    # sqrt(2 * 2 s * 3600 s) = 120 s
    assert young_interval(2.0, 3600.0) == 120.0
    assert young_interval(50.0, 10_000.0) == 1000.0


def test_daly_interval_known_values():
    # delta = 2, M = 3600: x = delta/(2M) = 1/3600, sqrt(x) = 1/60
    expected = 120.0 * (1 + (1 / 60) / 3 + (1 / 3600) / 9) - 2.0
    assert daly_interval(2.0, 3600.0) == pytest.approx(expected, rel=1e-12)
    assert daly_interval(2.0, 3600.0) == pytest.approx(118.6704, abs=1e-4)


def test_daly_interval_is_the_mtbf_when_a_save_takes_two_mtbf_or_more():
    assert daly_interval(10.0, 4.0) == 4.0
    assert daly_interval(8.0, 4.0) == 4.0


def test_daly_and_young_agree_when_saves_are_cheap():
    assert daly_interval(0.01, 1e6) == pytest.approx(young_interval(0.01, 1e6), rel=1e-3)


def test_daly_interval_is_the_minimum_of_daly_expected_wall_time():
    delta, mtbf = 60.0, 3600.0
    grid = [t / 10 for t in range(100, 20_000)]
    times = [
        expected_wall_time(solve_seconds=36_000, interval_seconds=t, save_seconds=delta, mtbf_seconds=mtbf)
        for t in grid
    ]
    best = grid[times.index(min(times))]
    assert daly_interval(delta, mtbf) == pytest.approx(best, rel=0.01)


def test_restart_time_scales_expected_time_but_not_the_optimum():
    kw = dict(solve_seconds=1000.0, save_seconds=5.0, mtbf_seconds=500.0)
    no_restart = expected_wall_time(interval_seconds=70.0, **kw)
    with_restart = expected_wall_time(interval_seconds=70.0, restart_seconds=50.0, **kw)
    assert with_restart == pytest.approx(no_restart * math.exp(50.0 / 500.0))


@pytest.mark.parametrize(
    "args", [(0.0, 10.0), (1.0, 0.0), (-1.0, 10.0), (float("nan"), 1.0), (1.0, float("inf"))]
)
def test_interval_formulas_refuse_non_positive_inputs(args):
    with pytest.raises(CheckpointError):
        young_interval(*args)
    with pytest.raises(CheckpointError):
        daly_interval(*args)


def test_module_docstring_examples_run():
    result = doctest.testmod(cost, optionflags=doctest.ELLIPSIS)
    assert result.failed == 0 and result.attempted > 0


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
