"""The negative controls: deliberately naive resumes that must diverge, and the helpers they share.

The checkpoint comes from an in-process run (no child processes needed): the
controls only read it, so how it was written does not matter here; the real
kill-and-resume is tested in test_demo.py.
"""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest
import torch

from ckpt_lesson.course.controls import (
    ALL_CONTROL_KINDS,
    CONTROL_KINDS,
    caller_rng_preserved,
    control_records,
    max_loss_diff,
    run_negative_control,
)
from ckpt_lesson.course.demo_worker import build_run
from ckpt_lesson.course.training import train
from ckpt_lesson.errors import CheckpointError
from ckpt_lesson.files.checkpoint import TrainState, load_checkpoint, save_checkpoint

STEPS, SAVE_AT, SEED = 20, 7, 5


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """A baseline of STEPS steps and a checkpoint saved at SAVE_AT by an identical run."""
    with caller_rng_preserved():
        data, model, optimizer, scheduler = build_run(SEED, STEPS)
        baseline = train(model, optimizer, scheduler, TrainState(), data, until_step=STEPS, seed=SEED)
        data, model, optimizer, scheduler = build_run(SEED, STEPS)
        state = TrainState()
        train(model, optimizer, scheduler, state, data, until_step=SAVE_AT, seed=SEED)
        ckpt = tmp_path_factory.mktemp("controls") / "ckpt.pt"
        save_checkpoint(model, optimizer, scheduler, state, ckpt)
    return {"ckpt": ckpt, "losses": [r.loss for r in baseline], "ids": [list(r.sample_ids) for r in baseline]}


def test_a_correct_resume_from_the_same_checkpoint_matches_the_baseline_exactly(run: dict) -> None:
    # Without this, a diverging control could just mean the fixture's checkpoint is wrong.
    with caller_rng_preserved():
        data, model, optimizer, scheduler = build_run(SEED, STEPS)
        state = load_checkpoint(run["ckpt"], model, optimizer, scheduler)
        records = train(model, optimizer, scheduler, state, data, until_step=STEPS, seed=SEED)
    assert max_loss_diff([r.loss for r in records], run["losses"][SAVE_AT:]) == 0.0


@pytest.mark.parametrize("kind", CONTROL_KINDS)
def test_negative_control_diverges_from_the_baseline_on_the_same_batches(run: dict, kind: str) -> None:
    records = control_records(kind, ckpt_path=run["ckpt"], total_steps=STEPS, seed=SEED)
    assert [list(r.sample_ids) for r in records] == run["ids"][SAVE_AT:]
    assert max_loss_diff([r.loss for r in records], run["losses"][SAVE_AT:]) > 0.0


def test_the_data_position_control_diverges_only_because_it_trains_on_other_batches(run: dict) -> None:
    records = control_records("no_data_position", ckpt_path=run["ckpt"], total_steps=STEPS, seed=SEED)
    ids = [list(r.sample_ids) for r in records]
    assert ids != run["ids"][SAVE_AT:]
    assert ids[0] == run["ids"][0]  # the interrupted epoch started over: its first batch again
    assert max_loss_diff([r.loss for r in records], run["losses"][SAVE_AT:]) > 0.0


def test_the_demo_runs_two_controls_and_run_negative_control_knows_a_third() -> None:
    assert CONTROL_KINDS == ("no_rng", "fresh_optimizer")
    assert ALL_CONTROL_KINDS == (*CONTROL_KINDS, "no_data_position")


def test_negative_control_is_repeatable(run: dict) -> None:
    first = run_negative_control("no_rng", ckpt_path=run["ckpt"], total_steps=STEPS, seed=SEED)
    second = run_negative_control("no_rng", ckpt_path=run["ckpt"], total_steps=STEPS, seed=SEED)
    assert first == second and len(first) == STEPS - SAVE_AT


def test_negative_control_leaves_the_callers_random_state_alone(run: dict) -> None:
    random.seed(123)
    np.random.seed(123)
    torch.manual_seed(123)
    threads = torch.get_num_threads()
    expected = (random.random(), float(np.random.random()), torch.rand(3))
    random.seed(123)
    np.random.seed(123)
    torch.manual_seed(123)
    run_negative_control("fresh_optimizer", ckpt_path=run["ckpt"], total_steps=STEPS, seed=SEED)
    got = (random.random(), float(np.random.random()), torch.rand(3))
    assert got[:2] == expected[:2] and torch.equal(got[2], expected[2])
    assert torch.get_num_threads() == threads


def test_negative_control_refuses_an_unknown_kind(run: dict) -> None:
    with pytest.raises(CheckpointError, match="no_rng"):
        run_negative_control("no_scheduler", ckpt_path=run["ckpt"], total_steps=STEPS, seed=SEED)


def test_negative_control_refuses_a_checkpoint_saved_at_or_after_the_end(run: dict) -> None:
    with pytest.raises(CheckpointError, match="total_steps"):
        run_negative_control("no_rng", ckpt_path=run["ckpt"], total_steps=SAVE_AT, seed=SEED)


def test_negative_control_refuses_a_missing_checkpoint(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError):
        run_negative_control("no_rng", ckpt_path=tmp_path / "absent.pt", total_steps=STEPS, seed=SEED)


def test_max_loss_diff_is_the_largest_absolute_difference_and_zero_for_empty_runs() -> None:
    assert max_loss_diff([1.0, 2.0, 3.0], [1.0, 2.5, 2.0]) == 1.0
    assert max_loss_diff([], []) == 0.0


def test_max_loss_diff_refuses_runs_of_different_lengths() -> None:
    with pytest.raises(CheckpointError, match="different steps"):
        max_loss_diff([1.0, 2.0], [1.0])
