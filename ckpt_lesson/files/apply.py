"""Applying a verified payload to live objects: check everything first, then change anything.

Split out of :mod:`ckpt_lesson.files.checkpoint` (which re-exports these names).
The comparisons themselves (model keys, shapes and dtypes; the optimizer's
class, parameter order and state shapes) live in :mod:`ckpt_lesson.files.payload`.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Collection
from typing import Any

import torch

from ckpt_lesson.errors import CheckpointError, CorruptCheckpointError, StateMismatchError
from ckpt_lesson.files.integrity import FileDigest
from ckpt_lesson.files.modules import canonical_saved_keys, load_model_state, model_state
from ckpt_lesson.files.payload import check_model_state, check_optimizer_fit, strip_bindings
from ckpt_lesson.files.rng import restore_rng_state, validate_rng_state
from ckpt_lesson.files.schema import SCHEMA_V1
from ckpt_lesson.files.train_state import (
    BUCKETS,
    FILE_STATE_API,
    REQUIRES_KEY,
    TrainState,
    check_positional_objects,
)

__all__ = [
    "apply_payload",
    "check_optimizer_payload",
    "load_objects_or_roll_back",
    "require_footer",
    "rollback_snapshot",
]


def require_footer(obj: Any, digest: FileDigest, path: str | os.PathLike[str]) -> None:
    """Refuse a file that declares a schema newer than ``ckpt.v1`` but has no integrity footer.

    Every file this package writes in ``ckpt.v2`` carries a footer; one without it
    lost its end or was rewritten by other code. A file with no schema at all
    (plain weights from elsewhere) or a legacy v1 file is left to the caller.

    Raises:
        CorruptCheckpointError: The schema says a footer must be there and it is not.
    """
    schema = obj.get("schema") if isinstance(obj, dict) else None
    # content_digest where FileDigest knows several algorithms; content_sha256 before that.
    content = getattr(digest, "content_digest", digest.content_sha256)
    if content is None and schema is not None and schema != SCHEMA_V1:
        raise CorruptCheckpointError(
            f"{path}: a {schema} checkpoint without its integrity footer; the file's end was "
            "damaged or it was re-written by other code. Restore an older checkpoint."
        )


def apply_payload(
    payload: dict[str, Any],
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    *,
    source: str = "<payload>",
    allow_device_change: bool = False,
    allow_dtype_cast: bool = False,
    handles: Collection[str] = (),
) -> TrainState:
    """Check that ``payload`` fits the live objects, then restore all five buckets.

    Everything that can be checked cheaply is checked before anything is
    changed, and the one part torch checks only while loading (the optimizer's
    state entries) is rolled back on failure, so a refused checkpoint leaves
    model, optimizer, scheduler and random generators as they were.

    Args:
        payload: A current-schema payload, e.g. from :func:`read_checkpoint`.
        model, optimizer, scheduler: The live objects (``scheduler`` may be
            ``None`` when the saved run had none).
        source: Names the checkpoint in error messages.
        allow_device_change: See :func:`ckpt_lesson.files.rng.restore_rng_state`.
        allow_dtype_cast: Accept model tensors saved in another dtype (cast on load);
            refused by default, see :func:`~ckpt_lesson.files.payload.check_model_state`.
        handles: Names in ``extras["requires"]`` that the caller restores
            itself (e.g. ``"accumulation"`` for gradients saved mid-step).
            Any other required name is refused: a plain load would drop it.

    Returns:
        The saved :class:`TrainState`.

    Raises:
        StateMismatchError: A bucket is missing, model keys or shapes differ,
            the optimizer's parameter groups or state entries do not fit,
            scheduler presence differs, the RNG block is malformed or was
            saved on a different number of CUDA devices, or ``extras`` requires
            state that this caller does not restore.

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
    state = TrainState.from_dict(payload["state"], source=source)
    model_sd = payload["model"]
    if isinstance(model_sd, dict):  # a save made before keys were canonical may carry a wrapper prefix
        model_sd = canonical_saved_keys(model_sd, model_state(model).keys())
    check_model_state(model_sd, model, source=source, allow_dtype_cast=allow_dtype_cast)
    opt_sd = check_optimizer_payload(payload["optimizer"], optimizer, model, source=source)
    if (payload["scheduler"] is None) != (scheduler is None):
        have = "no scheduler" if scheduler is None else "a scheduler"
        saved = "none" if payload["scheduler"] is None else "one"
        raise StateMismatchError(
            f"{source}: the checkpoint saved {saved} but {have} was passed; pass the same kind."
        )
    if scheduler is not None and not isinstance(payload["scheduler"], dict):
        raise StateMismatchError(
            f"{source}: 'scheduler' must be a scheduler state_dict, "
            f"got {type(payload['scheduler']).__name__}."
        )
    # The RNG block is checked here too, before the first assignment below: a
    # refused checkpoint must leave the live objects exactly as they were.
    try:
        validate_rng_state(payload["rng"], allow_device_change=allow_device_change)
    except CheckpointError as exc:
        raise StateMismatchError(f"{source}: {exc}") from exc
    # Optimizer and scheduler go first because their values are the least checkable: torch
    # casts every state entry and raises on odd ones, sometimes after it has already replaced
    # its state. Both are loaded all-or-nothing from snapshots taken before either changes, so
    # a refusal leaves everything as it was; the model (checked completely above) goes last.
    loads = [("optimizer", optimizer, opt_sd)]
    if scheduler is not None:
        loads.append(("scheduler", scheduler, payload["scheduler"]))
    load_objects_or_roll_back(loads, source=source)
    load_model_state(model, model_sd)
    restore_rng_state(payload["rng"], allow_device_change=allow_device_change)
    return state


