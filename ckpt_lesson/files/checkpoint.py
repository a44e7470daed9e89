"""Single-file checkpoints: save every piece of training state, load it back safely.

A resumable checkpoint holds five buckets, and missing any one of them changes
the run after resume:

=============  ==========================================================
``model``      the weights (``model.state_dict()``)
``optimizer``  AdamW's moments and step counts; without them the first
               steps after resume take wrong-sized updates
``scheduler``  where the learning-rate schedule is
``state``      counters (step, epoch, batch_in_epoch) and the loss history
``rng``        every random generator (see :mod:`ckpt_lesson.files.rng`)
=============  ==========================================================

Loading always uses ``torch.load(weights_only=True)``: a checkpoint is data,
and the full unpickler would run any code a crafted file asks it to. Reading
and verifying the file is :mod:`ckpt_lesson.files.loading` (its
:func:`load_verified_file` is re-exported here); this module decides what the
payload means and applies it.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Collection
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from ckpt_lesson.errors import CheckpointError, CorruptCheckpointError, StateMismatchError
from ckpt_lesson.files.atomic import atomic_save
from ckpt_lesson.files.integrity import FileDigest
from ckpt_lesson.files.loading import load_verified_file
from ckpt_lesson.files.payload import (
    check_model_state,
    check_optimizer_fit,
    optimizer_state_with_bindings,
    strip_bindings,
    validate_payload,
)
from ckpt_lesson.files.rng import capture_rng_state, restore_rng_state, validate_rng_state
from ckpt_lesson.files.schema import CURRENT_SCHEMA, SCHEMA_V1, current_env, migrate_payload

__all__ = [
    "BUCKETS",
    "REQUIRES_KEY",
    "TrainState",
    "apply_payload",
    "build_payload",
    "check_model_state",
    "load_verified_file",
    "load_checkpoint",
    "read_checkpoint",
    "save_checkpoint",
]

log = logging.getLogger(__name__)

#: Key in ``extras`` listing state that only a special loader restores.
REQUIRES_KEY = "requires"

#: The buckets a resume needs; a payload missing any of them is refused.
BUCKETS = ("model", "optimizer", "scheduler", "state", "rng")


@dataclass
class TrainState:
    """Where training is: the counters a resume continues from.

    Attributes:
        step: Optimizer steps completed.
        epoch: Current epoch (0-based).
        batch_in_epoch: Batches of ``epoch`` already consumed; the next batch
            to train on has this index.
        losses: One training loss per completed step.
    """

    step: int = 0
    epoch: int = 0
    batch_in_epoch: int = 0
    losses: list[float] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        """Plain-Python form, safe for a weights-only load."""
        out = asdict(self)
        out["losses"] = [float(x) for x in self.losses]
        return out

    @classmethod
    def from_dict(cls, data: Any, *, source: str = "<state>") -> TrainState:
        """Validate and build; raises :class:`StateMismatchError` on bad input."""
        if not isinstance(data, dict):
            raise StateMismatchError(f"{source}: 'state' must be a dict, got {type(data).__name__}.")
        missing = [k for k in ("step", "epoch", "batch_in_epoch", "losses") if k not in data]
        if missing:
            raise StateMismatchError(f"{source}: 'state' lacks {missing}; re-save with save_checkpoint().")
        for key in ("step", "epoch", "batch_in_epoch"):
            value = data[key]
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise StateMismatchError(f"{source}: state[{key!r}] must be an int >= 0, got {value!r}.")
        if not isinstance(data["losses"], (list, tuple)) or not all(
            isinstance(x, (int, float)) and not isinstance(x, bool) for x in data["losses"]
        ):
            raise StateMismatchError(f"{source}: state['losses'] must be a list of floats.")
        return cls(
            step=data["step"],
            epoch=data["epoch"],
            batch_in_epoch=data["batch_in_epoch"],
            losses=[float(x) for x in data["losses"]],
        )


def build_payload(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    state: TrainState,
    *,
    extras: dict[str, Any] | None = None,
    data: dict[str, Any] | None = None,
    rng: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Gather the five buckets plus metadata into one current-schema payload.

    ``scheduler`` may be ``None`` for a run without one; loading then requires
    ``None`` too, so the two can never be silently mixed.

    ``rng`` is a state from :func:`~ckpt_lesson.files.rng.capture_rng_state` taken
    earlier; ``None`` captures the generators now. An asynchronous save passes
    the state captured with its snapshot: by the time a background thread
    writes, training has drawn more random numbers, and saving *those* would
    resume with the wrong dropout masks and jitter.
    """
    if not isinstance(state, TrainState):
        raise CheckpointError(f"state must be a TrainState, got {type(state).__name__}.")
    # The state must survive its own parser: a step of -1, 5.0, True, np.int64(5) or a tensor would
    # be written fine and refused by every load, so it is refused here, before anything is written.
    try:
        TrainState.from_dict(state.to_dict(), source="state to save")
    except (TypeError, ValueError) as exc:
        raise CheckpointError(f"{exc} Nothing was written.") from None
    if rng is not None:
        validate_rng_state(rng)  # a bad state must fail this save, not the resume months later
    payload = {
        "schema": CURRENT_SCHEMA,
        "model": model.state_dict(),
        "optimizer": optimizer_state_with_bindings(model, optimizer),
        "scheduler": None if scheduler is None else scheduler.state_dict(),
        "state": state.to_dict(),
        "rng": capture_rng_state() if rng is None else rng,
        "wall_saved_at": time.time(),
        "extras": extras,
        "env": current_env(),
        "data": {"recorded": data is not None, **(data or {"fingerprint": None, "order_seed": None})},
    }
    validate_payload(payload)  # every value one a weights-only load accepts, no meta tensors
    return payload


