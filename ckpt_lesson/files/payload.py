"""What may go into a checkpoint, and whether a checkpoint fits the live objects.

Two checks guard the two ends of a checkpoint's life.

**Before anything is written** (:func:`validate_payload`): a save that cannot be
loaded back is worse than no save, because it is counted as good, retention
then deletes the older save that *was* loadable, and the run can no longer
resume. ``torch.save`` pickles anything, but the weights-only loader accepts
only tensors and plain values. So the payload is walked once and every value
must be one the weights-only loader accepts; a NumPy array, a ``Path``, a
custom object from ``get_extra_state()`` or a tensor on the ``meta`` device
(no data at all) is refused, naming its key and type, before a byte is written.

**Before anything is applied** (:func:`check_model_state`,
:func:`check_optimizer_fit`): ``optimizer.load_state_dict`` matches saved state
to parameters by *position*. An optimizer built over the same parameters in
another order loads without a word and every moment lands on the wrong
parameter; an AdamW checkpoint loads into SGD and fails only at the first
``step()``. So each save records, inside every parameter group, the optimizer
class and the model's name for each parameter, and a load compares them (and
the group keys, and each per-parameter state tensor's shape against its parameter) first.

Which state is per-parameter is read from the optimizer's own ``state_dict`` at
save time, never assumed: AdamW's moments have their parameter's shape, but
LBFGS keeps whole-model flat tensors (``d``, ``prev_flat_grad``, lists of them
in ``old_dirs``) under its first parameter's entry. The binding records, per
group, the state keys whose tensors had their parameter's shape; a load holds
exactly those to the live parameter's shape, so a save is never refused by the
check its own state passed.
"""

from __future__ import annotations

import collections
from typing import Any

import torch

from ckpt_lesson.errors import CheckpointError, StateMismatchError
from ckpt_lesson.files.modules import WRAPPER_PREFIXES, model_state, param_names

__all__ = [
    "BINDING_KEY",
    "PARAM_SHAPED_KEY",
    "check_model_state",
    "check_optimizer_fit",
    "optimizer_state_with_bindings",
    "strip_bindings",
    "validate_payload",
]

#: Key added to each saved parameter group: ``{"optimizer": class name, "param_names": [...],
#: "param_shaped": [state keys that hold tensors of their parameter's shape]}``.
BINDING_KEY = "ckpt_lesson_binding"
#: Inside the binding: the state keys checked against the live parameter's shape on load.
PARAM_SHAPED_KEY = "param_shaped"

_SCALARS = (type(None), bool, int, float, complex, str, bytes, bytearray, torch.dtype, torch.device)
_MAX_DEPTH = 64


def validate_payload(payload: Any, *, where: str = "payload") -> None:
    """Refuse any value a weights-only load would refuse, and meta tensors.

    Args:
        payload: The object about to be saved.
        where: Prefix of the key path in messages.

    Raises:
        CheckpointError: Names the first offending key path and its type.

    Example:
        >>> validate_payload({"w": torch.zeros(2), "note": "ok"})
        >>> validate_payload({"w": object()})
        Traceback (most recent call last):
        ckpt_lesson.errors.CheckpointError: payload['w'] is a builtins.object, ...
    """
    _walk(payload, where, 0, set())


def _walk(value: Any, path: str, depth: int, active: set[int]) -> None:
    if depth > _MAX_DEPTH:
        raise CheckpointError(f"{path}: nested more than {_MAX_DEPTH} levels deep; flatten it before saving.")
    if isinstance(value, torch.Tensor):
        if type(value).__module__.split(".")[0] != "torch":
            raise _refuse(path, value, "a tensor subclass the weights-only loader does not know")
        if value.is_meta:
            raise CheckpointError(
                f"{path}: is a tensor on the meta device (it has a shape but no data); nothing could be "
                "restored from it. Materialize the model (to_empty() and initialize, or load weights) "
                "before saving. Nothing was written."
            )
        return
    if type(value) in _SCALARS:
        return
    if type(value) in (dict, collections.OrderedDict, collections.Counter):
        _enter(value, path, active)
        for key, item in value.items():
            _walk(key, f"{path} key {key!r}", depth + 1, active)
            _walk(item, f"{path}[{key!r}]", depth + 1, active)
        active.discard(id(value))
        return
    if type(value) in (list, tuple, set, torch.Size):
        _enter(value, path, active)
        for i, item in enumerate(value):
            _walk(item, f"{path}[{i}]", depth + 1, active)
        active.discard(id(value))
        return
    raise _refuse(path, value, "a type the weights-only loader refuses")


