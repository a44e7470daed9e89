"""Applying a state-API payload: check every part against the live state, then change anything.

Split out of :mod:`ckpt_lesson.files.state_payload` (what a payload holds); this
module is the restore half, as :mod:`ckpt_lesson.files.apply` is for the
positional payloads, and reuses its optimizer checks.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from ckpt_lesson.errors import CheckpointError, StateMismatchError
from ckpt_lesson.files.apply import check_optimizer_payload, load_objects_or_roll_back
from ckpt_lesson.files.modules import canonical_saved_keys, load_model_state, model_state, unwrap
from ckpt_lesson.files.payload import BINDING_KEY, check_model_state
from ckpt_lesson.files.rng import restore_rng_state, validate_rng_state
from ckpt_lesson.files.schema import SCHEMA_V2
from ckpt_lesson.files.state_payload import (
    OBJECT,
    VALUE,
    Names,
    Restored,
    check_names,
    is_object,
    module_parts,
    parts_view,
)

__all__ = ["apply_state_payload", "check_part_names"]


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
    for name in saved:
        if name not in given:
            continue
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


def apply_state_payload(
    payload: dict[str, Any],
    state: Mapping[str, Any],
    *,
    source: str,
    strict: bool = True,
    allow_dtype_cast: bool = False,
) -> Restored:
    """Check that ``payload`` fits the live ``state``, then restore every part and the RNG.

    Modules and optimizers are checked completely before anything changes;
    other objects (schedulers, scalers, loaders) can only be checked by loading
    them, so they are loaded first and put back if a later one fails.

    Args:
        payload: A parts payload, or a ``ckpt.v2`` one (see :func:`parts_view`).
        state: The live ``{name: part}`` mapping, as passed to the save.
        source: Names the checkpoint in messages.
        strict: Refuse parts present on one side only (default). ``False`` ignores them.
        allow_dtype_cast: Accept module tensors saved in another dtype.

    Returns:
        A :class:`Restored` (``path`` and ``save_id`` left for the caller to fill).

    Raises:
        StateMismatchError: Any difference, named by part; nothing was changed then.

    Example:
        >>> net = torch.nn.Linear(2, 2)
        >>> p = build_state_payload(3, {"model": net, "best": 0.5}, rng=False)
        >>> apply_state_payload(p, {"model": net}, source="demo").values  # values need no placeholder
        {'best': 0.5}
    """
    check_names(state, source)
    view = parts_view(payload, source=source)
    step, kinds, objects, values = (view.get(k) for k in ("step", "kinds", "objects", "values"))
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise StateMismatchError(f"{source}: the payload's step {step!r} is not an int >= 0.")
    if not all(isinstance(x, dict) for x in (kinds, objects, values)) or set(kinds) != set(objects) | set(
        values
    ):
        raise StateMismatchError(f"{source}: the payload's parts are malformed (kinds, objects, values).")
    check_part_names(kinds, state, source=source, strict=strict)
    wanted = [n for n in objects if n in state]
    live_modules = module_parts({n: state[n] for n in wanted})
    # A v2 payload's bindings name parameters as the bare model did; a parts payload qualifies them.
    names = live_modules.get("model") if view["schema"] == SCHEMA_V2 else Names(live_modules)
    module_sds: dict[str, Any] = {}
    optimizer_sds: dict[str, Any] = {}
    saved_modules = view.get("modules") if isinstance(view.get("modules"), list) else []
    for name in wanted:
        part, saved = state[name], objects[name]
        where = f"{source} part {name!r}"
        if name in saved_modules and not isinstance(part, torch.nn.Module):
            raise StateMismatchError(
                f"{where}: was saved from a torch.nn.Module but the state given to restore holds a "
                f"{type(part).__name__}; pass the module, built as in the saving run."
            )
        if isinstance(part, torch.nn.Module):
            sd = canonical_saved_keys(saved, model_state(part).keys()) if isinstance(saved, dict) else saved
            check_model_state(sd, part, source=where, allow_dtype_cast=allow_dtype_cast)
            module_sds[name] = sd
        elif isinstance(part, torch.optim.Optimizer):
            optimizer_sds[name] = check_optimizer_payload(saved, part, names, source=where)
        elif not isinstance(saved, dict):
            raise StateMismatchError(f"{where}: saved state is a {type(saved).__name__}, not a state dict.")
    _check_optimizers_have_their_modules(
        state,
        objects,
        optimizer_sds,
        module_sds,
        saved_modules,
        source=source,
        v2=view["schema"] == SCHEMA_V2,
    )
    rng = view.get("rng")
    if rng is not None:
        try:
            validate_rng_state(rng)
        except CheckpointError as exc:
            raise StateMismatchError(f"{source}: {exc}") from exc
    _load_all(state, wanted, objects, optimizer_sds, module_sds, source=source)
    if rng is not None:
        restore_rng_state(rng)
    return Restored(step=step, values=dict(values), rng=rng)


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


def _check_optimizers_have_their_modules(
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


def _load_all(
    state: Mapping[str, Any],
    wanted: list[str],
    objects: dict[str, Any],
    optimizer_sds: dict[str, Any],
    module_sds: dict[str, Any],
    *,
    source: str,
) -> None:
    """Load the objects: the uncheckable ones and optimizers first (undone on failure), modules last."""
    others = [n for n in wanted if n not in module_sds]
    load_objects_or_roll_back(
        [(name, state[name], optimizer_sds.get(name, objects[name])) for name in others], source=source
    )
    for name, sd in module_sds.items():
        load_model_state(state[name], sd)
