"""The state API on many ranks: a mapping of named parts mapped onto the DCP save.

DCP reshards what it knows how to reshard: the model's and the optimizer's
tensors (``get_state_dict`` gives them as DTensors under FSDP2). Everything
else in a loop's state (a scheduler, a ``GradScaler``, a stateful data
loader, an LSTM's hidden state, a best metric) is small and belongs to one
rank: a data loader's position differs from rank to rank. So the mapping is
split in two:

* the one ``nn.Module`` part and the one optimizer part go to DCP as today
  (resharded on load, wrappers such as DDP and ``torch.compile`` handled by
  ``get_state_dict``);
* every other object's ``state_dict()`` and every plain value go into this
  rank's own blob, next to its RNG state, and come back on the same rank.

One model and one optimizer per save: put several modules in one
``nn.ModuleDict`` (or save each optimizer's state as an object part when it
is not sharded).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from ckpt_lesson.errors import CheckpointError, StateMismatchError
from ckpt_lesson.files.apply import Restored
from ckpt_lesson.files.fit import check_part_names
from ckpt_lesson.files.payload import OBJECT, VALUE, is_object, validate_payload
from ckpt_lesson.files.train_state import TrainState
from ckpt_lesson.runs.manager_config import is_state_call, positional_restore_args, positional_save_args

__all__ = [
    "PARTS_KEY",
    "apply_rank_parts",
    "as_restored",
    "check_rank_parts",
    "has_rank_parts",
    "rank_data",
    "restore_args",
    "save_args",
    "split_state",
]

#: Key of the per-rank blob's ``data`` entry that holds the state API's other parts.
PARTS_KEY = "ckpt_lesson_parts"


def split_state(state: Mapping[str, Any]) -> tuple[str, Any, str | None, Any, dict[str, Any]]:
    """``(model name, model, optimizer name, optimizer, rank parts)`` of a state mapping.

    Returns:
        ``rank parts`` is ``{"kinds": {...}, "objects": {name: live object}, "values": {...}}``
        for every part that is not the model or the optimizer.

    Raises:
        CheckpointError: Not a mapping, no module, more than one module or optimizer.
    """
    if not isinstance(state, Mapping) or not all(isinstance(k, str) and k for k in state):
        raise CheckpointError(
            "state must be a mapping of named parts, e.g. {'model': model, 'optimizer': opt}."
        )
    modules = [k for k, v in state.items() if isinstance(v, torch.nn.Module)]
    optims = [k for k, v in state.items() if isinstance(v, torch.optim.Optimizer)]
    if len(modules) != 1 or len(optims) > 1:
        raise CheckpointError(
            f"DistributedCheckpointManager takes exactly one nn.Module part and at most one optimizer part "
            f"(DCP reshards them); got modules {modules} and optimizers {optims}. Put several modules in one "
            "nn.ModuleDict and build one optimizer over it."
        )
    kinds: dict[str, str] = {}
    objects: dict[str, Any] = {}
    values: dict[str, Any] = {}
    for name, part in state.items():
        if name in modules or name in optims:
            continue
        if is_object(part):
            kinds[name], objects[name] = OBJECT, part
        else:
            validate_payload(part, where=f"state[{name!r}]")
            kinds[name], values[name] = VALUE, part
    opt_name = optims[0] if optims else None
    return (
        modules[0],
        state[modules[0]],
        opt_name,
        state[opt_name] if opt_name else None,
        {
            "kinds": {modules[0]: "dcp-model", **({opt_name: "dcp-optim"} if opt_name else {}), **kinds},
            "objects": objects,
            "values": values,
        },
    )


def has_rank_parts(data: Any) -> bool:
    """True when a rank blob's data came from a state-API save."""
    return isinstance(data, dict) and isinstance(data.get(PARTS_KEY), dict)