def _enter(value: Any, path: str, active: set[int]) -> None:
    if id(value) in active:
        raise CheckpointError(f"{path}: contains itself; a checkpoint must be a tree. Nothing was written.")
    active.add(id(value))


def _refuse(path: str, value: Any, why: str) -> CheckpointError:
    kind = f"{type(value).__module__}.{type(value).__qualname__}"
    return CheckpointError(
        f"{path} is a {kind}, {why}; the save could never be loaded back, so nothing was written. "
        "Convert it to a tensor or plain Python values (numbers, str, list, dict), e.g. "
        "torch.as_tensor(x), x.tolist() or str(path)."
    )


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
            PARAM_SHAPED_KEY: sorted(_param_shaped_keys(state, pairs), key=str),
        }
        out_groups.append({**saved, BINDING_KEY: binding})
    return {**sd, "param_groups": out_groups}


def strip_bindings(opt_sd: dict[str, Any]) -> dict[str, Any]:
    """The optimizer state_dict without our binding records (what ``load_state_dict`` should see)."""
    groups = [{k: v for k, v in g.items() if k != BINDING_KEY} for g in opt_sd["param_groups"]]
    return {**opt_sd, "param_groups": groups}


def check_optimizer_fit(opt_sd: dict[str, Any], optimizer: Any, model: Any, *, source: str) -> None:
    """Refuse a saved optimizer state that does not fit the live optimizer, naming the first difference.

    Compares, group by group: the optimizer class and parameter names recorded
    at save time (when present), the group's hyper-parameter keys, and the
    shape of every per-parameter state tensor against its live parameter. Which
    keys are per-parameter is what the save recorded from the optimizer's own
    state (``PARAM_SHAPED_KEY``); flat whole-model state such as LBFGS's ``d``
    is not compared with any one parameter.

    Raises:
        StateMismatchError: The first difference found.

    Example:
        >>> check_optimizer_fit(payload["optimizer"], opt, model, source="last.pt")  # doctest: +SKIP
    """
    live_names = param_names(model)
    for i, (saved, live) in enumerate(zip(opt_sd["param_groups"], optimizer.param_groups, strict=True)):
        binding = saved.get(BINDING_KEY)
        if isinstance(binding, dict):
            cls = binding.get("optimizer")
            if cls != type(optimizer).__name__:
                raise StateMismatchError(
                    f"{source}: the checkpoint holds {cls} state but the live optimizer is "
                    f"{type(optimizer).__name__}; build the same optimizer class as the saved run."
                )
            names = binding.get("param_names")
            now = [live_names.get(id(p)) for p in live["params"]]
            if isinstance(names, list) and len(names) == len(now):
                names = [_unprefixed(n) for n in names]  # saves made before names were canonical
                for pos, (was, is_) in enumerate(zip(names, now, strict=True)):
                    if was is not None and is_ is not None and was != is_:
                        raise StateMismatchError(
                            f"{source}: optimizer group {i} position {pos} held {was!r} when saved but "
                            f"holds {is_!r} now; the parameters were passed in another order. Build the "
                            "optimizer over model.parameters() in the same order as the saved run."
                        )
        saved_keys = sorted(set(saved) - {"params", BINDING_KEY, "param_names"})
        # A plain optimizer.load_state_dict() of one of our files copies the binding into the live
        # groups too; it is ours, not a setting, on either side.
        live_keys = sorted(set(live) - {"params", BINDING_KEY, "param_names"})
        if saved_keys != live_keys:
            extra = sorted(set(saved_keys) - set(live_keys))[:3]
            lacking = sorted(set(live_keys) - set(saved_keys))[:3]
            raise StateMismatchError(
                f"{source}: optimizer group {i} has settings {extra} the live one lacks and lacks "
                f"{lacking}; it was saved by another optimizer class. Build the same optimizer as the "
                "saved run."
            )
        pairs = list(zip(saved["params"], live["params"], strict=True))
        recorded = binding.get(PARAM_SHAPED_KEY) if isinstance(binding, dict) else None
        if isinstance(recorded, list):
            shaped = {key for key in recorded if isinstance(key, (str, int))}
        else:  # a save from before the record: a key some entry holds in its parameter's shape
            shaped = _param_shaped_keys(opt_sd["state"], pairs, any_entry=True)
        for pid, param in pairs:
            _check_entry_shapes(opt_sd["state"].get(pid), shaped, param, live_names, pid, source)


