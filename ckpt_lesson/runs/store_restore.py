"""Fetching one committed save from an object store, verified before anything is unpickled.

The rule of the whole package holds here too: ``torch.load`` never sees bytes
that have not been checked. A restore from a store therefore goes

1. marker (it must name this step) -> manifest (it must hash to the marker's digest);
2. every part streamed down in ranged chunks, hashed on the way, kept in
   memory (:func:`open_verified`, what ``restore_latest`` uses); a part whose
   size or digest differs is damage;
3. only then does :func:`ckpt_lesson.runs.restore.load_save` load the parts,
   through the same archive check and weights-only load as a local file, without
   hashing them again (a sharded save is the exception: :func:`open_verified`).

A part that vanished (deleted by a retention pass, or never uploaded) is
``IncompleteCheckpointError``, damage like a wrong digest (what the restore does
with damage: :mod:`ckpt_lesson.runs.restore`).

A multi-rank save (DCP's files, committed by the same marker) is read by
:mod:`ckpt_lesson.distributed.verify`; only :func:`read_committed_manifest`
(its manifest, either kind) and :func:`verify_store_save` (``scan``) serve both.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

from ckpt_lesson.errors import CorruptCheckpointError, IncompleteCheckpointError
from ckpt_lesson.files.hashing import new_hasher, part_digest
from ckpt_lesson.files.safe_read import parse_json_text
from ckpt_lesson.files.storage import Storage
from ckpt_lesson.files.storage_transfer import RANGE_BYTES
from ckpt_lesson.files.verify import VerifiedBytes
from ckpt_lesson.runs.layout import (
    DCP_MANIFEST_SCHEMA,
    MANIFEST_KINDS,
    MANIFEST_NAME,
    check_manifest,
    step_dir_name,
)
from ckpt_lesson.runs.restore import SaveSource, VerifiedSave
from ckpt_lesson.runs.store_commit import read_commit

__all__ = ["fetch_verified", "open_verified", "read_committed_manifest", "read_verified", "verify_store_save"]

_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)


def _stream_part(
    storage: Storage, key: str, part: dict[str, Any], sink: Callable[[memoryview], None]
) -> None:
    """Stream one part down, hashing every block in order and handing it to ``sink``; check it all.

    ``sink`` sees only bytes within the recorded size; the check comes after the last
    block, so whatever ``sink`` kept is unverified until this returns.
    """
    algo, want = part_digest(part)
    hasher, size = new_hasher(algo), 0
    try:
        # Ranged GETs this large, several in flight (files/storage_transfer.py): few requests, bounded memory.
        for chunk in storage.iter_chunks(key, chunk=RANGE_BYTES, size=part["bytes"]):
            size += len(chunk)
            if size > part["bytes"]:
                break  # longer than recorded: damage, and no reason to download the rest
            hasher.update(chunk)
            sink(memoryview(chunk))
    except FileNotFoundError:
        raise IncompleteCheckpointError(
            f"{storage.where(key)}: missing (deleted, or never uploaded); restore an older save."
        ) from None
    if size != part["bytes"] or hasher.hexdigest() != want:
        raise CorruptCheckpointError(
            f"{storage.where(key)}: {size} bytes that do not match the manifest "
            f"({part['bytes']} bytes, {algo} {want}); it is damaged. Restore an older save."
        )


def read_committed_manifest(
    storage: Storage, step: int, *, multi_rank: bool | None = None
) -> tuple[dict[str, Any], bytes, str]:
    """Read ``step``'s marker and the manifest it names, checked; nothing else is downloaded.

    Args:
        storage: The run's store.
        step: A step with a ``COMMIT`` marker.
        multi_rank: ``True``: only a multi-rank (DCP) manifest is accepted; ``False``: only a
            single-process one; ``None`` (default): either, by its schema (for ``scan``).

    Returns:
        ``(manifest, raw_bytes, attempt)``: ``attempt`` is the key prefix of the save's objects,
        ``step-XXXXXXXX/<save_id>``.

    Raises:
        IncompleteCheckpointError: No marker, or the manifest it names is missing.
        CorruptCheckpointError: A stale or damaged marker, a manifest that does not match its
            digest or seal, or one that names another step or save.
        SchemaError: A manifest of the other kind than ``multi_rank`` asks for.
        UnsafeCheckpointError: A part name that would leave the save's prefix.
        LoadEnvironmentError: The store cannot be reached.

    Example:
        >>> manifest, raw, attempt = read_committed_manifest(store, 40)  # doctest: +SKIP
        >>> manifest["layout"], attempt  # doctest: +SKIP
        ('dcp', 'step-00000040/5be0c1...')
    """
    marker, raw = read_commit(storage, step)
    attempt = f"{step_dir_name(step)}/{marker['save_id']}"
    where = storage.where(f"{attempt}/{MANIFEST_NAME}")
    manifest = parse_json_text(raw, where=where)
    if multi_rank is None:
        multi_rank = isinstance(manifest, dict) and manifest.get("schema") == DCP_MANIFEST_SCHEMA
    if multi_rank:  # seal, then fields (part names plain, .metadata listed): its own module's checks
        MANIFEST_KINDS[DCP_MANIFEST_SCHEMA].check(manifest, where)
    else:  # schema, seal, part names that stay inside the folder: exactly as for a local manifest
        manifest = check_manifest(manifest, where=where)
    if manifest["step"] != step or manifest["save_id"] != marker["save_id"]:
        raise CorruptCheckpointError(
            f"{storage.where(step_dir_name(step))}: the manifest names step {manifest['step']} / save "
            f"{manifest['save_id']}, the marker step {step} / save {marker['save_id']}; "
            "restore an older save."
        )
    return manifest, raw, attempt


def fetch_verified(storage: Storage, step: int, cache: Path) -> dict[str, Any]:
    """Download committed save ``step`` into ``cache/step-XXXXXXXX``, verifying every byte.

    Args:
        storage: The run's store.
        step: A step with a ``COMMIT`` marker.
        cache: A local folder; the save's folder inside it is replaced.

    Returns:
        The save's manifest.

    Raises:
        CorruptCheckpointError: A stale or damaged marker, a manifest or part
            that does not match (the local folder is removed again).
        IncompleteCheckpointError: The manifest or a part is missing.
        LoadEnvironmentError: The store cannot be reached.

    Example:
        >>> manifest = fetch_verified(store, 240, Path("/tmp/cache"))  # doctest: +SKIP
    """
    return _fetch_into(storage, step, cache, *read_committed_manifest(storage, step, multi_rank=False))


def _fetch_into(
    storage: Storage, step: int, cache: Path, manifest: dict[str, Any], raw: bytes, attempt: str
) -> dict[str, Any]:
    target = cache / step_dir_name(step)
    shutil.rmtree(target, ignore_errors=True)
    target.mkdir(parents=True)
    try:
        with _create(target / MANIFEST_NAME) as out:
            out.write(raw)
        for part in manifest["parts"]:
            with _create(target / part["file"]) as out:
                _stream_part(storage, f"{attempt}/{part['file']}", part, out.write)
    except BaseException:
        shutil.rmtree(target, ignore_errors=True)
        raise
    return manifest


def _create(dest: Path) -> BinaryIO:
    """A new file to write: created fresh (``O_EXCL``), never through a link planted in the cache."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    return os.fdopen(os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW, 0o600), "wb")


