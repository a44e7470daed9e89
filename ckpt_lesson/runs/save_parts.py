"""The middle of a managed save: write the parts, describe them, check them.

:meth:`CheckpointManager.save <ckpt_lesson.runs.manager.CheckpointManager.save>`
reads as the protocol; the steps that touch the payload live here, the same for both
call forms (:func:`stage_save`, :func:`stage_payload_save`), which differ only in their
writer and in what the manifest says the save covers. Each part's size and digest are
taken *while* its bytes are written, never from a re-read.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

from ckpt_lesson.errors import CheckpointError, CorruptCheckpointError
from ckpt_lesson.files.atomic import atomic_write_json, fsync_dir
from ckpt_lesson.files.checkpoint import BUCKETS, TrainState, save_checkpoint, write_state_payload
from ckpt_lesson.files.payload import PARTS_SCHEMA
from ckpt_lesson.files.record_seal import seal_record
from ckpt_lesson.files.schema import CURRENT_SCHEMA, MANIFEST_SCHEMA, current_env
from ckpt_lesson.files.shard_index import INDEX_NAME
from ckpt_lesson.files.sharded import save_sharded_checkpoint
from ckpt_lesson.files.verify import check_written_part, verify_mode
from ckpt_lesson.runs.layout import MANIFEST_NAME, inspect_save, read_manifest
from ckpt_lesson.runs.manager_config import ManagerConfig

__all__ = ["refuse_if_already_saved", "stage_payload_save", "stage_save"]

#: ``emit(name, **info)``: the manager's event hook, bound to its ``on_event``.
Emit = Callable[..., None]


def refuse_if_already_saved(target: Path, step: int) -> None:
    """Raise if ``target`` (the published folder of ``step``) already holds a save that verifies."""
    if target.exists() and inspect_save(target)[0].ok:
        raise CheckpointError(
            f"step {step} is already saved in {target} and verifies; a save is never overwritten. "
            "Save a later step, or delete that folder by hand if you really mean to replace it. A run "
            "restarted after a crash must call restore_latest first, so it continues after its last save."
        )


def build_manifest(
    config: ManagerConfig,
    state: TrainState | dict[str, Any],
    parts: list[dict[str, Any]],
    *,
    payload_schema: str = CURRENT_SCHEMA,
    covers: list[str] | None = None,
) -> dict[str, Any]:
    """The commit record of one save: its parts, what it covers, and what a resume must match.

    ``state`` is the positional save's :class:`TrainState`, or ``{"step": N}`` for a
    state-API save, whose ``covers`` lists its part names (plus ``rng`` when saved).
    """
    if isinstance(state, TrainState):
        state = {"step": state.step, "epoch": state.epoch, "batch_in_epoch": state.batch_in_epoch}
    manifest = {
        "schema": MANIFEST_SCHEMA,
        "save_id": uuid.uuid4().hex,
        "step": state["step"],
        "payload_schema": payload_schema,
        "layout": config.layout,
        "parts": parts,
        "covers": list(BUCKETS) if covers is None else covers,
        "state": state,
        "env": current_env(),
        "data": dict(config.data or {}),
        "metadata": dict(config.metadata),
        "created_at": time.time(),
    }
    if config.num_shards is not None:
        manifest["num_shards"] = config.num_shards
    # Sealed last: the record's own checksum, so a flipped bit in it reads as damage, not as a contract.
    return seal_record(manifest)


def stage_save(
    staging: Path,
    config: ManagerConfig,
    model: Any,
    optimizer: Any,
    scheduler: Any,
    state: TrainState,
    *,
    extras: Any,
    rng: dict[str, Any] | None,
    emit: Emit,
) -> dict[str, Any]:
    """Everything a save does inside its staging folder: parts, sealed manifest, optional re-read.

    Returns:
        The manifest as written.

    Raises:
        CheckpointError: From the payload check or the writers (nothing is published then).
        CorruptCheckpointError: ``verify_on_save`` found bytes that differ from what was written.

    Example:
        >>> manifest = stage_save(staging, mgr.config, model, opt, sched, state,  # doctest: +SKIP
        ...                       extras=None, rng=None, emit=lambda name, **info: None)
    """

    def write(target: Path, **options: Any) -> Any:
        save = save_checkpoint if config.num_shards is None else save_sharded_checkpoint
        return save(
            model, optimizer, scheduler, state, target, extras=extras, data=config.data, rng=rng, **options
        )

    return _stage(staging, config, state.step, write, emit, partial(build_manifest, config, state))


def stage_payload_save(
    staging: Path, config: ManagerConfig, payload: dict[str, Any], *, emit: Emit
) -> dict[str, Any]:
    """:func:`stage_save` for a state-API payload (from ``build_state_payload`` or an async snapshot).

    Returns:
        The manifest as written.
    """
    step = payload["step"]
    covers = [*payload["kinds"], *(["rng"] if payload["rng"] is not None else [])]
    manifest_of = partial(build_manifest, config, {"step": step}, payload_schema=PARTS_SCHEMA, covers=covers)
    return _stage(staging, config, step, partial(write_state_payload, payload), emit, manifest_of)


def _stage(
    staging: Path,
    config: ManagerConfig,
    step: int,
    write: Callable[..., Any],
    emit: Emit,
    manifest_of: Callable[[list[dict[str, Any]]], dict[str, Any]],
) -> dict[str, Any]:
    """Parts, then the manifest (written, fsynced), then the optional re-read.

    ``write(target, **options)`` is the payload's writer (positional or state API), called with
    ``staging/checkpoint.pt`` or, sharded, with ``staging`` and ``num_shards`` and ``layout``.
    """
    single = config.num_shards is None
    emit("part_begin", step=step, file="checkpoint.pt" if single else "*")
    options: dict[str, Any] = {"algo": config.hash_algo, "zip_crc32": config.zip_crc32}
    if single:
        parts = [{"file": "checkpoint.pt", **write(staging / "checkpoint.pt", **options).record()}]
    else:
        # The manifest's part records of a sharded save: every shard, meta.pt, then index.json.
        result = write(staging, num_shards=config.num_shards, layout=config.shard_layout, **options)
        fields = ("bytes", "algo", "digest")
        parts = [{"file": f["name"], **{k: f[k] for k in fields}} for f in [*result.files, result.meta]]
        parts.append({"file": INDEX_NAME, **result.index.record()})
    for part in parts:
        emit("part_written", step=step, **part)
    manifest = manifest_of(parts)
    emit("parts_complete", step=step, files=[p["file"] for p in parts])
    atomic_write_json(manifest, staging / MANIFEST_NAME)
    fsync_dir(staging)
    emit("manifest_written", step=step, save_id=manifest["save_id"])
    mode = verify_mode(config.verify_on_save)  # "writer" or "device": see files/verify.py
    if mode is not None:
        found = [p for p in (check_written_part(staging / part["file"], part, mode) for part in parts) if p]
        if found:
            raise CorruptCheckpointError(
                f"save of {staging.name} re-read differently from what was written: {'; '.join(found)}. "
                "Nothing was published; check the disk and the code that writes the parts."
            )
        # The manifest itself is parsed back too: a save whose commit record cannot be read is no save.
        read_manifest(staging)
        emit("verified", step=step, save_id=manifest["save_id"], mode=mode)
    return manifest