def rollback_snapshot(part: Any) -> Any:
    """A copy of ``part.state_dict()`` to put back if a restore is refused, independent of the live part.

    Many classes return live references from ``state_dict()`` (the common
    ``return self.__dict__``), and their ``load_state_dict`` changes those very
    containers: reloading such a "snapshot" would restore nothing. So the
    snapshot is a deep copy (tensors detached and cloned). A torch optimizer is
    the exception: its ``load_state_dict`` replaces state and groups with new
    objects and never writes into the old tensors, so references roll it back
    without a second copy of its moments.

    Example:
        >>> class Live:
        ...     def __init__(self): self.n = 1
        ...     def state_dict(self): return self.__dict__
        >>> part = Live(); before = rollback_snapshot(part); part.n = 2
        >>> before
        {'n': 1}
    """
    state = part.state_dict()
    return state if isinstance(part, torch.optim.Optimizer) else _deep_copy(state)


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

    Every snapshot is taken before the first load (see :func:`rollback_snapshot`),
    so a part whose state the others share, or that returns live references,
    still comes back as it was.

    Raises:
        StateMismatchError: Naming the part that refused its saved state; nothing was changed.

    Example:
        >>> load_objects_or_roll_back([("optimizer", opt, saved)], source="last.pt")  # doctest: +SKIP
    """
    before = [(part, rollback_snapshot(part)) for _, part, _ in loads]
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


def check_optimizer_payload(opt_sd: Any, optimizer: Any, model: Any, *, source: str) -> dict[str, Any]:
    """Check a saved optimizer state against the live optimizer; returns what ``load_state_dict`` takes.

    Args:
        opt_sd: The saved optimizer state dict (with our binding records).
        optimizer: The live optimizer.
        model: Anything with ``named_parameters()``: names the live parameters.
        source: Names the checkpoint in messages.

    Returns:
        ``opt_sd`` without the binding records.

    Raises:
        StateMismatchError: Not an optimizer state dict, or it does not fit (groups, class,
            parameter order, state shapes).
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
    check_optimizer_fit(opt_sd, optimizer, model, source=source)
    opt_sd = strip_bindings(opt_sd)
    return opt_sd


def _is_param_group(group: Any) -> bool:
    """A saved param group: a dict whose ``params`` is a list of integer ids."""
    if not isinstance(group, dict) or not isinstance(group.get("params"), list):
        return False
    return all(isinstance(i, int) and not isinstance(i, bool) for i in group["params"])


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
