"""Telling the two call forms apart, and refusing bad arguments with a message that names them.

Every manager takes the state API (``save(step, state)``,
``restore_latest(state)``) and the positional form the lesson's code uses
(``save(model, optimizer, scheduler, train_state)``,
``restore_latest(model, optimizer, scheduler)``). The positional form needs a
real model and optimizer: ``None`` there used to fail deep inside with an
``AttributeError``; now it is a :class:`~ckpt_lesson.errors.CheckpointError`
that says which argument and what to do instead, from the one check the file
pair uses too (:func:`~ckpt_lesson.files.train_state.check_positional_objects`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ckpt_lesson.errors import CheckpointError
from ckpt_lesson.files.train_state import MANAGER_STATE_API, TrainState, check_positional_objects

__all__ = ["check_state_mapping", "is_state_call", "positional_restore_args", "positional_save_args"]


def is_state_call(args: tuple[Any, ...]) -> bool:
    """True for ``(step, mapping)``: the state API's save."""
    return (
        len(args) == 2
        and isinstance(args[0], int)
        and not isinstance(args[0], bool)
        and isinstance(args[1], Mapping)
    )


def check_state_mapping(state: Any) -> None:
    """Refuse a state that is not a mapping of named parts."""
    if not isinstance(state, Mapping):
        raise CheckpointError(
            f"state must be a mapping of named parts, e.g. {{'model': model, 'optimizer': opt}}, "
            f"got {type(state).__name__}."
        )


def positional_save_args(args: tuple[Any, ...]) -> tuple[Any, Any, Any, TrainState]:
    """``(model, optimizer, scheduler, train_state)`` checked; raises naming what is wrong."""
    if len(args) == 2 and isinstance(args[0], int) and not isinstance(args[0], bool):
        raise CheckpointError(
            f"save({args[0]!r}, {type(args[1]).__name__}): the state must be a mapping of named parts, "
            "e.g. mgr.save(step, {'model': model, 'optimizer': opt})."
        )
    if len(args) != 4:
        raise CheckpointError(
            f"save() takes (step, state) or (model, optimizer, scheduler, train_state); got {len(args)} "
            "positional argument(s)."
        )
    model, optimizer, scheduler, state = args
    check_positional_objects(model, optimizer, scheduler, loading=False, state_api=MANAGER_STATE_API)
    if not isinstance(state, TrainState):
        raise CheckpointError(f"state must be a TrainState, got {type(state).__name__}.")
    return model, optimizer, scheduler, state


def positional_restore_args(args: tuple[Any, ...]) -> tuple[Any, Any, Any]:
    """``(model, optimizer, scheduler)`` checked; raises naming what is wrong."""
    if len(args) != 3:
        raise CheckpointError(
            f"restore_latest() takes (state) or (model, optimizer, scheduler); got {len(args)} positional "
            "argument(s). With the state API pass one mapping: restore_latest({'model': model, ...})."
        )
    check_positional_objects(*args, loading=True, state_api=MANAGER_STATE_API)
    return args[0], args[1], args[2]
