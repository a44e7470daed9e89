"""Stitching a trial's processes together and comparing it with the baseline."""

from __future__ import annotations

import math
from pathlib import Path

from ckpt_lesson.resume_test.compare import (
    close,
    compare,
    epoch_starts,
    find_repeat,
    restart_stats,
    stitch,
    trajectory,
)
from ckpt_lesson.resume_test.runner import Attempt
from ckpt_lesson.resume_test.steps import StepRecord


def attempt(index, steps, losses=None, started=0.0, ids=None):
    losses = losses or {}
    records = [StepRecord(s, losses.get(s, float(s)), ids(s) if ids else None, {}, started + 0.5 + s)
               for s in steps]  # fmt: skip
    return Attempt(index, Path("."), started, records=records)


BASE = trajectory(attempt(1, range(1, 11)).records)


def test_stitching_keeps_each_step_from_the_last_process_that_ran_it():
    stitched = stitch([attempt(1, range(1, 7), {5: 99.0, 6: 99.0}), attempt(2, range(5, 11))])
    assert stitched[4][1] == 1 and stitched[5][1] == 2 and stitched[5][0].loss == 5.0
    assert compare(BASE, stitched) == []


def test_compare_is_exact_by_default_and_honours_tolerances():
    stitched = stitch([attempt(1, range(1, 11), {3: 3.0 + 1e-9})])
    (diff,) = compare(BASE, stitched)
    assert (diff.step, diff.what, diff.baseline, diff.attempt) == (3, "loss", 3.0, 1)
    assert compare(BASE, stitched, atol=1e-6) == []
    assert compare(BASE, stitched, rtol=1e-6) == []


def test_close_treats_two_nans_and_equal_infinities_as_equal():
    assert close(math.nan, math.nan) and close(math.inf, math.inf)
    assert not close(math.nan, 1.0) and not close(math.inf, -math.inf)


def test_missing_and_extra_steps_are_differences():
    diffs = compare(BASE, stitch([attempt(1, [1, 2, 3, 5, 6, 7, 8, 9, 10, 11])]))
    assert [(d.step, d.what) for d in diffs] == [(4, "missing"), (11, "extra")]


def test_sample_ids_must_match_exactly_where_both_runs_report_them():
    base = trajectory(attempt(1, range(1, 4), ids=lambda s: (s,)).records)
    other = stitch([attempt(1, range(1, 4), ids=lambda s: (s if s != 2 else 7,))])
    (diff,) = compare(base, other)
    assert (diff.step, diff.what, diff.baseline, diff.resumed) == (2, "sample_ids", [2], [7])
    assert compare(base, stitch([attempt(1, range(1, 4))])) == []  # ids absent on one side: not compared


def test_metrics_are_compared_like_the_loss():
    base = {1: StepRecord(1, 1.0, None, {"lr": 0.1})}
    assert compare(base, {1: (StepRecord(1, 1.0, None, {"lr": 0.2}), 1)})[0].what == "metric lr"


def test_restart_stats_count_redone_steps_and_time_to_the_first_new_step():
    attempts = [attempt(1, range(1, 8)), attempt(2, range(5, 11), started=100.0)]
    (stat,) = restart_stats(attempts, list(range(1, 11)))
    assert (stat.attempt, stat.resumed_from, stat.first_step, stat.steps_redone) == (2, 4, 5, 3)
    assert stat.recovery_seconds == 8.5  # step 8 reported at 100 + 0.5 + 8
    assert not stat.from_scratch


def test_a_restart_that_begins_at_the_first_step_is_from_scratch():
    (stat,) = restart_stats([attempt(1, range(1, 5)), attempt(2, range(1, 11))], list(range(1, 11)))
    assert stat.from_scratch and stat.resumed_from == 0 and stat.steps_redone == 4


def test_epoch_starts_and_repeats_are_found_from_sample_ids():
    ids = {1: (0, 1), 2: (2, 3), 3: (1, 2), 4: (0, 3), 5: (3, 1)}
    base = {s: StepRecord(s, 0.0, i) for s, i in ids.items()}
    assert epoch_starts(base) == [1, 3, 5]
    assert find_repeat((1, 2), 5, base) == 3
    assert find_repeat((9, 9), 5, base) is None
