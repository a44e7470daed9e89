"""Gradient accumulation: resume equals the uninterrupted run at and between optimizer steps."""

from __future__ import annotations

import pytest
import torch

from ckpt_lesson.course.accumulating import train_accumulating
from ckpt_lesson.course.training import (
    SyntheticRegression,
    make_model,
    make_optimizer_and_scheduler,
    seed_everything,
    train,
)
from ckpt_lesson.errors import StateMismatchError
from ckpt_lesson.files.checkpoint import TrainState, apply_payload, load_checkpoint, read_checkpoint
from ckpt_lesson.runs.accumulation import (
    ACCUMULATION_SCHEMA,
    AccumulationState,
    load_accumulating,
    save_accumulating,
)

SEED = 3
ACCUM, MICRO, UNTIL = 4, 8, 12  # 32 micro-batches per epoch: the run crosses an epoch boundary
ACC = {"accum_steps": ACCUM, "micro_batch_size": MICRO}


def fresh(total_steps: int = UNTIL):
    seed_everything(SEED)
    data = SyntheticRegression(seed=SEED)
    model = make_model()
    opt, sched = make_optimizer_and_scheduler(model, total_steps=total_steps)
    return data, model, opt, sched


def baseline():
    data, model, opt, sched = fresh()
    state = AccumulationState()
    records = train_accumulating(model, opt, sched, state, data, until_step=UNTIL, seed=SEED, **ACC)
    return state.losses, [r.sample_ids for r in records]


def interrupted_then_resumed(tmp_path, stop_at):
    """Train until ``stop_at(state, record)`` is true, save, then resume in fresh objects."""
    path = tmp_path / "accum.pt"
    data, model, opt, sched = fresh()
    state = AccumulationState()

    def after(st, rec):
        if stop_at(st, rec):
            save_accumulating(model, opt, sched, st, path, **ACC)
            return True
        return False

    first = train_accumulating(
        model, opt, sched, state, data, until_step=UNTIL, seed=SEED, **ACC,
        after_micro_step=after,
    )  # fmt: skip
    data, model, opt, sched = fresh()
    resumed = load_accumulating(path, model, opt, sched, **ACC)
    second = train_accumulating(model, opt, sched, resumed, data, until_step=UNTIL, seed=SEED, **ACC)
    return path, resumed, [r.sample_ids for r in first + second]


def test_resume_from_an_optimizer_step_boundary_equals_the_uninterrupted_run(tmp_path):
    losses, ids = baseline()
    path, resumed, got_ids = interrupted_then_resumed(tmp_path, lambda st, rec: rec.boundary and st.step == 5)
    assert read_checkpoint(path)["extras"]["accumulation"]["grads"] == {}
    assert resumed.losses == losses
    assert got_ids == ids


def test_resume_from_the_middle_of_an_accumulation_equals_the_uninterrupted_run(tmp_path):
    losses, ids = baseline()
    mid_step_6 = lambda st, rec: st.step == 5 and st.micro_step == 2  # noqa: E731
    path, resumed, got_ids = interrupted_then_resumed(tmp_path, mid_step_6)
    block = read_checkpoint(path)["extras"]["accumulation"]
    assert block["schema"] == ACCUMULATION_SCHEMA
    assert block["micro_step"] == 2 and len(block["micro_losses"]) == 2
    assert set(block["grads"]) == {n for n, _ in make_model().named_parameters()}
    assert resumed.losses == losses
    assert got_ids == ids


def test_dropping_the_accumulated_gradients_changes_the_run(tmp_path):
    # The negative control: what the accumulation block is for.
    losses, _ = baseline()
    path = tmp_path / "accum.pt"
    data, model, opt, sched = fresh()
    train_accumulating(
        model, opt, sched, AccumulationState(), data, until_step=UNTIL, seed=SEED, accum_steps=ACCUM,
        micro_batch_size=MICRO,
        after_micro_step=lambda st, rec: (st.step == 5 and st.micro_step == 2)
        and (save_accumulating(model, opt, sched, st, path, **ACC) or True),
    )  # fmt: skip
    data, model, opt, sched = fresh()
    # Naive on purpose: claim to handle the accumulation block, then ignore it.
    plain = apply_payload(read_checkpoint(path), model, opt, sched, handles=("accumulation",))
    state = AccumulationState(
        step=plain.step, epoch=plain.epoch, batch_in_epoch=plain.batch_in_epoch, losses=plain.losses,
        micro_step=2, micro_losses=[0.0, 0.0],
    )  # fmt: skip
    train_accumulating(model, opt, sched, state, data, until_step=UNTIL, seed=SEED, **ACC)
    assert state.losses[:5] == losses[:5]
    assert state.losses[6:] != losses[6:]


