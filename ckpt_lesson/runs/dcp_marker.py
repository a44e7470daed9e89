"""The commit marker of a ``publish="marker"`` save: ``commit.json``, written last, checked by readers.

How such a save is written without a rename, and why, is told in :mod:`ckpt_lesson.runs.commit`.
The marker is a small sealed record naming the manifest's digest::

    {"schema": "ckpt.commit.dcp.v1", "step": 40, "save_id": "5c1e...",
     "manifest": {"algo": "xxh3_128", "digest": "..."}, "record_digest": {...}}

The manifest says ``"publish": "marker"``, so a reader knows to require it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ckpt_lesson.errors import CheckpointError, CorruptCheckpointError, IncompleteCheckpointError
from ckpt_lesson.files.atomic import atomic_write_json
from ckpt_lesson.files.hashing import hash_bytes
from ckpt_lesson.files.record_seal import seal_record, verify_record_seal
from ckpt_lesson.files.safe_read import parse_json_text, read_regular_file
from ckpt_lesson.runs.commit import COMMIT_MARKER

__all__ = ["MARKER_SCHEMA", "PUBLISH_MODES", "check_commit_marker", "write_commit_marker"]

MARKER_SCHEMA = "ckpt.commit.dcp.v1"
#: ``DistributedCheckpointManager(publish=...)``: how a finished save becomes visible.
PUBLISH_MODES = ("rename", "marker")
_MAX_MARKER_BYTES = 64 << 10


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
