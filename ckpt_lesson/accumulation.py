"""Gradient accumulation that survives a checkpoint, at a boundary or in between.

With accumulation, one optimizer step consumes ``accum_steps`` micro-batches:
each micro-batch's gradient is *added* to ``param.grad``, and only after the
last one does the optimizer step. Between two optimizer steps the run holds
state that no ``state_dict()`` contains:

* the partly summed gradients in every ``param.grad``;
* how many micro-batches of this step are done (``micro_step``);
* the micro-batch losses so far (to log the step's mean loss).

Saving at an optimizer-step boundary avoids all of that (the gradients are
zero there), so that is the default: :func:`train_accumulating` calls its
``save`` callback only at boundaries. But a preemption notice does not wait
for a boundary, and a large ``accum_steps`` can make one optimizer step take
minutes. So a save *may* also be taken mid-accumulation: then
:func:`save_accumulating` stores the gradients (as tensors keyed by parameter
name) and the counters in the payload's ``extras["accumulation"]`` block,
tensors and plain values only, so the file still loads with
``weights_only=True``, and :func:`load_accumulating` puts them back.

Batches are micro-batches here: ``TrainState.batch_in_epoch`` counts
micro-batches, and micro-batch ``b`` of an epoch is
``batch_sample_ids(seed, epoch, b, n, micro_batch_size)``, the same O(1)
fast-forward as the plain loop.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any

import torch
from torch import nn

from .checkpoint import REQUIRES_KEY, TrainState, apply_payload, read_checkpoint, save_checkpoint
from .errors import StateMismatchError
from .integrity import FileDigest
from .training import SyntheticRegression, batch_loss, next_batch_ids

__all__ = [
    "ACCUMULATION_SCHEMA",
    "AccumulationState",
    "MicroStepRecord",
    "accumulation_extras",
    "load_accumulating",
    "restore_accumulation",
    "save_accumulating",
    "train_accumulating",
]

#: Version tag of the ``extras["accumulation"]`` block.
ACCUMULATION_SCHEMA = "ckpt.accum.v1"


@dataclass
class AccumulationState(TrainState):
    """:class:`TrainState` plus where we are inside one optimizer step.

    Attributes:
        micro_step: Micro-batches already accumulated into ``param.grad`` for
            the next optimizer step (0 at a boundary).
        micro_losses: Their losses, to report the step's mean loss.
    """

    micro_step: int = 0
    micro_losses: list[float] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        # The payload's ``state`` block stays a plain TrainState; the
        # accumulation counters travel in their own versioned block.
        base = {f.name for f in fields(TrainState)}
        return {k: v for k, v in super().to_dict().items() if k in base}


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
        model, optimizer, scheduler, data, seed: As for :func:`ckpt_lesson.training.train`.
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
    while state.step < until_step:
        ids = next_batch_ids(state, data, seed=seed, batch_size=micro_batch_size)
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


def accumulation_extras(
    model: nn.Module, state: AccumulationState, *, accum_steps: int, micro_batch_size: int
) -> dict[str, Any]:
    """The ``extras["accumulation"]`` block for a save at ``state``.

    At a boundary the block holds no gradients (they are zero by definition);
    mid-accumulation it holds a clone of every non-``None`` ``param.grad``.
    """
    grads: dict[str, torch.Tensor] = {}
    if state.micro_step > 0:
        grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return {
        "schema": ACCUMULATION_SCHEMA,
        "accum_steps": int(accum_steps),
        "micro_batch_size": int(micro_batch_size),
        "micro_step": int(state.micro_step),
        "micro_losses": [float(x) for x in state.micro_losses],
        "grads": grads,
    }


def save_accumulating(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    state: AccumulationState,
    path: str | os.PathLike[str],
    *,
    accum_steps: int,
    micro_batch_size: int,
    data: dict[str, Any] | None = None,
) -> FileDigest:
    """:func:`~ckpt_lesson.checkpoint.save_checkpoint` plus the accumulation block.

    Safe at any micro-step. Returns the file's digest.
    """
    block = accumulation_extras(model, state, accum_steps=accum_steps, micro_batch_size=micro_batch_size)
    extras: dict[str, Any] = {"accumulation": block}
    if state.micro_step > 0:
        # Mid-accumulation the gradients are state: make plain loaders refuse the file.
        extras[REQUIRES_KEY] = ["accumulation"]
    return save_checkpoint(model, optimizer, scheduler, state, path, extras=extras, data=data)


def restore_accumulation(
    payload: dict[str, Any],
    model: nn.Module,
    *,
    accum_steps: int,
    micro_batch_size: int,
    source: str = "<payload>",
) -> tuple[int, list[float]]:
    """Check the payload's accumulation block and put its gradients into ``param.grad``.

    Returns:
        ``(micro_step, micro_losses)`` to continue from.

    Raises:
        StateMismatchError: No block, a different ``accum_steps`` or
            ``micro_batch_size`` (continuing with another split changes the
            run), or gradients that do not fit the model's parameters.
            Nothing is assigned unless every check passes.
    """
    micro_step, micro_losses, grads = _checked_block(
        payload, model, accum_steps=accum_steps, micro_batch_size=micro_batch_size, source=source
    )
    for name, param in model.named_parameters():
        param.grad = grads[name].to(param.device).clone() if name in grads else None
    return micro_step, micro_losses


def _checked_block(
    payload: dict[str, Any], model: nn.Module, *, accum_steps: int, micro_batch_size: int, source: str
) -> tuple[int, list[float], dict[str, torch.Tensor]]:
    extras = payload.get("extras") or {}
    block = extras.get("accumulation") if isinstance(extras, dict) else None
    if not isinstance(block, dict) or block.get("schema") != ACCUMULATION_SCHEMA:
        raise StateMismatchError(
            f"{source}: no {ACCUMULATION_SCHEMA} block in extras; it was not saved by save_accumulating(). "
            "Load it with load_checkpoint() and start accumulation at a boundary."
        )
    for key, live in (("accum_steps", accum_steps), ("micro_batch_size", micro_batch_size)):
        if block.get(key) != live:
            raise StateMismatchError(
                f"{source}: saved with {key}={block.get(key)!r} but resuming with {live!r}; "
                "use the saved value, or the run is no longer the same run."
            )
    micro_step = block.get("micro_step")
    grads = block.get("grads")
    losses = block.get("micro_losses")
    if (
        isinstance(micro_step, bool)
        or not isinstance(micro_step, int)
        or not 0 <= micro_step < accum_steps
        or not isinstance(grads, dict)
        or not isinstance(losses, list)
        or len(losses) != micro_step
    ):
        raise StateMismatchError(f"{source}: malformed accumulation block (micro_step={micro_step!r}).")
    params = dict(model.named_parameters())
    trainable = {n for n, p in params.items() if p.requires_grad}
    if (micro_step > 0 and set(grads) != trainable) or (micro_step == 0 and grads):
        missing = sorted(trainable - set(grads))[:5]
        unexpected = sorted(set(grads) - trainable)[:5]
        raise StateMismatchError(
            f"{source}: saved gradients do not match the model's parameters (missing {missing}, "
            f"unexpected {unexpected}); build the same architecture as the saved run."
        )
    for name, grad in grads.items():
        if not isinstance(grad, torch.Tensor) or grad.shape != params[name].shape:
            raise StateMismatchError(f"{source}: saved gradient {name!r} does not fit the parameter's shape.")
    return micro_step, [float(x) for x in losses], grads


def load_accumulating(
    path: str | os.PathLike[str],
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    *,
    accum_steps: int,
    micro_batch_size: int,
    map_location: str | torch.device = "cpu",
) -> AccumulationState:
    """Load a :func:`save_accumulating` file: all five buckets, then the gradients.

    Raises:
        CheckpointError: Anything :func:`~ckpt_lesson.checkpoint.read_checkpoint`,
            :func:`~ckpt_lesson.checkpoint.apply_payload` or
            :func:`restore_accumulation` refuses; the accumulation block is
            checked first, so a refused file changes nothing.

    Example:
        >>> st = load_accumulating(  # doctest: +SKIP
        ...     "ckpt.pt", model, opt, sched, accum_steps=4, micro_batch_size=8)
    """
    payload = read_checkpoint(path, map_location=map_location)
    source = str(path)
    kw = {"accum_steps": accum_steps, "micro_batch_size": micro_batch_size, "source": source}
    _checked_block(payload, model, **kw)
    base = apply_payload(payload, model, optimizer, scheduler, source=source, handles=("accumulation",))
    micro_step, micro_losses = restore_accumulation(payload, model, **kw)
    return AccumulationState(
        step=base.step,
        epoch=base.epoch,
        batch_in_epoch=base.batch_in_epoch,
        losses=base.losses,
        micro_step=micro_step,
        micro_losses=micro_losses,
    )
