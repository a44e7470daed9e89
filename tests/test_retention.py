"""Retention rules: pure functions over step numbers, tested without disk."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ckpt_lesson.errors import CheckpointError
from ckpt_lesson.runs.retention import KeepBest, KeepLastK, keep_last_k


def test_keep_last_k_deletes_everything_older_than_the_k_newest_verified():
    assert keep_last_k([10, 20, 30, 40, 50], verified={10, 20, 30, 40, 50}, k=3) == [10, 20]


def test_keep_last_k_deletes_nothing_when_fewer_than_k_are_verified():
    assert keep_last_k([10, 20, 30], verified={30}, k=2) == []
    assert keep_last_k([], verified=set(), k=1) == []


def test_keep_last_k_keeps_an_unverified_save_between_kept_ones_and_deletes_older_unverified():
    # 30 is corrupt but newer than the oldest kept verified save (20): left alone as evidence.
    assert keep_last_k([10, 15, 20, 30, 40], verified={10, 20, 40}, k=2) == [10, 15]


def test_keep_last_k_counts_only_verified_saves_not_all_saves():
    # Three newest are unverified; the only good save (10) must survive.
    assert keep_last_k([10, 20, 30, 40], verified={10}, k=1) == []


def test_keep_last_k_ignores_order_duplicates_and_verified_steps_not_present():
    assert keep_last_k([40, 10, 30, 10, 20], verified={10, 20, 30, 40, 99}, k=2) == [10, 20]


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, None])
def test_keep_last_k_rejects_a_k_that_could_keep_nothing(bad):
    with pytest.raises(CheckpointError, match="k must be an int >= 1"):
        keep_last_k([1, 2], verified={1, 2}, k=bad)


def test_keep_last_k_policy_object_matches_the_function():
    assert KeepLastK(2).to_delete([1, 2, 3, 4], verified={1, 2, 3, 4}) == [1, 2]
    with pytest.raises(CheckpointError):
        KeepLastK(0)


def test_keep_best_protects_the_best_metric_step_from_deletion():
    policy = KeepBest({1: 0.5, 2: 0.1, 3: 0.4, 4: 0.3}, k_best=1, keep_last=1)
    assert policy.to_delete([1, 2, 3, 4], verified={1, 2, 3, 4}) == [1, 3]


def test_keep_best_in_max_mode_protects_the_highest_metric():
    policy = KeepBest({1: 0.9, 2: 0.1, 3: 0.4}, k_best=1, keep_last=1, mode="max")
    assert policy.to_delete([1, 2, 3], verified={1, 2, 3}) == [2]


def test_keep_best_never_protects_an_unverified_step():
    policy = KeepBest({1: 0.0, 2: 0.5, 3: 0.9}, k_best=1, keep_last=1)
    # Step 1 has the best metric but is not verified: step 2 is the best verified one.
    assert policy.to_delete([1, 2, 3], verified={2, 3}) == [1]


def test_keep_best_rejects_bad_settings():
    with pytest.raises(CheckpointError, match="k_best"):
        KeepBest({}, k_best=0)
    with pytest.raises(CheckpointError, match="mode"):
        KeepBest({}, mode="median")


steps_st = st.lists(st.integers(min_value=1, max_value=60), max_size=20, unique=True)


@settings(max_examples=80, deadline=None)
@given(steps=steps_st, data=st.data(), k=st.integers(min_value=1, max_value=5))
def test_keep_last_k_never_deletes_the_newest_verified_nor_leaves_fewer_than_k_good(steps, data, k):
    verified = set(data.draw(st.lists(st.sampled_from(steps), unique=True) if steps else st.just([])))
    deleted = keep_last_k(steps, verified, k)
    remaining = set(steps) - set(deleted)
    assert deleted == sorted(deleted)
    assert set(deleted) <= set(steps)
    good_before = verified & set(steps)
    good_after = verified & remaining
    if good_before:
        assert max(good_before) in remaining
        assert len(good_after) == min(k, len(good_before))
    if len(good_before) < k:
        assert deleted == []
    # Nothing newer than the oldest kept verified save is ever deleted.
    if deleted:
        assert max(deleted) < min(sorted(good_before)[-k:])
