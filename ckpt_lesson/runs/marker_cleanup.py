"""Cleaning up after marker-mode saves: delete only what is certainly an interrupted save.

A marker-mode folder whose ``.marker-lock`` is free and which has no ``commit.json``
has lost its writer (see :mod:`ckpt_lesson.runs.commit`). The *expected* such folder
has no manifest either: the writer died while writing parts, nothing in it is a save,
and removing it is right.

Anything else is *unexpected*: a manifest is there (the writer died between
the manifest and the marker, or ``commit.json`` was lost later, by a sync tool,
a careless ``rm``, a partial copy). Then the folder may hold a complete save
whose every part still verifies, and deleting it would destroy the only copy.
So such a folder is **quarantined**: renamed aside to
``.quarantine-step-XXXXXXXX-<hex>`` (invisible to scans, kept on disk) and
logged, for a person to inspect. Cleanup deletes nothing it cannot prove is
garbage.
"""

from __future__ import annotations

import logging
import os
import uuid
from pathlib import Path

from ckpt_lesson.errors import CheckpointError
from ckpt_lesson.files.atomic import fsync_dir
from ckpt_lesson.files.safe_read import parse_json_text, read_regular_file
from ckpt_lesson.runs.commit import COMMIT_MARKER, MARKER_LOCK, QUARANTINE_PREFIX, delete_save, lock_is_free
from ckpt_lesson.runs.dcp_manifest import (
    MANIFEST_NAME,
    MAX_MANIFEST_BYTES,
    check_dcp_manifest,
    check_dcp_part,
)

__all__ = ["clean_unmarked", "unmarked_save_verifies"]

log = logging.getLogger("ckpt_lesson.distributed")


def unmarked_save_verifies(folder: Path) -> str | None:
    """Check a marker-mode folder's manifest and every part, ignoring the (missing) commit marker.

    Args:
        folder: A ``step-XXXXXXXX`` folder holding ``manifest.json``.

    Returns:
        ``None`` when the manifest is sealed and valid and every part matches
        its size and digest; otherwise the first reason it does not.

    Example:
        >>> unmarked_save_verifies(run / "step-00000040")  # doctest: +SKIP
    """
    where = f"{folder.name}/{MANIFEST_NAME}"
    try:
        raw = read_regular_file(folder / MANIFEST_NAME, limit=MAX_MANIFEST_BYTES, what="manifest")
        manifest = check_dcp_manifest(parse_json_text(raw, where=where), where=where)
    except (OSError, CheckpointError) as exc:
        return str(exc)
    for part in manifest["parts"]:
        problem = check_dcp_part(folder, part)
        if problem:
            return problem
    return None


def clean_unmarked(run_dir: Path) -> list[str]:
    """Remove interrupted marker-mode folders; quarantine the ones that might be saves.

    Only folders with a free ``.marker-lock`` and no ``commit.json`` are
    considered: a folder written by rename, a committed one (its lock is
    removed at commit), or one a live writer holds never is.

    Returns:
        Names of the folders removed (quarantined ones are logged, not listed).

    Example:
        >>> clean_unmarked(run)  # doctest: +SKIP
        ['step-00000040']
    """
    removed = []
    for entry in sorted(run_dir.iterdir()):
        if entry.is_symlink() or not entry.is_dir() or os.path.lexists(entry / COMMIT_MARKER):
            continue
        if not lock_is_free(entry / MARKER_LOCK):
            continue
        if os.path.lexists(entry / MANIFEST_NAME):
            _quarantine(run_dir, entry)
            continue
        if delete_save(entry):  # renamed aside first: a kill mid-delete leaves no half folder
            log.info("removed %s: its writer is gone before the manifest (an interrupted save)", entry.name)
            removed.append(entry.name)
    return removed


def _quarantine(run_dir: Path, entry: Path) -> None:
    verdict = unmarked_save_verifies(entry)
    aside = run_dir / f"{QUARANTINE_PREFIX}{entry.name}-{uuid.uuid4().hex[:8]}"
    try:
        os.replace(entry, aside)
        fsync_dir(run_dir)
    except OSError as exc:
        log.warning("could not move %s aside (%s); left it in place", entry.name, exc)
        return
    state = "its manifest and every part verify" if verdict is None else f"it does not verify ({verdict})"
    log.warning(
        "%s has a manifest but no %s and its writer is gone; %s. Moved it aside to %s, not deleted: "
        "inspect it, and rename it back and re-create the marker only if you trust it.",
        entry.name, COMMIT_MARKER, state, aside.name,
    )  # fmt: skip
