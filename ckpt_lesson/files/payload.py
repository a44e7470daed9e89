"""What goes into a checkpoint: the one payload builder, and what it refuses before anything is written.

A real training script holds more than a model, an optimizer and a scheduler:
a ``GradScaler``, a second model and optimizer (a GAN, EMA weights), a
``StatefulDataLoader``, an LSTM's hidden state, a best metric. So a save takes
the loop's state as ``{name: part}``, and each part is one of two kinds:

* an **object** with ``state_dict()`` and ``load_state_dict()`` (modules,
  optimizers, schedulers, scalers, stateful loaders, the user's own classes):
  its state is saved, and a restore loads it back *in place*;
* a **plain value** (tensors, numbers, strings, lists, dicts): saved as it is,
  and handed back by the restore in :attr:`~ckpt_lesson.files.apply.Restored.values`, because Python
  cannot assign to the caller's variable.

The payload (schema :data:`PARTS_SCHEMA`) records the step, each part's kind,
the objects' state dicts, the values and the RNG. The positional call form
(``model, optimizer, scheduler, TrainState``) is a thin adapter over the same
builder (:func:`build_payload`): parts ``model``, ``optimizer``, ``scheduler``
and values ``train_state``, ``extras``, laid out on disk as the lesson's
``ckpt.v2`` file has always been (and read back as parts by
:func:`~ckpt_lesson.files.apply.parts_view`).

**Before anything is written** (:func:`~ckpt_lesson.files.schema.validate_payload`): a save that cannot be
loaded back is worse than no save, because it is counted as good, retention
then deletes the older save that *was* loadable, and the run can no longer
resume. ``torch.save`` pickles anything, but the weights-only loader accepts
only tensors and plain values. So every part is walked once and every value
must be one the weights-only loader accepts; a NumPy array, a ``Path``, a
custom object from ``get_extra_state()`` or a tensor on the ``meta`` device
(no data at all) is refused, naming its key and type, before a byte is written.

Each saved optimizer's groups also record what a restore checks (:mod:`ckpt_lesson.files.fit` says
why), including which state keys are per-parameter: read from the optimizer's own ``state_dict`` at
save time, never assumed (LBFGS keeps whole-model flat tensors under its first parameter's entry),
so a save is never refused by the check its own state passed.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

import torch

from ckpt_lesson.errors import CheckpointError
from ckpt_lesson.files.rng import capture_rng_state, validate_rng_state
from ckpt_lesson.files.schema import CURRENT_SCHEMA, current_env, validate_payload
from ckpt_lesson.files.train_state import (
    FILE_STATE_API,
    TrainState,
    check_positional_objects,
    model_state,
    param_names,
)

__all__ = [
    "BINDING_KEY",
    "OBJECT",
    "PARAM_SHAPED_KEY",
    "PARTS_SCHEMA",
    "VALUE",
    "build_payload",
    "build_state_payload",
    "optimizer_state_with_bindings",
    "validate_payload",
]

#: Schema of a payload saved through the state API.
PARTS_SCHEMA = "ckpt.parts.v1"

OBJECT, VALUE = "object", "value"
#: What a value part may be, besides dicts, lists, tuples and sets (validate_payload walks those).
_SCALARS = (type(None), bool, int, float, complex, str, bytes, torch.Tensor, torch.dtype, torch.device)

#: Key added to each saved parameter group: ``{"optimizer": class name, "param_names": [...],
#: "param_shaped": [state keys that hold tensors of their parameter's shape]}``.
BINDING_KEY = "ckpt_lesson_binding"
#: Inside the binding: the state keys checked against the live parameter's shape on load.
PARAM_SHAPED_KEY = "param_shaped"


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
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise CheckpointError(
            f"step must be an int >= 0, got {step!r}; pass the global step as the first argument."
        )
    check_names(state, f"save of step {step}")
    return _build(step, state, module_parts(state), rng=rng, data=data)


def _build(
    step: int, state: Mapping[str, Any], names: Any, *, rng: Any, data: Any, restorable: bool = True
) -> dict[str, Any]:
    """The one builder: every part's state, each checked by name, plus the RNG and metadata blocks.

    ``names`` names the optimizers' parameters: the module parts (``part.param``) for the
    state API, the bare model for the positional form (its ``ckpt.v2`` bindings say ``param``).
    ``restorable=False`` (the positional form, whose objects :func:`check_positional_objects`
    has named already) accepts an asynchronous snapshot's stand-ins, which have only ``state_dict()``.
    """
    kinds: dict[str, str] = {}
    objects: dict[str, Any] = {}
    values: dict[str, Any] = {}
    for name, part in state.items():
        where = f"state[{name!r}]"
        if callable(getattr(part, "state_dict", None)):
            if restorable and not callable(getattr(part, "load_state_dict", None)):
                raise CheckpointError(
                    f"{where} ({type(part).__name__}) has state_dict() but no load_state_dict(), so a "
                    "restore could not put it back; add load_state_dict(), or save part.state_dict() as "
                    "a plain value."
                )
            kinds[name] = OBJECT
            if isinstance(part, torch.nn.Module):
                objects[name] = model_state(part)  # canonical keys: compiled/DDP saves match plain models
            elif isinstance(part, torch.optim.Optimizer):
                objects[name] = optimizer_state_with_bindings(names, part)
            else:
                objects[name] = part.state_dict()
            validate_payload(objects[name], where=f"{where}.state_dict()")
            continue
        kinds[name] = VALUE
        if not isinstance(part, (*_SCALARS, dict, list, tuple, set)):
            raise CheckpointError(
                f"{where} is a {type(part).__module__}.{type(part).__qualname__}: neither an object with "
                "state_dict()/load_state_dict() nor a plain value (tensor, number, str, list, dict). Give "
                "it those two methods, or convert it (torch.as_tensor(x), x.tolist()). Nothing was written."
            )
        validate_payload(part, where=where)
        values[name] = part
    data_block = {"recorded": data is not None, **(data or {"fingerprint": None, "order_seed": None})}
    validate_payload(data_block, where="data")  # the run's dataset description goes into the file too
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
        # loading a module copies them (see checkpoint.read_state_payload).
        "modules": sorted(k for k, v in state.items() if isinstance(v, torch.nn.Module)),
        "objects": objects,
        "values": values,
        "rng": rng_state,
        "wall_saved_at": time.time(),
        "env": current_env(),
        "data": data_block,
    }


def build_payload(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    state: TrainState,
    *,
    extras: dict[str, Any] | None = None,
    data: dict[str, Any] | None = None,
    rng: dict[str, Any] | None = None,
    where: str = "",
) -> dict[str, Any]:
    """The positional form's payload: :func:`build_state_payload`'s parts in the lesson's ``ckpt.v2`` layout.

    ``scheduler`` is ``None`` for a run without one; loading then requires ``None`` too, so the two
    can never be silently mixed.

    ``rng`` is a state from :func:`~ckpt_lesson.files.rng.capture_rng_state` taken
    earlier; ``None`` captures the generators now. An asynchronous save passes
    the state captured with its snapshot: by the time a background thread
    writes, training has drawn more random numbers, and saving *those* would
    resume with the wrong dropout masks and jitter.

    ``where`` prefixes an error about the objects (the target's name and ": ").

    Example:
        >>> p = build_payload(torch.nn.Linear(2, 2), torch.optim.SGD([torch.nn.Parameter(torch.ones(1))]),
        ...                   None, TrainState(step=3))
        >>> p["schema"], p["state"]["step"], p["scheduler"]
        ('ckpt.v2', 3, None)
    """
    check_positional_objects(
        model, optimizer, scheduler, loading=False, state_api=FILE_STATE_API, where=where
    )
    if not isinstance(state, TrainState):
        raise CheckpointError(f"state must be a TrainState, got {type(state).__name__}.")
    # The state must survive its own parser: a step of -1, 5.0, True, np.int64(5) or a tensor would
    # be written fine and refused by every load, so it is refused here, before anything is written.
    try:
        TrainState.from_dict(state.to_dict(), source="state to save")
    except (TypeError, ValueError) as exc:
        raise CheckpointError(f"{exc} Nothing was written.") from None
    parts: dict[str, Any] = {"model": model, "optimizer": optimizer}
    parts.update({"scheduler": scheduler} if scheduler is not None else {})
    parts.update({"train_state": state.to_dict(), "extras": extras})
    p = _build(state.step, parts, model, rng=rng, data=data, restorable=False)
    objects, values = p["objects"], p["values"]
    return {
        "schema": CURRENT_SCHEMA,
        "model": objects["model"],
        "optimizer": objects["optimizer"],
        "scheduler": objects.get("scheduler"),
        "state": values["train_state"],
        "rng": p["rng"],
        "wall_saved_at": p["wall_saved_at"],
        "extras": values["extras"],
        "env": p["env"],
        "data": p["data"],
    }


def optimizer_state_with_bindings(model: Any, optimizer: Any) -> dict[str, Any]:
    """``optimizer.state_dict()`` with each group's class and parameter names recorded.

    A stand-in without ``param_groups`` (an asynchronous snapshot, which
    recorded them when it was taken) is returned as it is.

    Example:
        >>> sd = optimizer_state_with_bindings(model, opt)  # doctest: +SKIP
        >>> sd["param_groups"][0][BINDING_KEY]["optimizer"]  # doctest: +SKIP
        'AdamW'
    """
    sd = optimizer.state_dict()
    groups = getattr(optimizer, "param_groups", None)
    if groups is None or not isinstance(sd.get("param_groups"), list):
        return sd
    names = param_names(model)  # canonical: a compiled or DDP-wrapped model records the plain names
    state = sd.get("state") if isinstance(sd.get("state"), dict) else {}
    out_groups = []
    for saved, live in zip(sd["param_groups"], groups, strict=False):
        pairs = zip(saved.get("params") or [], live["params"], strict=False)
        binding = {
            "optimizer": type(optimizer).__name__,
            "param_names": [names.get(id(p)) for p in live["params"]],
            PARAM_SHAPED_KEY: sorted(param_shaped_keys(state, pairs), key=str),
        }
        out_groups.append({**saved, BINDING_KEY: binding})
    return {**sd, "param_groups": out_groups}


def param_shaped_keys(state: dict[Any, Any], pairs: Any, *, any_entry: bool = False) -> set[Any]:
    """The state keys whose tensors have their parameter's shape (in every entry, or ``any_entry``)."""
    matched: set[Any] = set()
    other: set[Any] = set()
    for pid, param in pairs:
        entry = state.get(pid)
        if not isinstance(entry, dict):
            continue
        for key, value in entry.items():
            # Scalars (step counts, LBFGS's H_diag) have no shape to compare.
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                (matched if tuple(value.shape) == tuple(param.shape) else other).add(key)
    return matched if any_entry else matched - other
