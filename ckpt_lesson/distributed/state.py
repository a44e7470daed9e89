"""What one distributed save holds, and how it goes back into the live objects.

The state dict handed to DCP has two kinds of entries:

* **shared**: ``model`` and ``optim`` from ``get_state_dict`` (sharded DTensors
  under FSDP2, full tensors under DDP; DCP reshards both on load) and
  ``scheduler``, which is the same on every rank;
* **per rank**: ``rank{r}_local``, one opaque blob per rank holding that rank's
  counters, RNG state and data position.

Why a key per rank: DCP deduplicates non-tensor values and plain tensors that
appear under the *same* key on several ranks and keeps one rank's copy, silently.
Each rank's generators and sampler position differ, so under a shared key all
ranks but one would resume with somebody else's random stream. And why one
blob: DCP flattens nested dicts, and loading a flattened entry needs a template
of exactly the same shape; a blob loads into ``b""`` whatever its contents.
The blob is a ``torch.save`` of plain values, read back weights-only, and it is
read back once at save time too, so a value a resume could not load fails the
save instead of the resume.

The state API (``save(step, {"model": m, "optimizer": opt, "loader": dl})``) maps
onto the same two kinds: the one ``nn.Module`` part and the one optimizer part
go to DCP (resharded on load; ``get_state_dict`` handles wrappers such as DDP
and ``torch.compile``), and every other object's ``state_dict()`` and every
plain value (a scheduler, a ``GradScaler``, a stateful loader, a best metric:
small, and a loader's position differs from rank to rank) go into this rank's
blob next to its RNG state and come back on the same rank. One model and one
optimizer per save: put several modules in one ``nn.ModuleDict`` (or save each
optimizer's state as an object part when it is not sharded).
"""

from __future__ import annotations

import hashlib
import io
import pickle
import random
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from ckpt_lesson.errors import CheckpointError, StateMismatchError, UnsafeCheckpointError
from ckpt_lesson.files.checkpoint import TrainState
from ckpt_lesson.files.fit import check_part_names
from ckpt_lesson.files.payload import OBJECT, VALUE, is_object, validate_payload
from ckpt_lesson.files.rng import validate_rng_state
from ckpt_lesson.runs.manager_config import is_state_call, positional_restore_args, positional_save_args

from .safe_metadata import weights_only_refusal

__all__ = [
    "PARTS_KEY",
    "apply_rank_parts",
    "apply_shared_state",
    "check_rank_parts",
    "dcp_state_dict",
    "decode_rank_state",
    "encode_rank_state",
    "has_rank_parts",
    "rank_key",
    "reseed_generators",
    "restore_args",
    "save_args",
    "split_state",
]

#: Key of the per-rank blob's ``data`` entry that holds the state API's other parts.
PARTS_KEY = "ckpt_lesson_parts"


def rank_key(rank: int) -> str:
    """The state-dict key of one rank's own blob.

    Example:
        >>> rank_key(3)
        'rank3_local'
    """
    return f"rank{rank}_local"


def encode_rank_state(state: TrainState, rng: dict[str, Any], data_state: Any) -> bytes:
    """Serialize one rank's counters, RNG state and data position.

    Args:
        state: This rank's counters and losses.
        rng: From :func:`ckpt_lesson.capture_rng_state`, taken when the save was requested.
        data_state: The sampler/loader position (e.g. ``StatefulDataLoader.state_dict()``),
            plain values and tensors only; ``None`` if there is none.

    Returns:
        The blob stored under :func:`rank_key`.

    Raises:
        CheckpointError: ``state`` is not a TrainState, or ``rng``/``data_state``
            would not load back weights-only.

    Example:
        >>> from ckpt_lesson import capture_rng_state
        >>> blob = encode_rank_state(TrainState(step=3), capture_rng_state(), {"batch": 7})
        >>> decode_rank_state(blob, where="test")["data"]
        {'batch': 7}
    """
    if not isinstance(state, TrainState):
        raise CheckpointError(f"state must be a TrainState, got {type(state).__name__}.")
    validate_rng_state(rng)
    buf = io.BytesIO()
    try:
        torch.save({"train": state.to_dict(), "rng": rng, "data": data_state}, buf)
    except (pickle.PicklingError, TypeError, AttributeError) as exc:
        raise CheckpointError(f"data_state cannot be saved ({exc}); pass plain values and tensors.") from exc
    blob = buf.getvalue()
    try:
        decode_rank_state(blob, where=f"step {state.step} (checked before saving)")
    except CheckpointError as exc:
        raise CheckpointError(
            f"{exc} Only tensors, numbers, strings, lists, tuples and dicts survive a weights-only "
            "load; convert the data_state (e.g. ndarray.tolist()) before saving."
        ) from exc
    return blob