def test_accumulating_one_micro_batch_per_step_is_the_plain_training_loop():
    data, model, opt, sched = fresh()
    plain = TrainState()
    train(model, opt, sched, plain, data, until_step=UNTIL, seed=SEED, batch_size=MICRO)
    data, model, opt, sched = fresh()
    accum = AccumulationState()
    train_accumulating(
        model, opt, sched, accum, data, until_step=UNTIL, seed=SEED, accum_steps=1, micro_batch_size=MICRO
    )
    assert accum.losses == plain.losses


def test_boundary_saves_happen_only_at_optimizer_steps():
    data, model, opt, sched = fresh()
    seen: list[tuple[int, int]] = []
    train_accumulating(
        model, opt, sched, AccumulationState(), data, until_step=UNTIL, seed=SEED, accum_steps=ACCUM,
        micro_batch_size=MICRO, save=lambda st: seen.append((st.step, st.micro_step)), every_steps=4,
    )  # fmt: skip
    assert seen == [(4, 0), (8, 0), (12, 0)]


def test_the_state_block_stays_a_plain_train_state(tmp_path):
    data, model, opt, sched = fresh()
    state = AccumulationState(step=2, micro_step=1, micro_losses=[0.5])
    model(torch.zeros(1, 8)).sum().backward()
    save_accumulating(model, opt, sched, state, tmp_path / "a.pt", **ACC)
    assert set(read_checkpoint(tmp_path / "a.pt")["state"]) == {"step", "epoch", "batch_in_epoch", "losses"}


def test_resuming_with_a_different_accumulation_split_is_refused_and_changes_nothing(tmp_path):
    path, _, _ = interrupted_then_resumed(tmp_path, lambda st, rec: st.step == 2 and st.micro_step == 1)
    data, model, opt, sched = fresh()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(StateMismatchError, match="accum_steps=4"):
        load_accumulating(path, model, opt, sched, accum_steps=2, micro_batch_size=MICRO)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())


def test_a_file_without_an_accumulation_block_is_refused(tmp_path):
    from ckpt_lesson.files.checkpoint import save_checkpoint

    data, model, opt, sched = fresh()
    save_checkpoint(model, opt, sched, TrainState(), tmp_path / "plain.pt")
    with pytest.raises(StateMismatchError, match="save_accumulating"):
        load_accumulating(tmp_path / "plain.pt", model, opt, sched, **ACC)


def test_invalid_accumulation_settings_are_refused():
    data, model, opt, sched = fresh()
    with pytest.raises(StateMismatchError):
        train_accumulating(
            model, opt, sched, AccumulationState(), data, until_step=1, seed=SEED, accum_steps=0,
            micro_batch_size=8,
        )  # fmt: skip
    with pytest.raises(StateMismatchError, match="micro_step"):
        train_accumulating(
            model, opt, sched, AccumulationState(micro_step=4), data, until_step=1, seed=SEED, accum_steps=4,
            micro_batch_size=8,
        )  # fmt: skip
    with pytest.raises(StateMismatchError, match="larger than the data"):
        train_accumulating(
            model, opt, sched, AccumulationState(), data, until_step=1, seed=SEED, accum_steps=2,
            micro_batch_size=len(data) + 1,
        )  # fmt: skip


def test_a_plain_load_refuses_a_mid_accumulation_save_instead_of_dropping_its_gradients(tmp_path):
    path = tmp_path / "accum.pt"
    data, model, opt, sched = fresh()
    train_accumulating(
        model, opt, sched, AccumulationState(), data, until_step=UNTIL, seed=SEED, **ACC,
        after_micro_step=lambda st, rec: (st.step == 5 and st.micro_step == 2)
        and (save_accumulating(model, opt, sched, st, path, **ACC) or True),
    )  # fmt: skip
    data, model, opt, sched = fresh()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(StateMismatchError, match="load_accumulating"):
        load_checkpoint(path, model, opt, sched)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_a_plain_load_accepts_a_save_made_at_an_optimizer_step_boundary(tmp_path):
    path = tmp_path / "accum.pt"
    data, model, opt, sched = fresh()
    train_accumulating(
        model, opt, sched, AccumulationState(), data, until_step=UNTIL, seed=SEED, **ACC,
        after_micro_step=lambda st, rec: (rec.boundary and st.step == 5)
        and (save_accumulating(model, opt, sched, st, path, **ACC) or True),
    )  # fmt: skip
    data, model, opt, sched = fresh()
    assert load_checkpoint(path, model, opt, sched).step == 5
