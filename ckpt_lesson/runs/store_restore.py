"""Fetching one committed save from an object store, verified before anything is unpickled.

The rule of the whole package holds here too: ``torch.load`` never sees bytes
that have not been checked. A restore from a store therefore goes

1. marker (it must name this step) -> manifest (it must hash to the marker's digest);
2. every part streamed down in ranged chunks, hashed on the way, written into
   a fresh local folder; a part whose size or digest differs is damage;
3. only then does the ordinary local restore open the folder (which checks it again).

A part that vanished (deleted by a retention pass during the restore, or
never uploaded) is ``IncompleteCheckpointError``; the caller falls back to the
previous committed save. Not reaching the store is ``LoadEnvironmentError``
(raised by the storage backend) and is never taken for damage.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ckpt_lesson.errors import CorruptCheckpointError, IncompleteCheckpointError
from ckpt_lesson.files.hashing import new_hasher, part_digest
from ckpt_lesson.files.storage import Storage
from ckpt_lesson.files.storage_transfer import RANGE_BYTES
from ckpt_lesson.runs.scan import MANIFEST_NAME, read_manifest, step_dir_name
from ckpt_lesson.runs.store_commit import read_commit

__all__ = ["fetch_verified", "read_verified", "verify_store_save"]

_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
#: Ranged GETs this large, several in flight (files/storage_transfer.py): few requests, bounded memory.
DOWNLOAD_CHUNK_BYTES = RANGE_BYTES

Sink = Callable[[memoryview], None]


def _stream_part(storage: Storage, key: str, part: dict[str, Any], sink: Sink) -> None:
    """Stream one part down, hashing every block in order and handing it to ``sink``; check it all.

    ``sink`` sees only bytes within the recorded size; the check comes after the last
    block, so whatever ``sink`` kept is unverified until this returns.
    """
    algo, want = part_digest(part)
    hasher, size = new_hasher(algo), 0
    try:
        for chunk in storage.iter_chunks(key, chunk=DOWNLOAD_CHUNK_BYTES, size=part["bytes"]):
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


def _fetch_part(storage: Storage, key: str, dest: Path, part: dict[str, Any]) -> None:
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW, 0o600)
    with os.fdopen(fd, "wb") as out:
        _stream_part(storage, key, part, out.write)


def _checked_manifest(storage: Storage, step: int, marker: dict[str, Any], raw: bytes) -> dict[str, Any]:
    """The manifest ``raw`` parsed and sealed-checked like a local one, and matched to the marker."""
    with tempfile.TemporaryDirectory(prefix="ckpt-lesson-manifest-") as folder:
        fd = os.open(Path(folder) / MANIFEST_NAME, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW, 0o600)
        with os.fdopen(fd, "wb") as out:
            out.write(raw)
        manifest = read_manifest(Path(folder))  # schema, seal, part names that stay inside the folder
    if manifest["step"] != step or manifest["save_id"] != marker["save_id"]:
        raise CorruptCheckpointError(
            f"{storage.where(step_dir_name(step))}: the manifest names step {manifest['step']} / save "
            f"{manifest['save_id']}, the marker step {step} / save {marker['save_id']}; "
            "restore an older save."
        )
    return manifest


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
    marker, raw = read_commit(storage, step)
    target = cache / step_dir_name(step)
    shutil.rmtree(target, ignore_errors=True)
    target.mkdir(parents=True)
    try:
        fd = os.open(target / MANIFEST_NAME, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW, 0o600)
        with os.fdopen(fd, "wb") as out:
            out.write(raw)
        manifest = _checked_manifest(storage, step, marker, raw)
        attempt = f"{step_dir_name(step)}/{marker['save_id']}"
        for part in manifest["parts"]:
            _fetch_part(storage, f"{attempt}/{part['file']}", target / part["file"], part)
    except BaseException:
        shutil.rmtree(target, ignore_errors=True)
        raise
    return manifest


def read_verified(storage: Storage, step: int) -> tuple[dict[str, Any], dict[str, bytearray]]:
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
    marker, raw = read_commit(storage, step)
    manifest = _checked_manifest(storage, step, marker, raw)
    attempt = f"{step_dir_name(step)}/{marker['save_id']}"
    parts: dict[str, bytearray] = {}
    for part in manifest["parts"]:
        buf, filled = bytearray(part["bytes"]), [0]

        def fill(block: memoryview, buf: bytearray = buf, filled: list[int] = filled) -> None:
            buf[filled[0] : filled[0] + len(block)] = block
            filled[0] += len(block)

        _stream_part(storage, f"{attempt}/{part['file']}", part, fill)
        parts[part["file"]] = buf
    return manifest, parts


def verify_store_save(storage: Storage, step: int) -> dict[str, Any]:
    """Hash every byte of committed save ``step`` as it streams by, keeping none of it (for ``scan``).

    Returns:
        The save's manifest.

    Raises:
        CorruptCheckpointError, IncompleteCheckpointError, LoadEnvironmentError: As :func:`fetch_verified`.

    Example:
        >>> verify_store_save(store, 240)["step"]  # doctest: +SKIP
        240
    """
    marker, raw = read_commit(storage, step)
    manifest = _checked_manifest(storage, step, marker, raw)
    attempt = f"{step_dir_name(step)}/{marker['save_id']}"
    for part in manifest["parts"]:
        _stream_part(storage, f"{attempt}/{part['file']}", part, lambda block: None)
    return manifest