def decode_rank_state(blob: Any, *, where: str) -> dict[str, Any]:
    """Read a rank blob back, weights-only, and validate it.

    Returns:
        ``{"train": TrainState, "rng": dict, "data": Any}``.

    Raises:
        UnsafeCheckpointError: The blob's pickle names anything but plain data (nothing is run).
        StateMismatchError: Not a blob this module wrote, or malformed inside.

    Example:
        >>> decode_rank_state(b"junk", where="step 4")
        Traceback (most recent call last):
        ...
        ckpt_lesson.errors.StateMismatchError: step 4: per-rank state does not load weights-only ...
    """
    if not isinstance(blob, bytes):
        raise StateMismatchError(f"{where}: per-rank state is a {type(blob).__name__}, not bytes.")
    try:
        payload = torch.load(io.BytesIO(blob), weights_only=True, map_location="cpu")
    except pickle.UnpicklingError as exc:  # the weights-only unpickler refused a global
        raise UnsafeCheckpointError(
            f"{where}: per-rank state is not plain data ({weights_only_refusal(exc)}); nothing was "
            "executed. Move this save aside and restore an older one."
        ) from exc
    except Exception as exc:  # any other failure means "not our plain-data blob"
        raise StateMismatchError(
            f"{where}: per-rank state does not load weights-only ({type(exc).__name__}: {str(exc)[:200]})."
        ) from exc
    if not isinstance(payload, dict) or set(payload) != {"train", "rng", "data"}:
        raise StateMismatchError(f"{where}: per-rank state must hold exactly train, rng and data.")
    train = TrainState.from_dict(payload["train"], source=where)
    try:
        validate_rng_state(payload["rng"])
    except CheckpointError as exc:
        raise StateMismatchError(f"{where}: {exc}") from exc
    return {"train": train, "rng": payload["rng"], "data": payload["data"]}


def dcp_state_dict(model: Any, optimizer: Any, scheduler: Any, blobs: dict[str, bytes]) -> dict[str, Any]:
    """The state dict this rank hands to ``dcp.save``, or the template ``dcp.load`` fills in place.

    Model and optimizer entries are this run's own (sharded) tensors (see the module doc);
    there is no ``optim`` entry without an optimizer. ``get_state_dict`` on an optimizer that
    never stepped runs one zero-lr step to create its state: harmless, and needed so
    the moments have somewhere to go.

    Args:
        blobs: Per-rank blobs by key: ``{rank_key(rank): blob}`` to save, ``{key: b""}`` to load.

    Example:
        >>> sd = dcp_state_dict(model, opt, None, {rank_key(0): blob})  # doctest: +SKIP
        >>> sorted(sd)  # doctest: +SKIP
        ['model', 'optim', 'rank0_local']
    """
    if optimizer is None:
        out: dict[str, Any] = {"model": get_model_state_dict(model)}
    else:
        model_sd, optim_sd = get_state_dict(model, optimizer)
        out = {"model": model_sd, "optim": optim_sd}
    out.update(blobs)
    if scheduler is not None:
        out["scheduler"] = scheduler.state_dict()
    return out


def apply_shared_state(model: Any, optimizer: Any, scheduler: Any, loaded: dict[str, Any]) -> None:
    """Put loaded model, optimizer and scheduler state into the live objects."""
    if optimizer is None:  # a state-API run without an optimizer (evaluation, EMA-only parts)
        set_model_state_dict(model, loaded["model"])
    else:
        set_state_dict(model, optimizer, model_state_dict=loaded["model"], optim_state_dict=loaded["optim"])
    if scheduler is not None:
        scheduler.load_state_dict(loaded["scheduler"])


def reseed_generators(base: int, step: int, rank: int) -> int:
    """Seed Python, NumPy and torch on this rank from ``(base, step, rank)``; returns the seed.

    For ``on_world_size_change="reseed"`` (see :mod:`.restore`): each rank gets a fresh, distinct
    and reproducible stream (a rerun of the same resume draws the same numbers).

    Example:
        >>> reseed_generators(0, 40, 1) == reseed_generators(0, 40, 1)
        True
    """
    digest = hashlib.sha256(f"ckpt-reseed:{base}:{step}:{rank}".encode()).digest()
    seed = int.from_bytes(digest[:4], "little")
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    return seed


def split_state(state: Mapping[str, Any]) -> tuple[Any, Any, dict[str, Any]]:
    """``(model, optimizer or None, rank parts)`` of a state mapping.

    Returns:
        ``rank parts`` is ``{"kinds": {...}, "objects": {name: live object}, "values": {...}}``:
        every part's kind (the model's and optimizer's too), the other objects and the values.

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
    kinds = {modules[0]: "dcp-model", **{name: "dcp-optim" for name in optims}, **kinds}
    optimizer = state[optims[0]] if optims else None
    return state[modules[0]], optimizer, {"kinds": kinds, "objects": objects, "values": values}


def has_rank_parts(data: Any) -> bool:
    """True when a rank blob's data came from a state-API save."""
    return isinstance(data, dict) and isinstance(data.get(PARTS_KEY), dict)


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
    model, optimizer, parts = split_state(state)
    # This rank's blob gets every other object's state dict, and the values.
    objects = {n: o.state_dict() for n, o in parts["objects"].items()}
    data = {PARTS_KEY: {"kinds": parts["kinds"], "objects": objects, "values": parts["values"]}}
    return model, optimizer, None, TrainState(step=step), data, None if rng in (None, True) else rng


def restore_args(args: tuple[Any, ...]) -> tuple[Mapping[str, Any] | None, Any, Any, Any]:
    """``(state mapping or None, model, optimizer, scheduler)`` for either form of ``restore_latest``.

    Raises:
        CheckpointError: Arguments of neither form (see :func:`split_state`).
    """
    if len(args) == 1 and isinstance(args[0], Mapping):
        model, optimizer, _ = split_state(args[0])
        return args[0], model, optimizer, None
    return (None, *positional_restore_args((*args, None)[:3] if len(args) == 2 else args))
