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

The lesson's pair, :func:`save_checkpoint` / :func:`load_checkpoint`, takes
these positionally; the state API's pair, :func:`save_state` /
:func:`load_state`, takes any mapping of named parts. Both go through one path:
one builder (:mod:`ckpt_lesson.files.payload`), one reader here, one apply
step (:mod:`ckpt_lesson.files.apply`). With ``num_shards`` a save writes the
sharded layout of :mod:`ckpt_lesson.files.sharded` instead of one file.

Loading always uses ``torch.load(weights_only=True)``: a checkpoint is data,
and the full unpickler would run any code a crafted file asks it to. Reading
and verifying the file is :mod:`ckpt_lesson.files.loading` (its
:func:`load_verified_file` is re-exported here); this module decides what the
payload means and applies it.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from ckpt_lesson.errors import CheckpointError, StateMismatchError
from ckpt_lesson.files.apply import Restored, apply_payload, apply_state_payload
from ckpt_lesson.files.atomic import atomic_save
from ckpt_lesson.files.fit import check_model_state
from ckpt_lesson.files.hashing import DEFAULT_ALGO
from ckpt_lesson.files.integrity import FileDigest
from ckpt_lesson.files.loading import load_verified_file, require_footer
from ckpt_lesson.files.mapped_restore import (
    FreshMemory,
    copy_out,
    keep_no_mapped_extra_state,
    load_with_private_copies,
)
from ckpt_lesson.files.payload import build_payload, build_state_payload
from ckpt_lesson.files.schema import CURRENT_SCHEMA, SCHEMA_V1, migrate_payload
from ckpt_lesson.files.shard_index import read_sharded_payload
from ckpt_lesson.files.sharded import ShardedSaveResult, write_state_payload
from ckpt_lesson.files.train_state import BUCKETS, REQUIRES_KEY, TrainState
from ckpt_lesson.files.verify import VerifiedBytes

__all__ = [
    "BUCKETS",
    "REQUIRES_KEY",
    "TrainState",
    "apply_payload",
    "build_payload",
    "check_model_state",
    "load_checkpoint",
    "load_state",
    "load_verified_file",
    "read_checkpoint",
    "read_state_payload",
    "require_footer",
    "save_checkpoint",
    "save_state",
    "write_state_payload",
]

log = logging.getLogger(__name__)


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
    algo: str = DEFAULT_ALGO,
    zip_crc32: bool = False,
) -> FileDigest:
    """Save a complete, resumable checkpoint to one file, atomically.

    Args:
        model: The live model.
        optimizer: The live optimizer.
        scheduler: The live scheduler, or ``None`` for a run without one.
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
        algo: Integrity hash of the footer (see :data:`~ckpt_lesson.files.hashing.ALGORITHMS`).
        zip_crc32: Keep the zip CRC32s, for tools that test zip archives
            (``unzip -t``); off by default, as in :func:`~ckpt_lesson.files.atomic.atomic_save`.

    Returns:
        Size and digest of the file written.

    Raises:
        CheckpointError: ``schema`` is not the current one (checked before
            anything is written: a file our own loader would refuse is no save).
            Also a model, optimizer or scheduler the positional form cannot
            save (``None`` model or optimizer, no ``state_dict()``, a dict of
            models), named by the same check the managers use.

    Example:
        >>> save_checkpoint(model, opt, sched, TrainState(step=12), "ckpt/last.pt")  # doctest: +SKIP
    """
    if schema != CURRENT_SCHEMA:
        hint = " use write_legacy_v1_checkpoint() for a ckpt.v1 file," if schema == SCHEMA_V1 else ""
        raise CheckpointError(
            f"{out_path}: save_checkpoint writes schema {CURRENT_SCHEMA!r} only, got schema={schema!r};"
            f"{hint} or leave schema out."
        )
    payload = build_payload(
        model, optimizer, scheduler, state, extras=extras, data=data, rng=rng, where=f"{out_path}: "
    )
    return atomic_save(payload, out_path, algo=algo, zip_crc32=zip_crc32)


