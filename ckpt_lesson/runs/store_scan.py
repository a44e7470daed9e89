"""``scan`` for a run in an object store: every committed save downloaded and verified.

The table has the same rows as for a local run directory: one per committed
step (``ok``, ``corrupt`` or ``incomplete`` with the reason), plus one row per
upload that no marker names (a writer that died, or one still running: see
:func:`~ckpt_lesson.runs.store_commit.clean_uncommitted`).

Both managers' saves are read: a :class:`~ckpt_lesson.runs.manager.CheckpointManager`
save, and a :class:`~ckpt_lesson.distributed.DistributedCheckpointManager` save,
whose manifest lists every rank's DCP objects and ``.metadata``. Either way
each object is hashed as it streams by and nothing is unpickled, as in the
scan of a local run directory.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ckpt_lesson.errors import (
    CorruptCheckpointError,
    IncompleteCheckpointError,
    SchemaError,
    UnsafeCheckpointError,
)
from ckpt_lesson.files.storage import open_storage
from ckpt_lesson.runs.scan import ScanResult, step_dir_name, step_of
from ckpt_lesson.runs.store_commit import attempt_of, committed_steps, read_commit
from ckpt_lesson.runs.store_restore import verify_store_save

__all__ = ["scan_store"]


def scan_store(url: str, storage_options: Mapping[str, Any] | None = None) -> list[ScanResult]:
    """Verify every committed save under ``url`` (streaming and hashing it) and list uncommitted uploads.

    Args:
        url: The run's prefix, e.g. ``s3://bucket/runs/exp1``.
        storage_options: fsspec options (default: credentials from the environment).

    Returns:
        One :class:`ScanResult` per committed step (ascending; single-process and
        multi-rank saves alike), then one
        ``incomplete`` row per upload no marker names (path ``.uncommitted-...``).

    Raises:
        CheckpointError: The client is missing. ``LoadEnvironmentError``: the bucket cannot be reached.

    Example:
        >>> [r.status for r in scan_store("s3://my-bucket/runs/exp1")]  # doctest: +SKIP
        ['ok', 'ok']
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
