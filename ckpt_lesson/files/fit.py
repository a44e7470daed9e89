"""Whether a saved state fits the live objects: every check a restore makes before it changes anything.

``optimizer.load_state_dict`` matches saved state to parameters by *position*.
An optimizer built over the same parameters in another order loads without a
word and every moment lands on the wrong parameter; an AdamW checkpoint loads
into SGD and fails only at the first ``step()``. So each save records, inside
every parameter group, the optimizer class and the model's name for each
parameter (:func:`~ckpt_lesson.files.payload.optimizer_state_with_bindings`),
and a restore compares them (and the group keys, and each per-parameter state
tensor's shape against its parameter) first: :func:`check_optimizer_payload`.
Modules are held to their saved keys, shapes and dtypes (:func:`check_model_state`),
the part names on both sides to each other (:func:`check_part_names`), and an
optimizer to the module parts its parameters belong to.

The one apply step that runs these checks, then loads, is :mod:`ckpt_lesson.files.apply`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from ckpt_lesson.errors import StateMismatchError
from ckpt_lesson.files.payload import (
    BINDING_KEY,
    OBJECT,
    PARAM_SHAPED_KEY,
    VALUE,
    is_object,
    param_shaped_keys,
)
from ckpt_lesson.files.train_state import WRAPPER_PREFIXES, model_state, param_names, unwrap

__all__ = [
    "check_model_state",
    "check_optimizers_have_their_modules",
    "check_optimizer_payload",
    "check_part_names",
]


def check_part_names(
    saved: Mapping[str, str], given: Mapping[str, Any], *, source: str, strict: bool
) -> None:
    """Refuse parts present on one side only (unless ``strict=False``), and parts of the wrong kind.

    A saved *value* (not an object with ``state_dict()``) need not be named: it comes back in
    ``restored.values`` either way. A name given to restore must be in the save, whether it holds
    an object or a placeholder value.
    """
    missing = [n for n in saved if n not in given and saved[n] == OBJECT]
    extra = [n for n in given if n not in saved]
    if strict and (missing or extra):
        sides = [f"the save holds parts {missing} that the state given to restore lacks"] if missing else []
        sides += [f"the state given to restore has parts {extra} that the save lacks"] if extra else []
        raise StateMismatchError(
            f"{source}: {'; '.join(sides)}. Pass the same part names as the saving run, or restore with "
            "strict=False to ignore parts present on one side only."
        )
    for name in (n for n in saved if n in given):
        part = given[name]
        if saved[name] == OBJECT and not is_object(part):
            kind = "None" if part is None else type(part).__name__
            raise StateMismatchError(
                f"{source}: part {name!r} was saved from an object with state_dict(), but the state "
                f"given to restore holds {kind}; pass the live object (built as in the saving run)."
            )
        if saved[name] == VALUE and is_object(part):
            raise StateMismatchError(
                f"{source}: part {name!r} was saved as a plain value, but the state given to restore holds "
                f"a {type(part).__name__} object; leave it out of that state (its saved value comes back in "
                "restored.values)."
            )


def check_optimizer_payload(opt_sd: Any, optimizer: Any, model: Any, *, source: str) -> dict[str, Any]:
    """Check a saved optimizer state against the live optimizer; returns what ``load_state_dict`` takes.

    Compares, group by group: the group sizes, the optimizer class and
    parameter names recorded at save time (when present), the group's
    hyper-parameter keys, and the shape of every per-parameter state tensor
    against its live parameter. Which keys are per-parameter is what the save
    recorded from the optimizer's own state (``PARAM_SHAPED_KEY``); flat
    whole-model state such as LBFGS's ``d`` is not compared with any one parameter.

    Args:
        opt_sd: The saved optimizer state dict (with our binding records).
        optimizer: The live optimizer.
        model: The model, or the ``{part: module}`` parts: names the live parameters
            (see :func:`~ckpt_lesson.files.train_state.param_names`).
        source: Names the checkpoint in messages.

    Returns:
        ``opt_sd`` without the binding records.

    Raises:
        StateMismatchError: Not an optimizer state dict, or the first difference found.

    Example:
        >>> check_optimizer_payload(payload["optimizer"], opt, model, source="last.pt")  # doctest: +SKIP
    """
    if (
        not isinstance(opt_sd, dict)
        or not isinstance(opt_sd.get("state"), dict)
        or not isinstance(opt_sd.get("param_groups"), (list, tuple))
        or not all(_is_param_group(g) for g in opt_sd["param_groups"])
    ):
        raise StateMismatchError(
            f"{source}: 'optimizer' is not an optimizer state_dict; a resume needs the saved "
            "moments. Use warm_start_from() to start a new experiment from the weights instead."
        )
    saved_sizes = [len(g["params"]) for g in opt_sd["param_groups"]]
    live_sizes = [len(g["params"]) for g in optimizer.param_groups]
    if saved_sizes != live_sizes:
        raise StateMismatchError(
            f"{source}: optimizer has parameter groups of sizes {saved_sizes}, the live one "
            f"{live_sizes}; build the optimizer the same way as the saved run."
        )
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
        # A plain optimizer.load_state_dict() of one of our files copies the binding into the live
        # groups too; it is ours, not a setting, on either side.
        ours = {"params", BINDING_KEY, "param_names"}
        saved_keys, live_keys = set(saved) - ours, set(live) - ours
        if saved_keys != live_keys:
            extra, lacking = sorted(saved_keys - live_keys)[:3], sorted(live_keys - saved_keys)[:3]
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
            shaped = param_shaped_keys(opt_sd["state"], pairs, any_entry=True)
        for pid, param in pairs:
            entry = opt_sd["state"].get(pid)
            for key in sorted(shaped & set(entry), key=str) if isinstance(entry, dict) else []:
                value = entry[key]
                shape = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
                if shape != tuple(param.shape):
                    name = live_names.get(id(param), f"parameter {pid}")
                    raise StateMismatchError(
                        f"{source}: optimizer state {key!r} of {name} has shape {shape} but the parameter "
                        f"has {tuple(param.shape)} (the save recorded {key!r} as a per-parameter tensor); "
                        "build the same model and optimizer as the saved run."
                    )
    # What load_state_dict should see: the groups without our binding records.
    groups = [{k: v for k, v in g.items() if k != BINDING_KEY} for g in opt_sd["param_groups"]]
    return {**opt_sd, "param_groups": groups}


def _is_param_group(group: Any) -> bool:
    """A saved param group: a dict whose ``params`` is a list of integer ids."""
    if not isinstance(group, dict) or not isinstance(group.get("params"), list):
        return False
    return all(isinstance(i, int) and not isinstance(i, bool) for i in group["params"])


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


def _saved_owners(saved: Any, saved_modules: list[Any], *, v2: bool) -> set[str]:
    """The module parts a saved optimizer's parameters belonged to, from its binding records."""
    if v2:
        return {"model"}  # a positional save: one model, one optimizer over it
    owners = set()
    for group in saved.get("param_groups", []) if isinstance(saved, dict) else []:
        binding = group.get(BINDING_KEY) if isinstance(group, dict) else None
        names = binding.get("param_names") if isinstance(binding, dict) else None
        for pname in names if isinstance(names, list) else []:
            head = pname.split(".", 1)[0] if isinstance(pname, str) else None
            if head in saved_modules:
                owners.add(head)
    return owners


