"""The teaching loop with gradient accumulation, savable in the middle of a window.

The library pieces (what a mid-window save must hold, and how a load checks
it) live in :mod:`ckpt_lesson.runs.accumulation`; this module is the toy loop
that produces such saves for the course.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ckpt_lesson.course.training import EpochOrderCache, SyntheticRegression, batch_loss
from ckpt_lesson.errors import StateMismatchError
from ckpt_lesson.runs.accumulation import AccumulationState

__all__ = ["MicroStepRecord", "train_accumulating"]


@dataclass(frozen=True)
class MicroStepRecord:
    """One micro-batch: the optimizer step it belongs to (1-based), its index, loss, ids.

    ``boundary`` is True for the micro-batch that completed an optimizer step.
    """

    step: int
    micro_step: int
    loss: float
    sample_ids: tuple[int, ...]
    boundary: bool


def train_accumulating(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    state: AccumulationState,
    data: SyntheticRegression,
    *,
    until_step: int,
    seed: int,
    accum_steps: int,
    micro_batch_size: int,
    after_micro_step: Callable[[AccumulationState, MicroStepRecord], bool | None] | None = None,
    save: Callable[[AccumulationState], Any] | None = None,
    every_steps: int | None = None,
) -> list[MicroStepRecord]:
    """Train with gradient accumulation from ``state`` up to optimizer step ``until_step``.

    Args:
        model, optimizer, scheduler, data, seed: As for :func:`ckpt_lesson.course.training.train`.
        state: Counters to continue from (``micro_step > 0`` means gradients
            were restored into ``param.grad`` by :func:`load_accumulating`).
        until_step: Stop once ``state.step`` reaches this.
        accum_steps: Micro-batches per optimizer step.
        micro_batch_size: Samples per micro-batch (a last partial one is dropped).
        after_micro_step: Called after every micro-batch; return ``True`` to
            stop there (e.g. to save mid-accumulation and exit).
        save: Called at optimizer-step boundaries when ``step % every_steps == 0``.
        every_steps: Save cadence in optimizer steps (needs ``save``).

    Returns:
        The records of the micro-batches run in this call.

    Example:
        >>> recs = train_accumulating(model, opt, sched, AccumulationState(), data,  # doctest: +SKIP
        ...                           until_step=10, seed=0, accum_steps=4, micro_batch_size=8)
    """
    if accum_steps < 1 or micro_batch_size < 1:
        raise StateMismatchError(
            f"accum_steps and micro_batch_size must be >= 1, got {accum_steps}, {micro_batch_size}."
        )
    if not 0 <= state.micro_step < accum_steps:
        raise StateMismatchError(f"state.micro_step={state.micro_step} is outside 0..{accum_steps - 1}.")
    if micro_batch_size > len(data):
        raise StateMismatchError(
            f"micro_batch_size={micro_batch_size} is larger than the data ({len(data)} samples); "
            "an epoch would hold no batch."
        )
    if state.micro_step == 0:
        optimizer.zero_grad(set_to_none=True)
    records: list[MicroStepRecord] = []
    orders = EpochOrderCache(seed, len(data))  # one permutation per epoch, not one per micro-batch
    while state.step < until_step:
        ids = orders.next_ids(state, micro_batch_size)
        loss = batch_loss(model, data, ids)
        # Dividing by accum_steps makes the summed gradient the mean over the
        # effective batch, as one big batch of accum_steps * micro_batch_size.
        (loss / accum_steps).backward()
        state.batch_in_epoch += 1
        state.micro_step += 1
        state.micro_losses.append(float(loss.detach()))
        boundary = state.micro_step == accum_steps
        if boundary:
            optimizer.step()
            if scheduler is not None:
                scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            state.step += 1
            state.losses.append(sum(state.micro_losses) / len(state.micro_losses))
            state.micro_step = 0
            state.micro_losses = []
        micro_index = accum_steps if boundary else state.micro_step
        owner = state.step if boundary else state.step + 1
        record = MicroStepRecord(owner, micro_index, float(loss.detach()), tuple(ids), boundary)
        records.append(record)
        if boundary and save is not None and every_steps and state.step % every_steps == 0:
            save(state)
        if after_micro_step is not None and after_micro_step(state, record):
            break
    return records
