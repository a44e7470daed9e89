"""The lesson's own training loop: a synthetic classification stream, one step, train to a step.

These are the three helpers the lesson's ``code/main.py`` trains with, kept so
that code written against the lesson runs unchanged. The course itself trains
with :func:`ckpt_lesson.course.training.train`, which differs in two ways worth
knowing (both on purpose):

* **Fast-forward cost.** :func:`train_until` reaches batch ``b`` of an epoch
  by drawing and discarding ``b`` batches from the epoch's generator, so a
  resume late in a long epoch pays for most of that epoch again. ``train``
  computes the batch directly from ``(seed, epoch, batch)``: O(1).
* **The seed.** Here every run sees the same data: each epoch's generator is
  seeded ``12345 + epoch``, whatever seed the run was started with. In
  ``train`` the order depends on the run's seed.

What both share is the point of the lesson: the position in the data is the
``(epoch, batch_in_epoch)`` pair in :class:`TrainState`, so a resumed run
continues with exactly the batch the interrupted one would have trained on next.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from ckpt_lesson.errors import CheckpointError
from ckpt_lesson.files.checkpoint import TrainState

__all__ = ["EPOCH_SEED_BASE", "step_one", "synthetic_loader", "train_until"]

#: Epoch ``e``'s batches come from a generator seeded ``EPOCH_SEED_BASE + e`` (the lesson's choice).
EPOCH_SEED_BASE = 12345


def _positive_ints(**values: Any) -> None:
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise CheckpointError(f"{name} must be an int >= 1, got {value!r}.")


def synthetic_loader(
    batch_size: int, num_batches: int, in_dim: int, out_dim: int, gen: torch.Generator
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Yield ``num_batches`` random ``(x, y)`` batches drawn from ``gen``.

    ``x`` is ``randn(batch_size, in_dim)`` and ``y`` holds class labels in
    ``[0, out_dim)``, both from ``gen`` and in that order, so two generators
    with the same seed give the same batches.

    Args:
        batch_size: Samples per batch.
        num_batches: How many batches to yield.
        in_dim: Features per sample.
        out_dim: Number of classes.
        gen: The generator every batch is drawn from (advanced as batches are drawn).

    Yields:
        ``(x, y)`` with shapes ``(batch_size, in_dim)`` (float) and ``(batch_size,)`` (int64).

    Raises:
        CheckpointError: A size is not an int >= 1 (``num_batches`` may be 0).

    Example:
        >>> g = torch.Generator().manual_seed(0)
        >>> [tuple(x.shape) + tuple(y.shape) for x, y in synthetic_loader(4, 2, 3, 5, g)]
        [(4, 3, 4), (4, 3, 4)]
    """
    _positive_ints(batch_size=batch_size, in_dim=in_dim, out_dim=out_dim)
    if isinstance(num_batches, bool) or not isinstance(num_batches, int) or num_batches < 0:
        raise CheckpointError(f"num_batches must be an int >= 0, got {num_batches!r}.")
    return _batches(batch_size, num_batches, in_dim, out_dim, gen)


def _batches(
    batch_size: int, num_batches: int, in_dim: int, out_dim: int, gen: torch.Generator
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    # A separate generator function, so the argument checks above run at the
    # call, not at the first next() somewhere far away.
    for _ in range(num_batches):
        x = torch.randn(batch_size, in_dim, generator=gen)
        y = torch.randint(0, out_dim, (batch_size,), generator=gen)
        yield x, y


def step_one(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    x: torch.Tensor,
    y: torch.Tensor,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
) -> float:
    """One optimizer step on ``(x, y)``: forward, loss, backward, step, schedule.

    Args:
        model, optimizer: The live training objects.
        scheduler: Stepped once after the optimizer; ``None`` for a run without one.
        x, y: One batch.
        loss_fn: E.g. ``nn.CrossEntropyLoss()``.

    Returns:
        The batch's loss as a Python float.

    Example:
        >>> model = nn.Linear(3, 2)
        >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> isinstance(step_one(model, opt, None, torch.ones(4, 3), torch.zeros(4, dtype=torch.long),
        ...                     nn.CrossEntropyLoss()), float)
        True
    """
    optimizer.zero_grad(set_to_none=True)
    loss = loss_fn(model(x), y)
    loss.backward()
    optimizer.step()
    if scheduler is not None:
        scheduler.step()
    return float(loss.detach())


def train_until(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    state: TrainState,
    *,
    stop_step: int,
    batches_per_epoch: int,
    batch_size: int,
    in_dim: int,
    out_dim: int,
) -> TrainState:
    """Train from ``state`` until ``state.step`` reaches ``stop_step``; ``state`` is updated in place.

    Each epoch's batches come from :func:`synthetic_loader` with a generator
    seeded ``EPOCH_SEED_BASE + state.epoch``. A state in the middle of an
    epoch (after a resume) first redraws and discards the ``batch_in_epoch``
    batches already trained on, then continues with the next one. Every
    step appends its loss to ``state.losses``; a finished epoch moves
    ``state`` to the next epoch's batch 0.

    Args:
        model, optimizer, scheduler, loss_fn: As for :func:`step_one`.
        state: Where to continue from (``TrainState(0, 0, 0)`` for a new run).
        stop_step: Train until this many steps are done in total.
        batches_per_epoch: Batches in one epoch.
        batch_size, in_dim, out_dim: The shape of the data.

    Returns:
        ``state`` itself, for the lesson's ``loaded = train_until(...)`` style.

    Raises:
        CheckpointError: A size is not an int >= 1, ``stop_step`` is negative,
            or ``state.batch_in_epoch`` is past the end of an epoch (a
            checkpoint from a run with more batches per epoch).

    Example:
        >>> model = nn.Linear(3, 2)
        >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> s = train_until(model, opt, None, nn.CrossEntropyLoss(), TrainState(), stop_step=5,
        ...                 batches_per_epoch=2, batch_size=4, in_dim=3, out_dim=2)
        >>> (s.step, s.epoch, s.batch_in_epoch, len(s.losses))
        (5, 2, 1, 5)
    """
    _positive_ints(batches_per_epoch=batches_per_epoch, batch_size=batch_size, in_dim=in_dim, out_dim=out_dim)
    if isinstance(stop_step, bool) or not isinstance(stop_step, int) or stop_step < 0:
        raise CheckpointError(f"stop_step must be an int >= 0, got {stop_step!r}.")
    if state.batch_in_epoch > batches_per_epoch:
        raise CheckpointError(
            f"state is at batch {state.batch_in_epoch} of epoch {state.epoch}, but an epoch has only "
            f"{batches_per_epoch} batches; resume with the batches_per_epoch the run was saved with."
        )
    while state.step < stop_step:
        gen = torch.Generator().manual_seed(EPOCH_SEED_BASE + state.epoch)
        batches = synthetic_loader(batch_size, batches_per_epoch, in_dim, out_dim, gen)
        # The O(b) fast-forward: the generator only gets to batch b by drawing batches 0..b-1.
        for _ in range(state.batch_in_epoch):
            next(batches)
        for x, y in batches:
            state.losses.append(step_one(model, optimizer, scheduler, x, y, loss_fn))
            state.step += 1
            state.batch_in_epoch += 1
            if state.step >= stop_step:
                break
        if state.batch_in_epoch >= batches_per_epoch:
            # A finished epoch rolls over at once, so a save right at an epoch
            # boundary records (next epoch, batch 0), never "batch 5 of 5".
            state.epoch, state.batch_in_epoch = state.epoch + 1, 0
    return state
