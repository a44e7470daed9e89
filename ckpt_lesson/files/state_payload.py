"""The state API's payload: whatever a training loop holds, as a mapping of named parts.

A real training script holds more than a model, an optimizer and a scheduler:
a ``GradScaler``, a second model and optimizer (a GAN, EMA weights), a
``StatefulDataLoader``, an LSTM's hidden state, a best metric. So a save takes
the loop's state as ``{name: part}``, and each part is one of two kinds:

* an **object** with ``state_dict()`` and ``load_state_dict()`` (modules,
  optimizers, schedulers, scalers, stateful loaders, the user's own classes):
  its state is saved, and a restore loads it back *in place*;
* a **plain value** (tensors, numbers, strings, lists, dicts): saved as it is,
  and handed back by the restore in :attr:`Restored.values`, because Python
  cannot assign to the caller's variable.

The payload (schema :data:`PARTS_SCHEMA`) records the step, each part's kind,
the objects' state dicts, the values and the RNG. A restore checks everything
it can before it changes anything: the part names on both sides, each part's
kind, every module's keys, shapes and dtypes, every optimizer's class,
parameter names and state shapes, and the RNG block. A ``ckpt.v2`` payload
(the positional ``model, optimizer, scheduler, state`` saves) reads as a parts
payload too (:func:`parts_view`), so a run can move to this API mid-way.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ckpt_lesson.errors import CheckpointError, StateMismatchError
from ckpt_lesson.files.modules import model_state, unwrap
from ckpt_lesson.files.payload import optimizer_state_with_bindings, validate_payload
from ckpt_lesson.files.rng import capture_rng_state, validate_rng_state
from ckpt_lesson.files.schema import SCHEMA_V2, current_env
from ckpt_lesson.files.train_state import TrainState
from ckpt_lesson.short_repr import short_repr

__all__ = ["OBJECT", "PARTS_SCHEMA", "VALUE", "Restored", "build_state_payload", "parts_view"]

#: Schema of a payload saved through the state API.
PARTS_SCHEMA = "ckpt.parts.v1"

OBJECT, VALUE = "object", "value"


@dataclass
class Restored:
    """What a restore hands back to the training loop.

    Attributes:
        step: The saved step; training continues at ``step + 1``.
        values: The plain-value parts, by name (objects were restored in place).
        rng: The saved generator state, already restored; ``None`` if the save had none.
        path: The save that was used (a file, or a ``step-XXXXXXXX`` folder), or
            its URL when it was restored from an object store.
        save_id: The save's id from its manifest (managed saves), else ``None``.
        skipped: Newer saves passed over as damaged: ``{"step", "status", "reason"}`` each.
    """

    __repr__ = short_repr  # one short line: see ckpt_lesson/short_repr.py

    step: int
    values: dict[str, Any] = field(default_factory=dict)
    rng: dict[str, Any] | None = None
    path: Path | str | None = None
    save_id: str | None = None
    skipped: list[dict[str, Any]] = field(default_factory=list)


def is_object(part: Any) -> bool:
    return callable(getattr(part, "state_dict", None)) and callable(getattr(part, "load_state_dict", None))


def check_names(state: Any, what: str) -> None:
    if not isinstance(state, Mapping):
        raise CheckpointError(
            f"{what}: state must be a mapping of named parts, e.g. {{'model': model, 'optimizer': opt}}, "
            f"got {type(state).__name__}."
        )
    bad = [k for k in state if not isinstance(k, str) or not k]
    if bad:
        raise CheckpointError(f"{what}: part names must be non-empty strings, got {bad[:3]!r}.")


def _check_step(step: Any) -> int:
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise CheckpointError(
            f"step must be an int >= 0, got {step!r}; pass the global step as the first argument."
        )
    return step


class Names:
    """Canonical ``part.parameter`` names of every module part, for the optimizer bindings."""

    def __init__(self, modules: dict[str, Any]) -> None:
        self._modules = modules

    def named_parameters(self) -> Any:
        for part, module in self._modules.items():
            for name, param in unwrap(module).named_parameters():
                yield f"{part}.{name}", param


def module_parts(objects: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in objects.items() if isinstance(v, torch.nn.Module)}


def build_state_payload(
    step: int, state: Mapping[str, Any], *, rng: bool | dict[str, Any] | None = True, data: Any = None
) -> dict[str, Any]:
    """Gather every part of ``state`` into one payload; nothing is written here.

    Args:
        step: The global step this save describes.
        state: ``{name: object or plain value}`` (see the module doc).
        rng: ``True`` (or ``None``) captures the generators now; ``False``
            saves none; a dict from :func:`~ckpt_lesson.files.rng.capture_rng_state`
            taken earlier (e.g. before a prefetch drew the next batch) is saved as given.
        data: Dataset description for the ``data`` block (as the positional saves).

    Returns:
        The payload. Object parts hold their state dicts (live tensors, not copies).

    Raises:
        CheckpointError: A bad step or part name, a part with ``state_dict()`` but
            no ``load_state_dict()``, or a value a weights-only load would refuse
            (named before anything is written).

    Example:
        >>> net = torch.nn.Linear(2, 2)
        >>> p = build_state_payload(3, {"model": net, "best": 0.5}, rng=False)
        >>> p["kinds"], p["values"]
        ({'model': 'object', 'best': 'value'}, {'best': 0.5})
    """
    _check_step(step)
    check_names(state, f"save of step {step}")
    kinds: dict[str, str] = {}
    objects: dict[str, Any] = {}
    values: dict[str, Any] = {}
    live = {k: v for k, v in state.items() if is_object(v)}
    names = Names(module_parts(live))
    for name, part in state.items():
        where = f"state[{name!r}]"
        if name in live:
            kinds[name] = OBJECT
            if isinstance(part, torch.nn.Module):
                objects[name] = model_state(part)  # canonical keys: compiled/DDP saves match plain models
            elif isinstance(part, torch.optim.Optimizer):
                objects[name] = optimizer_state_with_bindings(names, part)
            else:
                objects[name] = part.state_dict()
            validate_payload(objects[name], where=f"{where}.state_dict()")
            continue
        if callable(getattr(part, "state_dict", None)):
            raise CheckpointError(
                f"{where} ({type(part).__name__}) has state_dict() but no load_state_dict(), so a restore "
                "could not put it back; add load_state_dict(), or save part.state_dict() as a plain value."
            )
        kinds[name] = VALUE
        if not _plain(part):
            raise CheckpointError(
                f"{where} is a {type(part).__module__}.{type(part).__qualname__}: neither an object with "
                "state_dict()/load_state_dict() nor a plain value (tensor, number, str, list, dict). Give "
                "it those two methods, or convert it (torch.as_tensor(x), x.tolist()). Nothing was written."
            )
        validate_payload(part, where=where)
        values[name] = part
    if rng is True or rng is None:
        rng_state: dict[str, Any] | None = capture_rng_state()
    elif rng is False:
        rng_state = None
    else:
        validate_rng_state(rng)  # a bad snapshot must fail this save, not the resume
        rng_state = rng
    return {
        "schema": PARTS_SCHEMA,
        "step": step,
        "kinds": kinds,
        # Module parts: a mapped restore may leave their tensors in the file mapping, because
        # loading a module copies them (see state_files.read_state_payload).
        "modules": sorted(module_parts(live)),
        "objects": objects,
        "values": values,
        "rng": rng_state,
        "wall_saved_at": time.time(),
        "env": current_env(),
        "data": {"recorded": data is not None, **(data or {"fingerprint": None, "order_seed": None})},
    }


def _plain(value: Any) -> bool:
    scalars = (type(None), bool, int, float, complex, str, bytes, torch.Tensor, torch.dtype, torch.device)
    return isinstance(value, (*scalars, dict, list, tuple, set))


def parts_view(payload: dict[str, Any], *, source: str) -> dict[str, Any]:
    """A ``ckpt.v2`` payload (positional save) seen as a parts payload; a parts payload unchanged.

    The v2 buckets become parts ``model``, ``optimizer``, ``scheduler`` (when
    saved) and the values ``train_state`` (the saved :class:`TrainState` as a
    dict) and ``extras`` (when saved).

    Raises:
        StateMismatchError: Neither layout.
    """
    if isinstance(payload, dict) and payload.get("schema") == PARTS_SCHEMA:
        return payload
    if not isinstance(payload, dict) or payload.get("schema") != SCHEMA_V2:
        raise StateMismatchError(f"{source}: not a {PARTS_SCHEMA} or {SCHEMA_V2} payload.")
    train_state = TrainState.from_dict(payload.get("state"), source=source)
    objects = {"model": payload.get("model"), "optimizer": payload.get("optimizer")}
    if payload.get("scheduler") is not None:
        objects["scheduler"] = payload["scheduler"]
    values: dict[str, Any] = {"train_state": train_state.to_dict()}
    if payload.get("extras") is not None:
        values["extras"] = payload["extras"]
    return {
        **{
            k: v
            for k, v in payload.items()
            if k not in ("model", "optimizer", "scheduler", "state", "extras")
        },
        "schema": SCHEMA_V2,
        "step": train_state.step,
        "kinds": {**dict.fromkeys(objects, OBJECT), **dict.fromkeys(values, VALUE)},
        "objects": objects,
        "values": values,
    }