def _read_parts(storage: Storage, attempt: str, manifest: dict[str, Any]) -> dict[str, VerifiedBytes]:
    """Every part of the save streamed into memory and verified; each one's bytes joined once."""
    parts: dict[str, VerifiedBytes] = {}
    for part in manifest["parts"]:
        blocks: list[memoryview] = []
        # Views of the downloaded blocks (immutable bytes): the join below is the one copy, and
        # a bytes object lets io.BytesIO read it in place later (a bytearray would be copied again).
        _stream_part(storage, f"{attempt}/{part['file']}", part, blocks.append)
        algo, want = part_digest(part)
        parts[part["file"]] = VerifiedBytes(
            b"".join(blocks), storage.where(f"{attempt}/{part['file']}"), algo, want
        )
    return parts


def read_verified(storage: Storage, step: int) -> tuple[dict[str, Any], dict[str, bytes]]:
    """Download committed save ``step`` into memory, verifying every byte; no part is written locally.

    Args:
        storage: The run's store.
        step: A step with a ``COMMIT`` marker.

    Returns:
        ``(manifest, {part file name: its verified bytes})``; hand a part to
        ``torch.load(io.BytesIO(...), weights_only=True)`` only after this returned.

    Raises:
        CorruptCheckpointError: As :func:`fetch_verified`.
        IncompleteCheckpointError: The manifest or a part is missing.
        LoadEnvironmentError: The store cannot be reached.

    Example:
        >>> manifest, parts = read_verified(store, 240)  # doctest: +SKIP
        >>> torch.load(io.BytesIO(parts["checkpoint.pt"]), weights_only=True)  # doctest: +SKIP
    """
    manifest, _, attempt = read_committed_manifest(storage, step, multi_rank=False)
    return manifest, {name: part.data for name, part in _read_parts(storage, attempt, manifest).items()}


