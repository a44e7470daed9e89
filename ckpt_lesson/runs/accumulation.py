"""Gradient accumulation that survives a checkpoint, at a boundary or in between.

With accumulation, one optimizer step consumes ``accum_steps`` micro-batches:
each micro-batch's gradient is *added* to ``param.grad``, and only after the
last one does the optimizer step. Between two optimizer steps the run holds
state that no ``state_dict()`` contains:

* the partly summed gradients in every ``param.grad``;
* how many micro-batches of this step are done (``micro_step``);
* the micro-batch losses so far (to log the step's mean loss).

Saving at an optimizer-step boundary avoids all of that (the gradients are
zero there), so that is the default: :func:`~ckpt_lesson.course.accumulating.train_accumulating` calls its
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
from dataclasses import dataclass, field, fields
from typing import Any

import torch
from torch import nn

from ckpt_lesson.errors import StateMismatchError
from ckpt_lesson.files.checkpoint import (
    REQUIRES_KEY,
    TrainState,
    apply_payload,
    read_checkpoint,
    save_checkpoint,
)
from ckpt_lesson.files.integrity import FileDigest
from ckpt_lesson.short_repr import short_repr

__all__ = ["ACCUMULATION_SCHEMA", "AccumulationState", "load_accumulating", "save_accumulating"]

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

    __repr__ = short_repr  # one short line: see ckpt_lesson/short_repr.py

    micro_step: int = 0
    micro_losses: list[float] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        # The payload's ``state`` block stays a plain TrainState; the
        # accumulation counters travel in their own versioned block.
        base = {f.name for f in fields(TrainState)}
        return {k: v for k, v in super().to_dict().items() if k in base}


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
    """:func:`~ckpt_lesson.files.checkpoint.save_checkpoint` plus the accumulation block.

    Safe at any micro-step. Returns the file's digest.
    """
    grads: dict[str, torch.Tensor] = {}
    if state.micro_step > 0:  # at a boundary the gradients are zero by definition: none are stored
        grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    block = {
        "schema": ACCUMULATION_SCHEMA,
        "accum_steps": int(accum_steps),
        "micro_batch_size": int(micro_batch_size),
        "micro_step": int(state.micro_step),
        "micro_losses": [float(x) for x in state.micro_losses],
        "grads": grads,
    }
    extras: dict[str, Any] = {"accumulation": block}
    if state.micro_step > 0:
        # Mid-accumulation the gradients are state: make plain loaders refuse the file.
        extras[REQUIRES_KEY] = ["accumulation"]
    return save_checkpoint(model, optimizer, scheduler, state, path, extras=extras, data=data)


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
        StateMismatchError: No accumulation block, a different ``accum_steps``
            or ``micro_batch_size`` (continuing with another split changes the
            run), or gradients that do not fit the model's parameters.
        CheckpointError: Anything :func:`~ckpt_lesson.files.checkpoint.read_checkpoint`
            or :func:`~ckpt_lesson.files.checkpoint.apply_payload` refuses. The
            accumulation block is checked first, so a refused file changes nothing.

    Example:
        >>> st = load_accumulating(  # doctest: +SKIP
        ...     "ckpt.pt", model, opt, sched, accum_steps=4, micro_batch_size=8)
    """
    payload = read_checkpoint(path, map_location=map_location)
    source = str(path)
    kw = {"accum_steps": accum_steps, "micro_batch_size": micro_batch_size, "source": source}
    micro_step, micro_losses, grads = _checked_block(payload, model, **kw)
    base = apply_payload(payload, model, optimizer, scheduler, source=source, handles=("accumulation",))
    for name, param in model.named_parameters():
        param.grad = grads[name].to(param.device).clone() if name in grads else None
    return AccumulationState(**vars(base), micro_step=micro_step, micro_losses=micro_losses)