def save_checkpoint(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    state: TrainState,
    out_path: str | os.PathLike[str],
    *,
    schema: str = CURRENT_SCHEMA,
    extras: dict[str, Any] | None = None,
    data: dict[str, Any] | None = None,
    rng: dict[str, Any] | None = None,
) -> FileDigest:
    """Save a complete, resumable checkpoint to one file, atomically.

    Args:
        model, optimizer, scheduler: The live training objects.
        state: Counters and loss history.
        out_path: Target file (the lesson's parameter name); missing parent
            directories are created.
        schema: Must be the current schema, the only one this package writes
            (the keyword exists because the lesson's signature has it). A
            ``ckpt.v1`` file for migration exercises comes from
            :func:`~ckpt_lesson.files.migrate.write_legacy_v1_checkpoint`.
        extras: Extra plain-Python values to carry along.
        data: Dataset description for the v2 ``data`` block, e.g.
            ``{"fingerprint": "...", "order_seed": 11}``.
        rng: Generator state captured earlier (see :func:`build_payload`);
            ``None`` captures it now.

    Returns:
        Size and sha256 of the file written.

    Raises:
        CheckpointError: ``schema`` is not the current one (checked before
            anything is written: a file our own loader would refuse is no save).

    Example:
        >>> save_checkpoint(model, opt, sched, TrainState(step=12), "ckpt/last.pt")  # doctest: +SKIP
    """
    if schema != CURRENT_SCHEMA:
        hint = " use write_legacy_v1_checkpoint() for a ckpt.v1 file," if schema == SCHEMA_V1 else ""
        raise CheckpointError(
            f"{out_path}: save_checkpoint writes schema {CURRENT_SCHEMA!r} only, got schema={schema!r};"
            f"{hint} or leave schema out."
        )
    payload = build_payload(model, optimizer, scheduler, state, extras=extras, data=data, rng=rng)
    return atomic_save(payload, out_path)