def check_optimizers_have_their_modules(
    state: Mapping[str, Any],
    objects: dict[str, Any],
    optimizer_sds: dict[str, Any],
    module_sds: dict[str, Any],
    saved_modules: list[Any],
    *,
    source: str,
    v2: bool,
) -> None:
    """Refuse optimizer state whose parameters belong to a module part that this restore leaves alone.

    With ``strict=False`` a renamed module part (saved as ``model``, given as
    ``net``) is skipped as "present on one side only"; its optimizer's moments
    and step counts would still be loaded, onto weights that were not
    restored. The optimizer comes back together with its parameters, or not at
    all. Both sides are asked: the live module parts that own the optimizer's
    parameters, and the saved module parts its binding records name.
    """
    owners = {
        id(p): name
        for name, part in state.items()
        if isinstance(part, torch.nn.Module)
        for p in unwrap(part).parameters()
    }
    for name in optimizer_sds:
        params = [p for group in state[name].param_groups for p in group["params"]]
        live = {owners[id(p)] for p in params if id(p) in owners}
        left = sorted((live | _saved_owners(objects[name], saved_modules, v2=v2)) - set(module_sds))
        if left:
            raise StateMismatchError(
                f"{source}: part {name!r} holds optimizer state for the parameters of module part(s) {left}, "
                f"which this restore leaves alone (a part saved under one name and given under another is "
                f"skipped with strict=False). Optimizer moments and steps without their weights would "
                f"train the wrong model. Pass each module under the name it was saved with, or leave "
                f"{name!r} out of the state to restore the rest. Nothing was changed."
            )
