"""The object-store backend of the distributed manager: commit by a marker, under a lease.

``DistributedCheckpointManager("s3://bucket/run")`` keeps its saves here. The
collective API and the guarantees are the manager's; what differs from a
POSIX folder is the commit protocol of :mod:`ckpt_lesson.runs.store_commit`
instead of a rename (on S3 a rename is a copy and a delete). The life of one
save of step 40 by two ranks::

    rank 0: refuse if step-00000040/COMMIT exists; pick a save_id; write its LEASE and start renewing it
    all:    dcp.save(..., storage_writer=CommitWriter(StoreTarget))   every rank uploads and hashes
    rank 0: finish: every item written? .metadata, manifest.json; stop renewing, lease still running?
            then COMMIT with If-None-Match: *; retention (markers first, then the objects)
    rank 0: remove uploads of dead writers whose LEASE has expired (never one still renewed)

Why each save has its own ``save_id``: see :mod:`ckpt_lesson.runs.store_commit`.

A restore lists the ``COMMIT`` markers and verifies every object on every rank
together (:mod:`.reader`) before DCP reads it. What is assumed of the store,
and checked at the first save: strong read-after-write consistency, and
conditional creates that really refuse a second writer (S3 since August 2024;
see :mod:`ckpt_lesson.files.storage_fsspec`).

Each restore that found a save is also recorded, by rank 0, in the bucket's
``recovery.jsonl`` (:class:`~ckpt_lesson.runs.report.RecoveryRecorder` with ``store=``,
as the single-process training loop does), once the first step after it is
done; ``python -m ckpt_lesson report URL`` summarises them.
"""

from __future__ import annotations

import logging
import math
import shutil
import tempfile
import uuid
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

from ckpt_lesson.errors import (
    CheckpointError,
    CorruptCheckpointError,
    IncompleteCheckpointError,
)
from ckpt_lesson.files.storage import Storage, open_storage
from ckpt_lesson.runs.layout import MANIFEST_NAME, step_dir_name
from ckpt_lesson.runs.report import RecoveryRecorder
from ckpt_lesson.runs.retention import RetentionPolicy
from ckpt_lesson.runs.store_commit import (
    COMMIT_NAME,
    apply_store_retention,
    clean_uncommitted,
    commit_attempt,
    committed_steps,
    read_commit,
)
from ckpt_lesson.runs.store_lease import LeaseRenewer

from .restore import DistributedRestore, Saves
from .verify import StoreSave
from .writer import Emit, HashingFsspecFileSystem

__all__ = ["StoreSaves", "StoreTarget"]

log = logging.getLogger("ckpt_lesson.distributed")


class StoreTarget:
    """The commit of a save under ``URL/step-XXXXXXXX/<save_id>/``: a conditional ``COMMIT`` under a lease.

    Args:
        storage: The run's store (rank 0 writes manifest and marker through it).
        step: The step being saved.
        save_id: This save's id, the same on every rank (rank 0 chose it).
        storage_options: fsspec options for DCP's file system (``None``: the environment).
        lease: Rank 0: the renewer of this save's ``LEASE``; the commit stops it just before
            ``COMMIT`` and refuses to commit if the lease ran out (a cleaner may have come in).

    Example:
        >>> target = StoreTarget(store, 40, sid, lease=renewer)  # doctest: +SKIP
    """

    # An upload is durable when its PUT returns; DCP's fsync fallback would otherwise be a
    # machine-wide os.sync() per file (an S3 stream has no fileno).
    sync_files = False
    publish = "marker"

    def __init__(
        self,
        storage: Storage,
        step: int,
        save_id: str,
        *,
        storage_options: dict[str, Any] | None = None,
        lease: LeaseRenewer | None = None,
    ) -> None:
        self.storage, self.save_id, self.lease = storage, save_id, lease
        self.attempt = f"{step_dir_name(step)}/{save_id}"
        self.where = self.checkpoint_id = storage.where(self.attempt)
        self.options = dict(storage_options or {})

    def file_system(self, algo: str, emit: Emit) -> tuple[HashingFsspecFileSystem, Any]:
        fs = HashingFsspecFileSystem(algo, emit)
        return fs, fs.init_path(self.where, **self.options)

    def remove(self, names: list[str]) -> None:
        self.storage.delete([f"{self.attempt}/{name}" for name in names])

    def commit(self, step: int, manifest: dict[str, Any], raw: bytes, written: Callable[[], None]) -> str:
        """Upload the manifest, call ``written``, commit if the lease holds; returns the step's URL."""
        self.storage.put_bytes(f"{self.attempt}/{MANIFEST_NAME}", raw)
        written()
        if self.lease is not None:
            # Renewing stops first: commit_attempt deletes the LEASE, and a renewal must not bring it back.
            self.lease.stop()
            self.lease.check()
        commit_attempt(self.storage, step, self.save_id, raw, algo=manifest["parts"][0]["algo"])
        return self.storage.where(step_dir_name(step))


