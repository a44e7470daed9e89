"""The teaching harness: a seeded order per epoch, O(1) fast-forward, repeatable and learning."""

from __future__ import annotations

import os
import random
import subprocess
import sys

import numpy as np
import pytest
import torch

from ckpt_lesson.course.training import SyntheticRegression, batch_sample_ids, epoch_order, train
from ckpt_lesson.files.checkpoint import TrainState


def test_epoch_order_depends_on_seed_and_epoch_only():
    first = epoch_order(5, 2, 64)
    torch.manual_seed(123)  # the global generators must not matter
    random.seed(123)
    np.random.seed(123)
    torch.rand(100)
    assert torch.equal(epoch_order(5, 2, 64), first)
    assert sorted(first.tolist()) == list(range(64))  # a permutation
    assert not torch.equal(epoch_order(5, 3, 64), first)
    assert not torch.equal(epoch_order(6, 2, 64), first)


def test_epoch_order_does_not_advance_the_global_generator():
    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    epoch_order(1, 1, 64)
    assert torch.equal(torch.rand(3), expected)


def test_batch_sample_ids_equals_slicing_the_replayed_epoch_order():
    n, batch = 70, 8
    for epoch in range(3):
        order = epoch_order(11, epoch, n).tolist()
        for b in range(n // batch):
            assert batch_sample_ids(11, epoch, b, n, batch) == order[b * batch : (b + 1) * batch]


def test_training_uses_exactly_the_batches_that_fast_forward_computes(tiny_run):
    run = tiny_run(4)
    records = run.train(20)  # 8 batches per epoch: crosses two epoch boundaries
    per_epoch = len(run.data) // 8
    for record in records:
        epoch, b = divmod(record.step - 1, per_epoch)
        assert list(record.sample_ids) == batch_sample_ids(4, epoch, b, len(run.data), 8)
    assert (run.state.epoch, run.state.batch_in_epoch) == (2, 4)


def test_two_seeded_runs_give_identical_losses(tiny_run):
    a = tiny_run(2)
    a.train(15)
    b = tiny_run(2)
    b.train(15)
    assert a.state.losses == b.state.losses
    c = tiny_run(3)
    c.train(15)
    assert c.state.losses != a.state.losses


def test_loss_falls_over_30_steps(tiny_run):
    run = tiny_run(0)
    run.train(30)
    losses = run.state.losses
    assert len(losses) == 30
    assert losses[0] > losses[-1]
    assert sum(losses[-5:]) < sum(losses[:5])


def test_after_step_can_stop_training_early(tiny_run):
    run = tiny_run(0)
    records = run.train(30, after_step=lambda state, record: state.step == 4)
    assert [r.step for r in records] == [1, 2, 3, 4]
    assert run.state.step == 4


def test_train_does_nothing_when_until_step_is_already_reached(tiny_run):
    run = tiny_run(0)
    run.state = TrainState(step=10)
    assert run.train(10) == []


@pytest.mark.parametrize("batch_size", [0, 65])
def test_a_batch_size_that_yields_no_batch_is_refused(tiny_run, batch_size):
    run = tiny_run(0)
    with pytest.raises(ValueError, match="batch_size"):
        train(
            run.model,
            run.optimizer,
            run.scheduler,
            run.state,
            run.data,
            until_step=3,
            seed=0,
            batch_size=batch_size,
        )
    assert run.state.step == 0


def test_the_dataset_is_a_pure_function_of_its_seed():
    a, b, c = SyntheticRegression(seed=1), SyntheticRegression(seed=1), SyntheticRegression(seed=2)
    assert torch.equal(a.x, b.x) and torch.equal(a.y, b.y)
    assert a.fingerprint() == b.fingerprint() != c.fingerprint()
    b.x[0, 0] += 1e-6
    assert b.fingerprint() != a.fingerprint()


# The course's data (seed 11: notebooks 05 and 10, the demo). Its fingerprint is part of every
# resume contract the course writes, so it must be one value on every CPU.
COURSE_DATA_FINGERPRINT = "7f03460f8dd3aa9c8026012daea8ef92b92d67049fbe7171d5b15b03758f0163"


def test_the_course_datas_fingerprint_is_the_one_constant():
    assert SyntheticRegression(seed=11).fingerprint() == COURSE_DATA_FINGERPRINT


def test_the_course_data_is_exact_integers_over_powers_of_two():
    data = SyntheticRegression(seed=11)
    # Every value is an integer divided by a power of two: nothing was rounded on the way.
    assert torch.equal(data.x * 32, (data.x * 32).round())
    assert torch.equal(data.y * 16384, (data.y * 16384).round())
    assert (data.y * 16384).abs().max() < 2**24


@pytest.mark.parametrize("capability", ["default", "avx2"])
def test_the_course_datas_fingerprint_does_not_change_with_the_cpus_kernels(capability):
    # ATEN_CPU_CAPABILITY picks torch's CPU kernels as another CPU would; on this kind of machine
    # it changes the bits of randn, of a float matmul and of tanh, but not of integer arithmetic.
    env = {**os.environ, "ATEN_CPU_CAPABILITY": capability}
    code = "import ckpt_lesson.course.training as t; print(t.SyntheticRegression(seed=11).fingerprint())"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == COURSE_DATA_FINGERPRINT


def test_train_draws_each_epochs_permutation_once_and_the_same_batches_as_next_batch_ids(monkeypatch):
    import ckpt_lesson.course.training as training

    calls: list[int] = []
    real = training.epoch_order
    monkeypatch.setattr(
        training, "epoch_order", lambda seed, epoch, n: calls.append(epoch) or real(seed, epoch, n)
    )
    data = SyntheticRegression(n=64, seed=3)
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    records = train(model, opt, None, TrainState(), data, until_step=13, seed=5, batch_size=16)
    assert calls == [0, 1, 2, 3]  # 13 steps of 4 batches per epoch: four epochs, one permutation each
    replay, expected = TrainState(), []
    for _ in range(13):
        expected.append(tuple(training.next_batch_ids(replay, data, seed=5, batch_size=16)))
        replay.batch_in_epoch += 1
    assert [r.sample_ids for r in records] == expected