def read_checkpoint(
    path: str | os.PathLike[str] | VerifiedBytes,
    *,
    map_location: str | torch.device = "cpu",
    expected_sha256: str | None = None,
    expected_digest: str | None = None,
    algo: str | None = None,
    mmap_model: bool = False,
) -> dict[str, Any]:
    """Verify, load (weights-only) and migrate a checkpoint file, applying nothing.

    Args:
        path: A file written by :func:`save_checkpoint` (or a legacy v1 file), or
            such a file's bytes already verified in memory (see
            :func:`~ckpt_lesson.files.loading.load_verified_file`).
        map_location: Passed to ``torch.load``.
        expected_sha256: The whole file's sha256 from an older index or
            manifest; checked in the same pass as the footer.
        expected_digest: A recorded whole-file digest (newer records); also checked in
            that pass.
        algo: The algorithm ``expected_digest`` was made with.
        mmap_model: Map the verified file rather than read it (see
            :func:`~ckpt_lesson.files.loading.load_verified_file`) and copy every
            bucket except ``model`` into private memory. The ``model`` tensors
            stay mapped: ``model.load_state_dict`` copies them straight from the
            page cache, which saves reading them into memory first. Apply the
            payload at once and drop it; do not keep its ``model`` tensors.

    Returns:
        The payload, migrated to the current schema, with every bucket present.

    Raises:
        CheckpointError: Missing file; ``CorruptCheckpointError`` for a hash
            mismatch, truncation or unreadable archive; ``UnsafeCheckpointError``
            when the weights-only loader refuses it; ``SchemaError`` for a
            missing or unknown schema; ``StateMismatchError`` for a missing bucket.
    """
    if not isinstance(path, VerifiedBytes) and Path(path).is_dir():
        raise CheckpointError(
            f"{path}: is a directory; use load_sharded_checkpoint() for sharded checkpoints."
        )
    payload, digest = _read_file(path, map_location, expected_sha256, expected_digest, algo, mmap_model)
    payload = migrate_payload(payload, source=str(path))
    if not digest.has_footer:
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


def _read_file(
    path: Any, map_location: Any, sha256: Any, digest: Any, algo: Any, mmap: bool
) -> tuple[Any, FileDigest]:
    """Verify and load one file (the one reader of both call forms); a footer is required from ckpt.v2 on."""
    payload, got = load_with_private_copies(
        path,
        _private_except_modules,
        mmap=mmap,
        map_location=map_location,
        expected_sha256=sha256,
        expected_digest=digest,
        algo=algo,
    )
    require_footer(payload, got, str(path))
    return payload, got


def _private_except_modules(payload: Any, fresh: FreshMemory) -> Any:
    """Copy every mapped tensor out of the mapping except modules' (``load_state_dict`` copies those).

    Optimizer moments would otherwise stay mapped: ``Optimizer.load_state_dict`` keeps a tensor that
    already has the parameter's dtype and device instead of copying it; so would plain values and the
    RNG. A module's extra state is handed to ``set_extra_state`` as it is, and a module may keep it:
    copied out too, or a kept tensor would keep the file mapped (SIGBUS if it is truncated later).
    The modules are the positional form's ``model`` bucket, or the parts a state-API save lists.
    """
    if not isinstance(payload, dict):
        return copy_out(payload, fresh=fresh)
    objects = payload.get("objects")
    if not isinstance(objects, dict):  # a positional payload: its one module is the "model" bucket
        return _copy_all_but(payload, {"model"}, fresh)
    modules = payload.get("modules")
    modules = {m for m in modules if isinstance(m, str)} if isinstance(modules, list) else set()
    rest = {k: v for k, v in payload.items() if k != "objects"}
    return {**copy_out(rest, fresh=fresh), "objects": _copy_all_but(objects, modules, fresh)}


def _copy_all_but(tree: dict[str, Any], modules: set[str], fresh: FreshMemory) -> dict[str, Any]:
    keep = keep_no_mapped_extra_state
    return {
        k: keep({"model": v})["model"] if k in modules else copy_out(v, fresh=fresh) for k, v in tree.items()
    }


def load_checkpoint(
    path: str | os.PathLike[str],
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    *,
    map_location: str | torch.device = "cpu",
    expected_sha256: str | None = None,
    expected_digest: str | None = None,
    algo: str | None = None,
    allow_dtype_cast: bool = False,
    mmap: bool = True,
) -> TrainState:
    """Load a checkpoint written by :func:`save_checkpoint` and restore everything.

    Args:
        path: The checkpoint file.
        model: Built exactly as in the saved run; its state is replaced.
        optimizer: Built exactly as in the saved run; its state is replaced.
        scheduler: Built exactly as in the saved run; its state is replaced.
        map_location: Passed to ``torch.load``.
        expected_sha256: Optional whole-file sha256 to check against.
        expected_digest: Optional whole-file digest to check against.
        algo: The algorithm ``expected_digest`` was made with.
        allow_dtype_cast: Accept weights saved in another dtype (see :func:`apply_payload`).
        mmap: Copy the weights into the model straight from the verified file's
            mapping instead of reading them into memory first (see
            :func:`read_checkpoint`); every tensor that outlives the call is a
            copy. On by default: measured here at 0.88x (128 MB) and 0.94x
            (512 MB) the time of a plain ``torch.load`` + ``load_state_dict``
            restore, against 1.15x for reading the verified file into memory
            (``benchmarks/results/``). ``False`` reads the file into memory.

    Returns:
        The saved :class:`TrainState`; training continues at ``state.step + 1``.

    Raises:
        CheckpointError: See :func:`read_checkpoint` and :func:`apply_payload`
            (which names a ``None`` model or optimizer, an object without
            ``state_dict()`` or a dict of models, as the managers do).

    Example:
        >>> state = load_checkpoint("ckpt/last.pt", model, opt, sched)  # doctest: +SKIP
    """
    payload = read_checkpoint(
        path,
        map_location=map_location,
        expected_sha256=expected_sha256,
        expected_digest=expected_digest,
        algo=algo,
        mmap_model=mmap,
    )
    return apply_payload(
        payload, model, optimizer, scheduler, source=str(path), allow_dtype_cast=allow_dtype_cast
    )


