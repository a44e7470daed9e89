"""The one apply step: check that a verified payload fits the live state, then change everything or nothing.

Every restore ends here: the state API's parts (:func:`apply_state_payload`)
and the positional ``model, optimizer, scheduler`` form, which is a thin
adapter over it (:func:`apply_payload`: a ``ckpt.v2`` payload read as parts by
:func:`parts_view`). What is compared (keys, shapes, dtypes, optimizer class,
parameter order, state shapes, part names) is :mod:`ckpt_lesson.files.fit`.
Modules and optimizers are checked completely before anything changes; the
objects torch checks only while loading are loaded first, from snapshots that
are copies taken before anything changed, and put back if one refuses.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ckpt_lesson.errors import CheckpointError, StateMismatchError
from ckpt_lesson.files.fit import (
    check_model_state,
    check_optimizer_payload,
    check_optimizers_have_their_modules,
    check_part_names,
)
from ckpt_lesson.files.payload import OBJECT, PARTS_SCHEMA, VALUE, check_names, module_parts
from ckpt_lesson.files.rng import restore_rng_state, validate_rng_state
from ckpt_lesson.files.schema import SCHEMA_V2
from ckpt_lesson.files.train_state import (
    BUCKETS,
    FILE_STATE_API,
    REQUIRES_KEY,
    TrainState,
    canonical_saved_keys,
    check_positional_objects,
    load_model_state,
    model_state,
)
from ckpt_lesson.short_repr import short_repr

__all__ = [
    "Restored",
    "apply_payload",
    "apply_state_payload",
    "parts_view",
]


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


def parts_view(payload: dict[str, Any], *, source: str) -> dict[str, Any]:
    """A ``ckpt.v2`` payload seen as parts (the layout :mod:`ckpt_lesson.files.payload` describes).

    ``scheduler`` and ``extras`` are parts only when saved; a parts payload comes back unchanged.

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
    buckets = ("model", "optimizer", "scheduler", "state", "extras")
    return {
        **{k: v for k, v in payload.items() if k not in buckets},  # schema, rng and the metadata blocks
        "step": train_state.step,
        "kinds": {**dict.fromkeys(objects, OBJECT), **dict.fromkeys(values, VALUE)},
        "objects": objects,
        "values": values,
    }