class StoreSaves(Saves):
    """The saves of a run in an object store: listing, commit attempts, retention, cleanup, recovery record.

    Args:
        url: The run's URL, e.g. ``s3://bucket/runs/exp1`` (any fsspec URL).
        storage_options: fsspec options; ``None`` reads them from the environment.
        lease_seconds: How long a silent writer's upload counts as alive.
        policy: The retention policy.
        emit: The manager's event hook.

    Example:
        >>> saves = StoreSaves("s3://bucket/run", None, 900.0, KeepLastK(2), emit)  # doctest: +SKIP
    """

    hint = "'python -m ckpt_lesson scan URL' shows the same list."

    def __init__(
        self,
        url: str,
        storage_options: Mapping[str, Any] | None,
        lease_seconds: float,
        policy: RetentionPolicy,
        emit: Emit,
    ) -> None:
        if not lease_seconds > 0:
            raise CheckpointError(f"lease_seconds must be > 0, got {lease_seconds!r}.")
        self.url, self.storage_options, self.publish = url, dict(storage_options or {}), "marker"
        self.storage = open_storage(self.url, self.storage_options)  # no request yet: rank 0 checks it
        self.lease_seconds, self.policy, self.emit = float(lease_seconds), policy, emit
        self.run_dir = self.where = url  # for the manager's messages
        self._recorder: RecoveryRecorder | None = None  # rank 0, from a restore to the next step
        self._writing = False  # rank 0: probe and cleanup wait for the first save (readers write nothing)

    def open_run(self) -> None:  # rank 0, once: reach the bucket (a read; a restore-only job writes nothing)
        self.storage.check_reachable()

    def step_dir(self, step: int) -> str:
        """The URL of ``step``'s saves (its ``COMMIT`` marker and one prefix per attempt)."""
        return self.storage.where(step_dir_name(step))

    def published(self) -> list[int]:
        """Committed steps (a ``COMMIT`` marker each), ascending; markers are read at restore."""
        return committed_steps(self.storage)

    # ------------------------------------------------------------------ save

    def clean_uploads(self) -> list[str]:
        """Rank 0: prove the store's conditional writes (once), then remove uploads of expired leases."""
        if not self._writing:
            self.storage.check_conditional_writes()
            self._writing = True
        return clean_uncommitted(self.storage)  # it logs each upload it removes

    def clean(self) -> None:  # rank 0, after each save: a long run also sweeps up after dead writers
        if not self._writing:
            return
        try:
            self.clean_uploads()
        except CheckpointError as exc:  # the save is committed; the leftovers wait for the next pass
            log.warning("%s: uploads of dead writers not cleaned this time (%s)", self.url, exc)

    def target(self, step: int, save_id: str, lease: LeaseRenewer | None) -> StoreTarget:
        """Where every rank's writer uploads the attempt ``save_id`` (only rank 0 holds its lease)."""
        return StoreTarget(self.storage, step, save_id, storage_options=self.storage_options, lease=lease)

    @contextmanager
    def begin(self, step: int) -> Iterator[tuple[str, LeaseRenewer]]:
        """Rank 0: refuse a committed step, then hold a new attempt; yields ``(save_id, its renewed LEASE)``.

        A failure removes the (uncommitted) upload. The renewer stops when the save ends either way
        (the writer already stopped it before ``COMMIT``), so no LEASE keeps coming back.
        """
        if not self._writing:
            self.clean_uploads()
        if f"{step_dir_name(step)}/{COMMIT_NAME}" in self.storage.list_keys(step_dir_name(step)):
            raise CheckpointError(
                f"{self.step_dir(step)}: step {step} is already committed; a save is never overwritten. "
                "Save a later step (or is another writer running this run?)."
            )
        save_id = uuid.uuid4().hex
        attempt = f"{step_dir_name(step)}/{save_id}"
        lease = LeaseRenewer(self.storage, attempt, self.lease_seconds)
        try:
            yield save_id, lease
        except BaseException:
            lease.stop()  # before the delete: a renewal landing after it would recreate the LEASE
            try:
                if not self._committed(step, save_id):  # an error after the marker leaves a good save
                    self.storage.delete(self.storage.list_keys(attempt))
                    self.storage.abort_uploads(attempt + "/")
            except CheckpointError as exc:
                log.warning("%s: failed upload not removed (%s); it goes once its lease ends", attempt, exc)
            raise
        finally:
            lease.stop()

    def _committed(self, step: int, save_id: str) -> bool:
        try:
            return read_commit(self.storage, step)[0]["save_id"] == save_id
        except (CorruptCheckpointError, IncompleteCheckpointError):
            return False

    def after_publish(self, final: str, manifest: dict[str, Any]) -> None:
        """Apply the retention policy; a failed purge is logged, never turned into a failed save."""
        try:
            for step in apply_store_retention(self.storage, self.policy):
                self.emit("retention_delete", step=step)
        except Exception:
            log.exception("retention after %s failed; the save itself is committed", final)

    def source(self, step: int) -> StoreSave:
        return StoreSave(self.storage, step)

    # ------------------------------------------------------------------ recovery record

    def restored(self, restored: DistributedRestore) -> None:
        """Rank 0: fetch the bucket's recovery log and note this restore (written after the next step)."""
        self.close()
        folder = Path(tempfile.mkdtemp(prefix="ckpt-lesson-recovery-"))  # scratch: it dies with the machine
        try:
            self._recorder = RecoveryRecorder(folder, store=self.url, storage_options=self.storage_options)
        except CheckpointError as exc:  # a report, never a reason to stop training
            shutil.rmtree(folder, ignore_errors=True)
            log.warning("%s: this restore is not recorded (%s)", self.url, exc)
            return
        created = None
        with suppress(CheckpointError):  # the save's age; a marker field is data: only a number counts
            found = read_commit(self.storage, restored.step)[0].get("created_at")
            if isinstance(found, (int, float)) and not isinstance(found, bool) and math.isfinite(found):
                created = float(found)
        self._recorder.restored(
            {
                "step": restored.step,
                "save_id": restored.save_id,
                "skipped": list(restored.skipped),
                "manifest": {"created_at": created},
            }
        )

    def step_done(self, step: int) -> None:
        """The first step after a restore is done: append the restore's record to ``recovery.jsonl``."""
        if self._recorder is None:
            return
        try:
            self._recorder.step_done(step)
        except CheckpointError as exc:
            log.warning("%s: could not add this restore to recovery.jsonl (%s)", self.url, exc)
        finally:
            self.close()

    def close(self) -> None:
        """Drop a restore's pending record (no step followed it) and its scratch folder."""
        recorder, self._recorder = self._recorder, None
        if recorder is not None:
            shutil.rmtree(recorder.run_dir, ignore_errors=True)