def read_checkpoint(
    path: str | os.PathLike[str],
    *,
    map_location: str | torch.device = "cpu",
    expected_sha256: str | None = None,
) -> dict[str, Any]:
    """Verify, load (weights-only) and migrate a checkpoint file, applying nothing.

    Args:
        path: A file written by :func:`save_checkpoint` (or a legacy v1 file).
        map_location: Passed to ``torch.load``.
        expected_sha256: The whole file's sha256 from an index or manifest;
            checked in the same pass as the footer.

    Returns:
        The payload, migrated to the current schema, with every bucket present.

    Raises:
        CheckpointError: Missing file; ``CorruptCheckpointError`` for a hash
            mismatch, truncation or unreadable archive; ``UnsafeCheckpointError``
            when the weights-only loader refuses it; ``SchemaError`` for a
            missing or unknown schema; ``StateMismatchError`` for a missing bucket.
    """
    path = Path(path)
    if path.is_dir():
        raise CheckpointError(
            f"{path}: is a directory; use load_sharded_checkpoint() for sharded checkpoints."
        )
    payload, digest = load_verified_file(path, map_location=map_location, expected_sha256=expected_sha256)
    original = payload.get("schema") if isinstance(payload, dict) else None
    payload = migrate_payload(payload, source=str(path))
    if digest.content_sha256 is None:
        if original != SCHEMA_V1:
            raise CorruptCheckpointError(
                f"{path}: a {original} checkpoint without its integrity footer; the file's end was "
                "damaged or it was re-written by other code. Restore an older checkpoint."
            )
        log.warning(
            "%s: legacy v1 checkpoint with no integrity record; "
            "run 'python -m ckpt_lesson migrate %s' to add one.",
            path,
            path,
        )
    missing = [b for b in BUCKETS if b not in payload]
    if missing:
        raise StateMismatchError(
            f"{path}: checkpoint lacks {missing}. A resume needs every bucket; a fresh optimizer or "
            "RNG would silently change the run. Re-save with save_checkpoint(), or use "
            "warm_start_from() to start a new experiment from the weights."
        )
    return payload


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
    missing = [b for b in BUCKETS if not isinstance(payload, dict) or b not in payload]
    if missing:
        raise StateMismatchError(f"{source}: payload lacks {missing}; a resume needs every bucket.")
    _check_requirements(payload.get("extras"), handles, source=source)
    state = TrainState.from_dict(payload["state"], source=source)
    check_model_state(payload["model"], model, source=source, allow_dtype_cast=allow_dtype_cast)
    opt_sd = payload["optimizer"]
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
    # The optimizer goes first because its values are the least checkable: torch
    # casts every state entry and raises on odd ones, sometimes after it has
    # already replaced its state. Its current state_dict (references, no copies)
    # lets a failed load be rolled back before anything else has changed.
    previous = optimizer.state_dict()
    try:
        optimizer.load_state_dict(opt_sd)
    except Exception as exc:
        optimizer.load_state_dict(previous)
        raise StateMismatchError(
            f"{source}: the optimizer state does not fit the live optimizer ({type(exc).__name__}: "
            f"{str(exc)[:200]}); build the same optimizer class and groups as the saved run."
        ) from exc
    model.load_state_dict(payload["model"], strict=True)
    if scheduler is not None:
        scheduler.load_state_dict(payload["scheduler"])
    restore_rng_state(payload["rng"], allow_device_change=allow_device_change)
    return state


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


def load_checkpoint(
    path: str | os.PathLike[str],
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    *,
    map_location: str | torch.device = "cpu",
    expected_sha256: str | None = None,
    allow_dtype_cast: bool = False,
) -> TrainState:
    """Load a checkpoint written by :func:`save_checkpoint` and restore everything.

    Args:
        path: The checkpoint file.
        model, optimizer, scheduler: Built exactly as in the saved run; their
            state is replaced.
        map_location: Passed to ``torch.load``.
        expected_sha256: Optional whole-file sha256 to check against.
        allow_dtype_cast: Accept weights saved in another dtype (see :func:`apply_payload`).

    Returns:
        The saved :class:`TrainState`; training continues at ``state.step + 1``.

    Raises:
        CheckpointError: See :func:`read_checkpoint` and :func:`apply_payload`.

    Example:
        >>> state = load_checkpoint("ckpt/last.pt", model, opt, sched)  # doctest: +SKIP
    """
    payload = read_checkpoint(path, map_location=map_location, expected_sha256=expected_sha256)
    return apply_payload(
        payload, model, optimizer, scheduler, source=str(path), allow_dtype_cast=allow_dtype_cast
    )
