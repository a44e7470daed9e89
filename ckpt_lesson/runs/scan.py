"""Scan a run: which saves are good, which are damaged, which never finished.

A run is a folder (see :mod:`~ckpt_lesson.runs.layout` for what a save in it
looks like, and what a check costs) or a prefix in an object store;
:func:`scan_checkpoints` reads either (the trainer integrations' saves in it
too) and returns the same rows.

``python -m ckpt_lesson scan RUN_DIR_OR_URL [--json]`` prints the same table; it
exits 0 when every save is ok, 1 when something is corrupt or incomplete, and
2 when RUN_DIR is missing or not a directory.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ckpt_lesson.errors import (
    CheckpointError,
    CorruptCheckpointError,
    IncompleteCheckpointError,
    SchemaError,
    UnsafeCheckpointError,
)
from ckpt_lesson.files.storage import is_store_url, open_storage
from ckpt_lesson.runs import dcp_manifest  # noqa: F401 - a scan reads multi-rank saves too: registers their reader
from ckpt_lesson.runs.folder_manifest import FOLDER_MANIFEST_NAME, checkpoint_folder_step, verify_folder
from ckpt_lesson.runs.layout import STAGING_RE, ScanResult, inspect_save, step_dir_name, step_of
from ckpt_lesson.runs.lightning_files import LIGHTNING_SUFFIX, inspect_lightning_file, is_lightning_temp_file
from ckpt_lesson.runs.store_commit import attempt_of, committed_steps, read_commit
from ckpt_lesson.runs.store_restore import verify_store_save

__all__ = ["scan_checkpoints"]


def scan_checkpoints(
    run_dir: str | os.PathLike[str], storage_options: Mapping[str, Any] | None = None
) -> list[ScanResult]:
    """Verify every save in ``run_dir`` (a folder or a bucket URL) without loading any tensor.

    Args:
        run_dir: A manager's run directory, or its URL (``s3://bucket/runs/exp1``: see :func:`_scan_store`).
        storage_options: fsspec options for a URL (default: credentials from the environment).

    Returns:
        One :class:`ScanResult` per published save folder, per Hugging Face
        ``checkpoint-N`` folder (judged by the manifest that
        :mod:`ckpt_lesson.integrations.hf` records), per Lightning ``.ckpt``
        file (judged by its own footer, see :mod:`ckpt_lesson.runs.lightning_files`)
        and per staging folder or temp file (``incomplete``), sorted by step.

    Raises:
        CheckpointError: ``run_dir`` does not exist or is not a directory; the store client is missing.
        LoadEnvironmentError: The bucket cannot be reached.

    Example:
        >>> [(r.step, r.status) for r in scan_checkpoints("run")]  # doctest: +SKIP
        [(240, 'ok'), (280, 'corrupt')]
    """
    if is_store_url(run_dir):
        return _scan_store(str(run_dir), storage_options)
    run_dir = Path(run_dir)
    if not run_dir.exists():
        raise CheckpointError(f"{run_dir}: no such run directory; check the path.")
    if not run_dir.is_dir():
        raise CheckpointError(
            f"{run_dir}: not a directory; pass the run directory that holds the step-XXXXXXXX folders."
        )
    results = []
    for entry in run_dir.iterdir():
        if entry.is_symlink():
            continue
        # Not only regular files: a FIFO or device named like a .ckpt is listed as corrupt (the
        # reader refuses it without blocking), not silently left out. Directories are other saves.
        lightning_name = entry.suffix == LIGHTNING_SUFFIX or is_lightning_temp_file(entry.name)
        if lightning_name and not entry.is_dir():
            found = inspect_lightning_file(entry)
            results.append(ScanResult(entry, found.step, found.status, found.reason, found.epoch))
        if not entry.is_dir():
            continue
        staged = STAGING_RE.match(entry.name)
        if staged:
            step = int(staged.group(1))
            results.append(ScanResult(entry, step, "incomplete", "unpublished save (staging)"))
        elif step_of(entry.name) is not None:
            try:
                results.append(inspect_save(entry)[0])
            except SchemaError as exc:
                results.append(ScanResult(entry, step_of(entry.name) or 0, "corrupt", str(exc)))
        elif (step := checkpoint_folder_step(entry.name)) is not None:
            reason = verify_folder(entry)
            missing = not (entry / FOLDER_MANIFEST_NAME).exists() or (reason or "").endswith(": missing")
            status = "ok" if reason is None else "incomplete" if missing else "corrupt"
            results.append(ScanResult(entry, step, status, reason or ""))
    unknown = -1  # a Lightning file whose step cannot be read sorts first
    return sorted(
        results,
        key=lambda r: (unknown if r.step is None else r.step, r.path.name.startswith("."), r.path.name),
    )


def _scan_store(url: str, storage_options: Mapping[str, Any] | None) -> list[ScanResult]:
    """Verify every committed save under ``url`` and list the uploads no commit marker names.

    The rows are those of a folder: one per committed step, a single-process or a multi-rank
    save alike, each object hashed as it streams by and nothing unpickled; then one
    ``incomplete`` row (path ``.uncommitted-...``) per upload that no marker names (a writer
    that died, or one still running).
    """
    storage = open_storage(url, storage_options)
    keys = storage.list_keys()
    results = []
    named: set[str] = set()
    for step in committed_steps(storage, keys):
        path = Path(step_dir_name(step))
        try:
            named.add(f"{step_dir_name(step)}/{read_commit(storage, step)[0]['save_id']}")
            verify_store_save(storage, step)  # hashed as it streams by; nothing is written locally
            results.append(ScanResult(path, step, "ok"))
        except IncompleteCheckpointError as exc:
            results.append(ScanResult(path, step, "incomplete", str(exc)))
        except (CorruptCheckpointError, SchemaError, UnsafeCheckpointError) as exc:
            # As in a local scan: a record of an unknown kind or a hostile part name is listed, not fatal.
            results.append(ScanResult(path, step, "corrupt", str(exc)))
    attempts = sorted({a for a in map(attempt_of, keys) if a is not None} - named)
    for attempt in attempts:
        head, save_id = attempt.split("/")
        step = step_of(head)
        if step is not None:
            reason = f"{attempt}: an upload no commit marker names (a writer died, or is still writing)"
            results.append(ScanResult(Path(f".uncommitted-{head}-{save_id[:8]}"), step, "incomplete", reason))
    return results
