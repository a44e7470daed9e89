"""Publish by commit marker: a multi-rank save without a rename, for storage that cannot rename.

With ``publish="rename"`` (the default) a save is written into a staging
folder and becomes visible by one atomic rename. Object stores (S3, GCS) have
no atomic rename: fsspec's ``rename`` is a copy and a delete, and a kill in
between leaves half a save under the final name. ``publish="marker"`` instead
writes every file straight into the final ``step-XXXXXXXX/`` folder, then the
manifest, and *last* a small ``commit.json`` that names the manifest's digest::

    {"schema": "ckpt.commit.dcp.v1", "step": 40, "save_id": "5c1e...",
     "manifest": {"algo": "xxh3_128", "digest": "..."}, "record_digest": {...}}

A reader counts such a folder only when the marker is there and names exactly
the manifest beside it (its manifest says ``"publish": "marker"``, so the
reader knows to ask). A folder without the marker is an unfinished save: it is
skipped, and once its writer is gone (its ``.marker-lock`` is free) the
manager removes it, as it removes a dead writer's staging folder, unless it
holds a manifest: that one is quarantined (:mod:`ckpt_lesson.runs.marker_cleanup`).
The lock is removed once the marker is written.
"""

from __future__ import annotations

import fcntl
import logging
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from ckpt_lesson.errors import CheckpointError, CorruptCheckpointError, IncompleteCheckpointError
from ckpt_lesson.files.atomic import atomic_write_json, fsync_dir
from ckpt_lesson.files.hashing import hash_bytes
from ckpt_lesson.files.record_seal import seal_record, verify_record_seal
from ckpt_lesson.files.safe_read import parse_json_text, read_regular_file
from ckpt_lesson.files.side_files import open_beside

__all__ = [
    "COMMIT_MARKER",
    "MARKER_LOCK",
    "MARKER_SCHEMA",
    "PUBLISH_MODES",
    "check_commit_marker",
    "lock_is_free",
    "open_marker_folder",
    "write_commit_marker",
]

COMMIT_MARKER = "commit.json"
MARKER_SCHEMA = "ckpt.commit.dcp.v1"
#: Held (flock) by the writer of a marker-mode folder while it writes; free once it is gone.
MARKER_LOCK = ".marker-lock"
#: ``DistributedCheckpointManager(publish=...)``: how a finished save becomes visible.
PUBLISH_MODES = ("rename", "marker")
_MAX_MARKER_BYTES = 64 << 10

log = logging.getLogger("ckpt_lesson.distributed")


def write_commit_marker(folder: Path, manifest: dict[str, Any], manifest_raw: bytes) -> dict[str, Any]:
    """Write ``folder/commit.json`` naming the manifest's digest, durably: the save's commit.

    Args:
        folder: The save folder, manifest already written and fsynced.
        manifest: The manifest (for its step, save id and algorithm).
        manifest_raw: The manifest file's exact bytes.

    Returns:
        The marker record written.

    Example:
        >>> write_commit_marker(run / "step-00000040", manifest, raw)  # doctest: +SKIP
    """
    algo = manifest["parts"][0]["algo"]
    marker = seal_record(
        {
            "schema": MARKER_SCHEMA,
            "step": manifest["step"],
            "save_id": manifest["save_id"],
            "manifest": hash_bytes(manifest_raw, algo),
        }
    )
    atomic_write_json(marker, folder / COMMIT_MARKER)  # fsyncs the file and the folder
    return marker


def check_commit_marker(folder: Path, manifest: dict[str, Any], manifest_raw: bytes) -> None:
    """Refuse a marker-mode save whose marker is missing or does not name this manifest.

    Raises:
        IncompleteCheckpointError: No marker: the save never finished.
        CorruptCheckpointError: The marker is unreadable, unsealed or damaged, or
            names another step, save or manifest digest.

    Example:
        >>> check_commit_marker(folder, manifest, raw)  # doctest: +SKIP
    """
    where = f"{folder.name}/{COMMIT_MARKER}"
    try:
        data = read_regular_file(folder / COMMIT_MARKER, limit=_MAX_MARKER_BYTES, what="commit marker")
    except FileNotFoundError:
        raise IncompleteCheckpointError(
            f"{folder.name}: no {COMMIT_MARKER}; this save publishes by commit marker, which is written "
            "last, so the save never finished. Restore an older save (restore_latest falls back)."
        ) from None
    marker = parse_json_text(data, where=where)
    if not isinstance(marker, dict) or "record_digest" not in marker:
        raise CorruptCheckpointError(f"{where}: not a sealed commit marker; restore an older save.")
    verify_record_seal(marker, where=where, legacy_keys=())
    named = marker.get("manifest")
    if marker.get("schema") != MARKER_SCHEMA or not isinstance(named, dict) or "algo" not in named:
        raise CorruptCheckpointError(f"{where}: not a {MARKER_SCHEMA} record; restore an older save.")
    try:
        found = hash_bytes(manifest_raw, named["algo"])
    except CheckpointError as exc:  # an algorithm name we do not know: the marker is not ours
        raise CorruptCheckpointError(f"{where}: names an unknown algorithm ({exc}).") from exc
    same_save = (marker.get("step"), marker.get("save_id")) == (manifest["step"], manifest["save_id"])
    if not same_save or named != found:
        raise CorruptCheckpointError(
            f"{where}: names manifest {str(named.get('digest'))[:12]}... of step {marker.get('step')}, but "
            f"manifest.json here is {found['digest'][:12]}... of step {manifest['step']}; the marker commits "
            "another save's files, so this one is not committed. Restore an older save."
        )


@contextmanager
def open_marker_folder(final: Path) -> Iterator[Path]:
    """Create the final folder of a marker-mode save and hold its ``.marker-lock`` while writing.

    If the block raises before the marker exists, the folder is removed (it was
    never a save); after the marker it is a committed save and is kept.

    Raises:
        FileExistsError: The folder exists (the caller moves a damaged one aside first).

    Example:
        >>> with open_marker_folder(run / "step-00000040") as folder:  # doctest: +SKIP
        ...     write_everything(folder)
    """
    final.mkdir()
    try:
        fd = open_beside(final / MARKER_LOCK, os.O_RDWR | os.O_CREAT | os.O_EXCL)
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BaseException:
        shutil.rmtree(final, ignore_errors=True)
        raise
    fsync_dir(final.parent)
    try:
        yield final
    except BaseException:
        if not (final / COMMIT_MARKER).exists():
            shutil.rmtree(final, ignore_errors=True)
        raise
    finally:
        if (final / COMMIT_MARKER).exists():
            # A committed folder needs no lock, and one left behind would make the folder look
            # like an interrupted save to cleanup if commit.json were ever lost.
            try:
                os.unlink(final / MARKER_LOCK)
            except OSError:
                pass
        os.close(fd)  # releases the flock


def lock_is_free(path: Path) -> bool:
    """True when ``path`` is a regular lock file nobody holds (``False`` when missing or odd).

    Example:
        >>> lock_is_free(run / "step-00000040" / MARKER_LOCK)  # doctest: +SKIP
        True
    """
    try:
        fd = open_beside(path, os.O_RDWR)
    except (OSError, CheckpointError):
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)  # closing releases the lock we may have taken