def rank_data(parts: dict[str, Any]) -> dict[str, Any]:
    """What goes into this rank's blob: every other object's state dict, and the values."""
    return {
        PARTS_KEY: {
            "kinds": parts["kinds"],
            "objects": {n: o.state_dict() for n, o in parts["objects"].items()},
            "values": parts["values"],
        }
    }


def check_rank_parts(data: Any, state: Mapping[str, Any], *, source: str, strict: bool) -> dict[str, Any]:
    """Refuse a save whose parts do not fit ``state``; returns the blob's parts block.

    A restore calls it on the blob it read *before* it applies anything (weights included),
    so a refused restore changes nothing.

    Raises:
        StateMismatchError: The save was not made through the state API, or its parts
            do not fit ``state`` (named by part).

    Example:
        >>> check_rank_parts(data, {"model": m}, source="step-4", strict=True)  # doctest: +SKIP
    """
    block = data.get(PARTS_KEY) if isinstance(data, dict) else None
    if not isinstance(block, dict) or not all(
        isinstance(block.get(k), dict) for k in ("kinds", "objects", "values")
    ):
        raise StateMismatchError(
            f"{source}: saved with the positional save(model, optimizer, scheduler, state); restore it with "
            "restore_latest(model, optimizer, scheduler)."
        )
    kinds = {n: (VALUE if k == VALUE else OBJECT) for n, k in block["kinds"].items()}
    check_part_names(kinds, state, source=source, strict=strict)
    return block


def apply_rank_parts(data: Any, state: Mapping[str, Any], *, source: str, strict: bool) -> dict[str, Any]:
    """Load the other objects from this rank's blob; returns the plain values.

    Raises:
        StateMismatchError: As :func:`check_rank_parts`, or an object refused its saved state.
    """
    block = check_rank_parts(data, state, source=source, strict=strict)
    for name, saved in block["objects"].items():
        if name not in state:
            continue
        try:
            state[name].load_state_dict(saved)
        except Exception as exc:
            raise StateMismatchError(
                f"{source}: part {name!r} ({type(state[name]).__name__}) refused its saved state "
                f"({type(exc).__name__}: {str(exc)[:200]}); build it as in the saving run."
            ) from exc
    return dict(block["values"])


def as_restored(result: Any, values: dict[str, Any], rng: Any) -> Restored:
    """A :class:`~ckpt_lesson.files.apply.Restored` from a ``DistributedRestore``."""
    return Restored(
        step=result.step, values=values, rng=rng, path=result.path, save_id=result.save_id,
        skipped=list(result.skipped),
    )  # fmt: skip


def save_args(args: tuple[Any, ...], data_state: Any, rng: Any) -> tuple[Any, ...]:
    """``(model, optimizer, scheduler, train_state, data_state, rng)`` for either form of ``save``.

    Raises:
        CheckpointError: Arguments of neither form, or options of the other form.
    """
    if not is_state_call(args):
        model, optimizer, scheduler, state = positional_save_args(args)
        return model, optimizer, scheduler, state, data_state, rng
    step, state = args
    if data_state is not None:
        raise CheckpointError("data_state= belongs to the positional form; put it in the state mapping.")
    if rng is False:
        raise CheckpointError("rng=False is not supported on many ranks: each rank's stream is saved.")
    _, model, _, optimizer, parts = split_state(state)
    return (
        model,
        optimizer,
        None,
        TrainState(step=step),
        rank_data(parts),
        None if rng in (None, True) else rng,
    )


def restore_args(args: tuple[Any, ...]) -> tuple[Mapping[str, Any] | None, Any, Any, Any]:
    """``(state mapping or None, model, optimizer, scheduler)`` for either form of ``restore_latest``.

    Raises:
        CheckpointError: Arguments of neither form (see :func:`split_state`).
    """
    if len(args) == 1 and isinstance(args[0], Mapping):
        _, model, _, optimizer, _ = split_state(args[0])
        return args[0], model, optimizer, None
    return (None, *positional_restore_args((*args, None)[:3] if len(args) == 2 else args))
