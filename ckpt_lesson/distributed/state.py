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
"""

from __future__ import annotations

import hashlib
import io
import pickle
import random
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
from ckpt_lesson.files.rng import validate_rng_state

from .safe_metadata import weights_only_refusal

__all__ = [
    "apply_shared_state",
    "build_load_template",
    "build_save_state",
    "decode_rank_state",
    "encode_rank_state",
    "rank_key",
    "reseed_generators",
]


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


def _model_and_optim(model: Any, optimizer: Any) -> dict[str, Any]:
    """``{"model": ..., "optim": ...}`` from torch's helpers; no ``optim`` entry without an optimizer."""
    if optimizer is None:
        return {"model": get_model_state_dict(model)}
    model_sd, optim_sd = get_state_dict(model, optimizer)
    return {"model": model_sd, "optim": optim_sd}


def build_save_state(model: Any, optimizer: Any, scheduler: Any, *, rank: int, blob: bytes) -> dict[str, Any]:
    """The state dict this rank hands to ``dcp.save``.

    Example:
        >>> sd = build_save_state(model, opt, None, rank=0, blob=blob)  # doctest: +SKIP
        >>> sorted(sd)  # doctest: +SKIP
        ['model', 'optim', 'rank0_local']
    """
    out: dict[str, Any] = {**_model_and_optim(model, optimizer), rank_key(rank): blob}
    if scheduler is not None:
        out["scheduler"] = scheduler.state_dict()
    return out


def build_load_template(
    model: Any, optimizer: Any, scheduler: Any, *, blob_keys: list[str]
) -> dict[str, Any]:
    """A state dict of the right shape for ``dcp.load`` to fill in place.

    Model and optimizer entries are this run's own (sharded) tensors, so DCP
    reads exactly the slices each rank holds, whatever the saved world size.
    ``get_state_dict`` on an optimizer that never stepped runs one zero-lr step
    to create its state: harmless, and needed so the moments have somewhere to go.
    """
    out: dict[str, Any] = _model_and_optim(model, optimizer)
    out.update({key: b"" for key in blob_keys})
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

    Used when the world size changed and the saved per-rank streams cannot be
    mapped onto the new ranks: each rank gets a fresh, distinct and
    reproducible stream instead (a rerun of the same resume draws the same numbers).

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
