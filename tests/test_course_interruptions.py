"""Notebook 00's interruption model: the numbers its tables print follow from the scenario."""

from __future__ import annotations

from ckpt_lesson.course.interruptions import simulate


def test_a_run_longer_than_its_allocation_never_finishes_without_checkpoints():
    wall, lost, interruptions = simulate(None)
    assert wall is None
    assert interruptions == 11
    assert round(lost, 1) == 42.7


def test_saving_every_30_minutes_finishes_in_21_hours_and_loses_little():
    wall, lost, interruptions = simulate(30)
    assert (round(wall, 1), round(lost, 1), interruptions) == (21.0, 1.6, 5)


def test_saving_every_2_hours_loses_far_more_than_twice_saving_every_hour():
    assert simulate(120)[1] > 2 * simulate(60)[1]


def test_a_save_before_each_known_deadline_leaves_only_the_random_reboot_to_lose():
    periodic = simulate(30)
    with_deadline = simulate(30, save_at_deadline=True)
    assert with_deadline[1] < periodic[1]
    assert with_deadline[0] < periodic[0]


def test_a_run_that_fits_one_allocation_and_never_reboots_loses_nothing():
    assert simulate(None, total_h=2, reboot_at_h=99) == (2.0, 0.0, 0)
