"""The recovery log of a run whose checkpoints live in a bucket: kept in the bucket too.

``recovery.jsonl`` (one record per restore: steps redone, time to recover) is
appended locally by :class:`~ckpt_lesson.runs.report.RecoveryRecorder`. For a
run in a bucket the local folder is scratch that dies with the machine, so the
log is fetched from the bucket when a process starts and put back whole each
time a record is added. ``report s3://...`` reads it from there.

The per-step heartbeat stays local: on a new machine it is gone, and the
record says "steps redone: unknown" rather than guessing.
"""

from __future__ import annotations

import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ckpt_lesson.errors import CheckpointError
from ckpt_lesson.files.safe_read import MAX_RECORD_BYTES
from ckpt_lesson.files.storage import Storage, open_storage
from ckpt_lesson.runs.report import RECOVERY_LOG, RecoveryRecorder, read_recovery_log

__all__ = ["StoreRecoveryRecorder", "read_store_recovery_log"]


def _fetch_log(storage: Storage, folder: Path) -> bool:
    """Copy ``recovery.jsonl`` into ``folder``; False when the bucket holds none."""
    try:
        data = storage.read_bytes(RECOVERY_LOG, limit=MAX_RECORD_BYTES)
    except FileNotFoundError:
        return False
    (folder / RECOVERY_LOG).write_bytes(data)
    return True


class StoreRecoveryRecorder(RecoveryRecorder):
    """A :class:`RecoveryRecorder` whose log is mirrored to ``url/recovery.jsonl``.

    Used by the single-process training loop (``train --ckpt-dir s3://...``) and,
    on rank 0, by the multi-rank manager on a store after each restore.

    Args:
        url: The run's URL.
        folder: A local scratch folder for the log's working copy and the heartbeat.
        storage_options: fsspec options (``None``: credentials from the environment).
        **kwargs: What :class:`RecoveryRecorder` accepts (``started_at``).

    Example:
        >>> rec = StoreRecoveryRecorder("s3://my-bucket/runs/exp1", Path("/tmp/r"))  # doctest: +SKIP
    """

    def __init__(
        self, url: str, folder: Path, *, storage_options: Mapping[str, Any] | None = None, **kwargs: Any
    ) -> None:
        self.storage = open_storage(url, storage_options)
        _fetch_log(self.storage, folder)
        super().__init__(folder, **kwargs)

    def step_done(self, step: int) -> dict[str, Any] | None:
        record = super().step_done(step)
        if record is not None:
            self.storage.put_bytes(RECOVERY_LOG, (self.run_dir / RECOVERY_LOG).read_bytes())
        return record


def read_store_recovery_log(
    url: str, storage_options: Mapping[str, Any] | None = None
) -> list[dict[str, Any]]:
    """:func:`~ckpt_lesson.runs.report.read_recovery_log` of ``url/recovery.jsonl``.

    Args:
        url: The run's URL.
        storage_options: fsspec options (``None``: credentials from the environment).

    Returns:
        Every complete recovery record, oldest first (``[]`` when the run has none).

    Raises:
        LoadEnvironmentError: The bucket is missing or cannot be reached.
        CheckpointError: Nothing at all lies under ``url`` (a typo'd prefix: as ``scan`` says).
        CorruptCheckpointError: The log holds no record at all, only damaged lines.

    Example:
        >>> len(read_store_recovery_log("s3://my-bucket/runs/exp1"))  # doctest: +SKIP
        2
    """
    storage = open_storage(url, storage_options)
    with tempfile.TemporaryDirectory(prefix="ckpt-lesson-report-") as folder:
        if not _fetch_log(storage, Path(folder)) and not storage.list_keys():
            # "no restores recorded", exit 0, would read as "all fine" for a typo'd bucket or prefix;
            # list_keys names a missing bucket itself, an empty prefix is refused here, as scan does.
            raise CheckpointError(
                f"{url}: no run found (no saves, no {RECOVERY_LOG}); pass the prefix a manager "
                "saved to, e.g. s3://BUCKET/runs/exp1 ('python -m ckpt_lesson scan URL' lists its saves)."
            )
        return read_recovery_log(folder)