def _param_shaped_keys(state: dict[Any, Any], pairs: Any, *, any_entry: bool = False) -> set[Any]:
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


def _check_entry_shapes(
    entry: Any, shaped: set[Any], param: Any, names: dict[int, str], pid: Any, source: str
) -> None:
    if not isinstance(entry, dict):
        return
    for key in sorted(shaped & set(entry), key=str):
        value = entry[key]
        shape = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
        if shape != tuple(param.shape):
            name = names.get(id(param), f"parameter {pid}")
            raise StateMismatchError(
                f"{source}: optimizer state {key!r} of {name} has shape {shape} but the parameter has "
                f"{tuple(param.shape)} (the save recorded {key!r} as a per-parameter tensor); build the "
                "same model and optimizer as the saved run."
            )


def _unprefixed(name: Any) -> Any:
    for prefix in WRAPPER_PREFIXES:
        if isinstance(name, str) and name.startswith(prefix):
            return name[len(prefix) :]
    return name


def check_model_state(
    saved: Any, model: torch.nn.Module, *, source: str = "<payload>", allow_dtype_cast: bool = False
) -> None:
    """Raise :class:`StateMismatchError` unless ``saved`` has exactly the model's keys, shapes and dtypes.

    Args:
        saved: The checkpoint's model state_dict.
        model: The live model.
        source: Names the checkpoint in messages.
        allow_dtype_cast: Accept a saved dtype that differs from the model's
            (``load_state_dict`` then casts). Casting float64 weights into a
            float16 model loses precision, so it must be asked for.

    Example:
        >>> check_model_state(payload["model"], model, source="last.pt")  # doctest: +SKIP
    """
    if not isinstance(saved, dict):
        raise StateMismatchError(f"{source}: 'model' must be a state_dict, got {type(saved).__name__}.")
    live = model_state(model)  # canonical keys: compiled and DDP-wrapped models compare as plain ones
    missing = sorted(set(live) - set(saved))
    unexpected = sorted(set(saved) - set(live))
    if missing or unexpected:
        raise StateMismatchError(
            f"{source}: model keys differ: missing {missing[:5]}, unexpected {unexpected[:5]}; "
            "build the same architecture as the saved run (a torch.compile, DDP or DataParallel "
            "wrapper is not a difference: keys are compared without their prefixes)."
        )
    for key, tensor in live.items():
        got = saved[key]
        if not isinstance(tensor, torch.Tensor):  # extra state: load_state_dict hands it to the module
            continue
        if not isinstance(got, torch.Tensor) or tuple(got.shape) != tuple(tensor.shape):
            shape = tuple(got.shape) if isinstance(got, torch.Tensor) else type(got).__name__
            raise StateMismatchError(
                f"{source}: model key {key!r} has shape {shape} in the checkpoint but "
                f"{tuple(tensor.shape)} in the model; build the same architecture as the saved run."
            )
        if got.dtype != tensor.dtype and not allow_dtype_cast:
            raise StateMismatchError(
                f"{source}: model key {key!r} is {got.dtype} in the checkpoint but {tensor.dtype} in the "
                "model; loading would cast it silently. Build the model in the saved dtype, or pass "
                "allow_dtype_cast=True if the cast is what you want."
            )