def save_state(
    path: str | os.PathLike[str],
    step: int,
    state: Mapping[str, Any],
    *,
    rng: bool | dict[str, Any] | None = True,
    num_shards: int | None = None,
    algo: str = DEFAULT_ALGO,
    zip_crc32: bool = False,
) -> FileDigest | ShardedSaveResult:
    """Save ``state`` (a mapping of named parts) at ``step``, atomically and with its integrity record.

    Args:
        path: The file (or, with ``num_shards``, a new directory).
        step: The global step.
        state: ``{name: object with state_dict()/load_state_dict(), or plain value}``.
        rng: ``True`` captures the generators now, ``False`` saves none, or a
            dict from ``capture_rng_state()`` taken earlier.
        num_shards: ``None`` for one file; else the sharded layout with that many shard files.
        algo: Integrity hash.
        zip_crc32: Keep the zip CRC32s ``torch.save`` writes (off: ``torch.load`` never checks them).

    Returns:
        The file's digest, or the sharded save's :class:`~ckpt_lesson.files.sharded.ShardedSaveResult`.

    Raises:
        CheckpointError: Bad parts or step (see ``build_state_payload``), named before anything is written.

    Example:
        >>> save_state("ckpt/last.pt", 120, {"model": model, "best": 0.31})  # doctest: +SKIP
    """
    payload = build_state_payload(step, state, rng=rng)
    return write_state_payload(payload, path, num_shards=num_shards, algo=algo, zip_crc32=zip_crc32)


def read_state_payload(
    path: str | os.PathLike[str] | VerifiedBytes,
    *,
    map_location: Any = "cpu",
    expected_digest: str | None = None,
    algo: str | None = None,
    mmap: bool = False,
) -> dict[str, Any]:
    """Verify and load (weights-only) a save of either call form: one file, or a sharded directory.

    Every file is checked against its integrity record (and the index) before
    anything is unpickled; the payload is returned as saved, nothing applied.

    Raises:
        CheckpointError: Missing, damaged (``CorruptCheckpointError``), or unsafe files.
    """
    if not isinstance(path, VerifiedBytes) and Path(path).is_dir():
        return read_sharded_payload(path, map_location=map_location)
    return _read_file(path, map_location, None, expected_digest, algo, mmap)[0]


def load_state(
    path: str | os.PathLike[str],
    state: Mapping[str, Any],
    *,
    strict: bool = True,
    map_location: Any = "cpu",
    allow_dtype_cast: bool = False,
) -> Restored:
    """Verify a save from :func:`save_state` (or a positional ``save_checkpoint`` file) and restore it.

    Args:
        path: The file or sharded directory.
        state: The live ``{name: part}`` mapping; objects are restored in place.
        strict: Refuse parts present on one side only (default); ``False`` ignores them.
        map_location: As for ``torch.load``.
        allow_dtype_cast: Accept module tensors saved in another dtype.

    Returns:
        A :class:`~ckpt_lesson.files.apply.Restored`: ``step``, ``values``, ``rng``, ``path``.

    Raises:
        CheckpointError: Damaged or unsafe files; ``StateMismatchError`` naming
            the part that does not fit (nothing is changed then).

    Example:
        >>> restored = load_state("ckpt/last.pt", {"model": model, "best": None})  # doctest: +SKIP
        >>> start, best = restored.step + 1, restored.values["best"]  # doctest: +SKIP
    """
    payload = read_state_payload(path, map_location=map_location)
    restored = apply_state_payload(
        payload, state, source=str(path), strict=strict, allow_dtype_cast=allow_dtype_cast
    )
    restored.path = Path(path)
    return restored