def apply_state_payload(
    payload: dict[str, Any],
    state: Mapping[str, Any],
    *,
    source: str,
    strict: bool = True,
    allow_dtype_cast: bool = False,
    check_parts: Callable[[dict[str, str]], None] | None = None,
) -> Restored:
    """Check that ``payload`` fits the live ``state``, then restore every part and the RNG (see module doc).

    Args:
        payload: A parts payload, or a ``ckpt.v2`` one (see :func:`parts_view`).
        state: The live ``{name: part}`` mapping, as passed to the save.
        source: Names the checkpoint in messages.
        strict: Refuse parts present on one side only (default). ``False`` ignores them.
        allow_dtype_cast: Accept module tensors saved in another dtype.
        check_parts: Replaces :func:`~ckpt_lesson.files.fit.check_part_names` (called with the
            saved kinds, after the parts' own checks): the positional form names a scheduler
            passed on one side only in its own words.

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
    malformed = not all(isinstance(x, dict) for x in (kinds, objects, values))
    if malformed or set(kinds) != set(objects) | set(values):
        raise StateMismatchError(f"{source}: the payload's parts are malformed (kinds, objects, values).")
    wanted = [n for n in objects if n in state]
    live_modules = module_parts({n: state[n] for n in wanted})
    v2 = view["schema"] == SCHEMA_V2  # a positional save
    # A v2 payload's bindings name parameters as the bare model did; a parts payload qualifies them.
    names = live_modules.get("model") if v2 else live_modules
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
    if check_parts is None:
        check_part_names(kinds, state, source=source, strict=strict)
    else:
        check_parts(kinds)
    check_optimizers_have_their_modules(
        state, objects, optimizer_sds, module_sds, saved_modules, source=source, v2=v2
    )
    # The RNG block is checked here too, before the first load below: a refused checkpoint must
    # leave the live objects exactly as they were. A positional save always has one.
    rng = view.get("rng")
    if rng is not None or v2:
        try:
            validate_rng_state(rng)
        except CheckpointError as exc:
            raise StateMismatchError(f"{source}: {exc}") from exc
    # The uncheckable objects and the optimizers first (undone on failure), the modules last.
    others = [(n, state[n], optimizer_sds.get(n, objects[n])) for n in wanted if n not in module_sds]
    load_objects_or_roll_back(others, source=source)
    for name, sd in module_sds.items():
        load_model_state(state[name], sd)
    if rng is not None:
        restore_rng_state(rng)
    return Restored(step=step, values=dict(values), rng=rng)


def apply_payload(
    payload: dict[str, Any],
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    *,
    source: str = "<payload>",
    allow_dtype_cast: bool = False,
    handles: Collection[str] = (),
) -> TrainState:
    """The positional form of :func:`apply_state_payload`: restore all five buckets, or change nothing.

    Args:
        payload: A current-schema payload, e.g. from :func:`~ckpt_lesson.files.checkpoint.read_checkpoint`.
        model, optimizer, scheduler: The live objects (``scheduler`` may be
            ``None`` when the saved run had none).
        source: Names the checkpoint in error messages.
        allow_dtype_cast: Accept model tensors saved in another dtype (cast on load);
            refused by default, see :func:`~ckpt_lesson.files.fit.check_model_state`.
        handles: Names in ``extras["requires"]`` that the caller restores
            itself (e.g. ``"accumulation"`` for gradients saved mid-step).
            Any other required name is refused: a plain load would drop it.

    Returns:
        The saved :class:`TrainState`.

    Raises:
        CheckpointError: A ``None`` model or optimizer, an object without
            ``state_dict()`` or a dict of models, named as the managers do.
        StateMismatchError: A bucket is missing, scheduler presence differs,
            ``extras`` requires state that this caller does not restore, or
            anything :func:`apply_state_payload` refuses, named by part.

    Example:
        >>> state = apply_payload(read_checkpoint("ckpt/last.pt"), model, opt, sched)  # doctest: +SKIP
    """
    check_positional_objects(
        model, optimizer, scheduler, loading=True, state_api=FILE_STATE_API, where=f"{source}: "
    )
    missing = [b for b in BUCKETS if not isinstance(payload, dict) or b not in payload]
    if missing:
        raise StateMismatchError(f"{source}: payload lacks {missing}; a resume needs every bucket.")
    _check_requirements(payload.get("extras"), handles, source=source)

    def same_scheduler(kinds: dict[str, str]) -> None:
        if ("scheduler" in kinds) != (scheduler is not None):  # saved one and none passed, or the reverse
            saved, have = ("one", "no scheduler") if scheduler is None else ("none", "a scheduler")
            raise StateMismatchError(
                f"{source}: the checkpoint saved {saved} but {have} was passed; pass the same kind."
            )

    parts = {"model": model, "optimizer": optimizer, "scheduler": scheduler}
    restored = apply_state_payload(
        payload,
        {k: v for k, v in parts.items() if v is not None},
        source=source,
        allow_dtype_cast=allow_dtype_cast,
        check_parts=same_scheduler,
    )
    return TrainState.from_dict(restored.values["train_state"], source=source)


def _deep_copy(tree: Any) -> Any:
    # Tensors by detach().clone(): copy.deepcopy refuses tensors that are not graph leaves.
    if isinstance(tree, torch.Tensor):
        return tree.detach().clone()
    if isinstance(tree, dict):
        return {k: _deep_copy(v) for k, v in tree.items()}
    if type(tree) in (list, tuple):
        return type(tree)(_deep_copy(v) for v in tree)
    return copy.deepcopy(tree)


def load_objects_or_roll_back(loads: list[tuple[str, Any, Any]], *, source: str) -> None:
    """Load every ``(name, part, saved_state)`` in order; on a refusal put every part back, then raise.

    Every rollback snapshot is taken before the first load, so a part whose state the others
    share still comes back as it was. A snapshot is a deep copy (tensors detached and cloned):
    many classes return live references from ``state_dict()`` (the common ``return self.__dict__``)
    and their ``load_state_dict`` changes those very containers, so reloading references would
    restore nothing. A torch optimizer is the exception: its ``load_state_dict`` replaces state and
    groups with new objects and never writes into the old tensors, so references roll it back
    without a second copy of its moments.

    Raises:
        StateMismatchError: Naming the part that refused its saved state; nothing was changed.

    Example:
        >>> load_objects_or_roll_back([("optimizer", opt, saved)], source="last.pt")  # doctest: +SKIP
    """
    before = [(part, part.state_dict()) for _, part, _ in loads]
    before = [(p, sd if isinstance(p, torch.optim.Optimizer) else _deep_copy(sd)) for p, sd in before]
    for i, (name, part, saved) in enumerate(loads):
        try:
            part.load_state_dict(saved)
        except Exception as exc:
            try:  # the refusing part may have changed half its state before it raised
                part.load_state_dict(before[i][1])
            except Exception:  # noqa: BLE001 (it refuses any state; what it raised first is reported)
                pass
            for loaded, previous in reversed(before[:i]):
                loaded.load_state_dict(previous)
            raise StateMismatchError(
                f"{source}: part {name!r} ({type(part).__name__}) refused its saved state "
                f"({type(exc).__name__}: {str(exc)[:200]}); build it as in the saving run (the same class, "
                "groups and settings). Nothing was changed."
            ) from exc


def _check_requirements(extras: Any, handles: Collection[str], *, source: str) -> None:
    # A save can carry state beyond the five buckets that only a special loader
    # restores (partial gradients mid-accumulation). It lists that state in
    # extras["requires"], so the plain loader refuses instead of dropping it.
    required = extras.get(REQUIRES_KEY, []) if isinstance(extras, dict) else []
    if not isinstance(required, (list, tuple)):
        raise StateMismatchError(f"{source}: extras[{REQUIRES_KEY!r}] must be a list of names.")
    unknown = [name for name in required if name not in handles]
    if unknown:
        raise StateMismatchError(
            f"{source}: the checkpoint also holds {unknown} state that this loader does not restore "
            "(e.g. gradients saved in the middle of an accumulation); loading it here would silently "
            "drop that state. Use the matching loader: load_accumulating() for 'accumulation'."
        )