def open_verified(storage: Storage, step: int, cache: Path) -> SaveSource:
    """Committed save ``step``, verified, as the restore loaders take it: in memory where they can.

    A single-file save (the default layout, positional or state API) comes back
    as a :class:`~ckpt_lesson.runs.restore.VerifiedSave`: nothing is written
    locally and nothing is hashed twice. A sharded save's loaders read a folder,
    so it is fetched into ``cache/step-XXXXXXXX`` (:func:`fetch_verified`) and
    that folder is returned (the local restore checks it once more); the caller
    removes it after the restore.

    Args:
        storage: The run's store.
        step: A step with a ``COMMIT`` marker.
        cache: Where a sharded save is downloaded to.

    Returns:
        The verified save in memory, or the folder of a verified sharded save.

    Raises:
        CorruptCheckpointError, IncompleteCheckpointError, LoadEnvironmentError: As :func:`fetch_verified`.

    Example:
        >>> source = open_verified(store, 240, Path("/tmp/cache"))  # doctest: +SKIP
        >>> manifest, state = load_save(source, 240, (model, opt, sched), ...)  # doctest: +SKIP
    """
    manifest, raw, attempt = read_committed_manifest(storage, step, multi_rank=False)
    if manifest["layout"] != "single":
        _fetch_into(storage, step, cache, manifest, raw, attempt)
        return cache / step_dir_name(step)
    name = step_dir_name(step)
    return VerifiedSave(name, storage.where(name), manifest, _read_parts(storage, attempt, manifest))


def verify_store_save(storage: Storage, step: int) -> dict[str, Any]:
    """Hash every byte of committed save ``step`` as it streams by, keeping none of it (for ``scan``).

    Either kind of save: a single-process one, or a multi-rank one (DCP's
    ``__R_N.distcp`` objects of every rank and its ``.metadata``, hashed like any
    other object and never unpickled). Every listed object is checked, so the
    error names all that are damaged or missing, not just the first.

    Args:
        storage: The run's store.
        step: A step with a ``COMMIT`` marker.

    Returns:
        The save's manifest.

    Raises:
        IncompleteCheckpointError: No marker or manifest, or only missing objects.
        CorruptCheckpointError: A stale or damaged marker or manifest, or an object whose size
            or digest differs (missing ones are named in the same message).
        SchemaError, UnsafeCheckpointError: As :func:`read_committed_manifest`.
        LoadEnvironmentError: The store cannot be reached.

    Example:
        >>> verify_store_save(store, 240)["step"]  # doctest: +SKIP
        240
    """
    manifest, _, attempt = read_committed_manifest(storage, step)
    missing, damaged = [], []
    for part in manifest["parts"]:
        try:
            _stream_part(storage, f"{attempt}/{part['file']}", part, lambda block: None)
        except IncompleteCheckpointError as exc:
            missing.append(str(exc))
        except CorruptCheckpointError as exc:
            damaged.append(str(exc))
    if damaged:
        raise CorruptCheckpointError("; ".join(damaged + missing))
    if missing:
        raise IncompleteCheckpointError("; ".join(missing))
    return manifest
