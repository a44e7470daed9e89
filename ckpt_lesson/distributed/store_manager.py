"""DistributedCheckpointManager on an object store: ``DistributedCheckpointManager("s3://bucket/run")``.

The same collective API and the same guarantees as the manager on a shared
file system, with the commit protocol of :mod:`ckpt_lesson.runs.store_commit`
instead of a rename (an object store has none: on S3 a rename is a copy and a
delete). The life of one save of step 40 by two ranks::

    rank 0: refuse if step-00000040/COMMIT exists; pick a save_id; write its LEASE and start renewing it
    all:    dcp.save(..., storage_writer=StoreCommitWriter)   every rank uploads and hashes its objects
    rank 0: finish: every item written? .metadata, manifest.json; stop renewing, lease still running?
            then COMMIT with If-None-Match: *; retention (markers first, then the objects)
    rank 0: remove uploads of dead writers whose LEASE has expired (never one still renewed)

A restore lists the ``COMMIT`` markers, and for the newest first verifies every
object on every rank together (:mod:`.store_reader`) before DCP reads it,
falling back to the previous committed save on damage. What is assumed of the
store, and checked once when the manager opens the run: strong read-after-write
consistency, and conditional creates that really refuse a second writer (S3
since August 2024; see :mod:`ckpt_lesson.files.storage_fsspec`).

Each restore that found a save is also recorded, by rank 0, in the bucket's
``recovery.jsonl`` (:class:`~ckpt_lesson.runs.report.RecoveryRecorder`,
as the single-process training loop does), once the first step after it is
done; ``python -m ckpt_lesson report URL`` summarises them.
"""

from __future__ import annotations

import logging
import math
import shutil
import tempfile
import uuid
from collections.abc import Iterator, Mapping
from contextlib import ExitStack, contextmanager
from dataclasses import replace
from pathlib import Path, PurePosixPath
from typing import Any

from ckpt_lesson.errors import (
    CheckpointError,
    CorruptCheckpointError,
    IncompleteCheckpointError,
    LoadEnvironmentError,
)
from ckpt_lesson.files.storage import open_storage
from ckpt_lesson.runs.layout import step_dir_name, step_of
from ckpt_lesson.runs.report import StoreRecoveryRecorder
from ckpt_lesson.runs.store_commit import (
    COMMIT_NAME,
    apply_store_retention,
    clean_uncommitted,
    committed_steps,
    read_commit,
)
from ckpt_lesson.runs.store_lease import LeaseRenewer

from .manager import DistributedCheckpointManager
from .restore import DistributedRestore, restore_newest
from .saving import SaveJob, check_inputs, manifest_fields
from .store_reader import StoreReader, verify_store_save
from .store_writer import StoreCommitWriter

__all__ = ["DEFAULT_LEASE_SECONDS", "StoreDistributedCheckpointManager"]

log = logging.getLogger("ckpt_lesson.distributed")

#: How long a writer that went silent still counts as alive (its upload is left alone until then).
DEFAULT_LEASE_SECONDS = 900.0


class StoreRetention:
    """Which saves the store holds, and the purge after each commit (rank 0, inside ``finish``)."""

    def __init__(self, manager: StoreDistributedCheckpointManager) -> None:
        self.manager = manager

    def published(self) -> list[int] | LoadEnvironmentError:
        """Committed steps (a ``COMMIT`` marker each), ascending; markers are read at restore.

        Rank 0 lists and broadcasts the answer; an unreachable store comes back as the error
        itself, so every rank raises it (a rank 0 that raised alone would leave the others
        waiting in the broadcast).
        """
        try:
            return committed_steps(self.manager.storage)
        except LoadEnvironmentError as exc:
            return exc

    def after_publish(self, final: str, manifest: dict[str, Any]) -> None:
        """Apply the retention policy; a failed purge is logged, never turned into a failed save."""
        try:
            deleted = apply_store_retention(self.manager.storage, self.manager.policy)
            for step in deleted:
                self.manager._emit("retention_delete", step=step)
        except Exception:
            log.exception("retention after %s failed; the save itself is committed", final)

    def mark_good(self, step: int) -> None:
        """Nothing to remember: the store's retention reads markers on every pass."""

    def wait(self) -> None:
        """Retention runs inside the commit: nothing is in flight."""


class StoreDistributedCheckpointManager(DistributedCheckpointManager):
    """:class:`DistributedCheckpointManager` whose run lives in an object store.

    ``DistributedCheckpointManager("s3://bucket/prefix", ...)`` builds one. Every
    rank reaches the store itself (credentials and endpoint from the
    environment, ``AWS_ENDPOINT_URL`` and friends, or ``storage_options``).

    Args:
        run_dir: The run's URL, e.g. ``s3://bucket/runs/exp1`` (any fsspec URL).
        storage_options: fsspec options (``key``, ``secret``, ``client_kwargs``);
            ``None`` reads them from the environment, as boto3 does.
        lease_seconds: How long a silent writer's upload counts as alive; a dead
            writer's leftovers are removed after that when a manager opens the run or
            finishes a save. A live save renews its lease every third of this.
        publish: Only ``"marker"``: a rename on an object store is a copy and a delete.
        **kwargs: What :class:`DistributedCheckpointManager` accepts (``keep_last``,
            ``every_steps``, ``retention``, ``on_event``, ``thread_count``, ...).

    Raises:
        CheckpointError: ``publish="rename"``, or the store client is missing
            (``pip install ckpt_lesson[s3]``). A store without conditional writes is
            refused at the first save (opening one only to restore writes nothing).
        LoadEnvironmentError: The bucket cannot be reached (wrong credentials,
            no such bucket); every rank raises it, naming the bucket.

    Example:
        >>> mgr = DistributedCheckpointManager("s3://bucket/runs/a", keep_last=2)  # doctest: +SKIP
        >>> restored = mgr.restore_latest({"model": model, "optimizer": opt})  # doctest: +SKIP
        >>> mgr.save(100, {"model": model, "optimizer": opt})  # doctest: +SKIP
        's3://bucket/runs/a/step-00000100'
    """

    def __init__(
        self,
        run_dir: str,
        *,
        storage_options: Mapping[str, Any] | None = None,
        lease_seconds: float = DEFAULT_LEASE_SECONDS,
        publish: str = "marker",
        **kwargs: Any,
    ) -> None:
        if publish == "rename":
            raise CheckpointError(
                f"{run_dir}: publish='rename' needs a POSIX file system; on an object store a rename is a "
                "copy and a delete, never atomic. A URL run publishes by its conditional COMMIT marker: "
                "leave publish unset (or pass publish='marker')."
            )
        if not lease_seconds > 0:
            raise CheckpointError(f"lease_seconds must be > 0, got {lease_seconds!r}.")
        self.url = str(run_dir).rstrip("/")
        self.storage_options = dict(storage_options or {})
        self.storage = open_storage(self.url, self.storage_options)  # no request yet: rank 0 checks below
        self.lease_seconds = float(lease_seconds)
        self._recorder: StoreRecoveryRecorder | None = None  # rank 0, from a restore to the next step
        self._writing = False  # rank 0: probe and cleanup wait for the first save (readers write nothing)
        super().__init__(self.url, publish=publish, **kwargs)
        self._retention = StoreRetention(self)  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"StoreDistributedCheckpointManager({self.url!r})"

    def _open_run(self) -> None:  # rank 0, once: reach the bucket (a read; a restore-only job writes nothing)
        self.storage.check_reachable()

    def _open_for_writing(self) -> None:  # rank 0, at the first save: prove the marker fences, clean up
        if not self._writing:
            self.clean_uploads()

    def clean_uploads(self) -> list[str]:
        """Remove now the uploads of writers whose lease expired, as the first save does; rank 0 only.

        A manager opened only to restore writes nothing to the store; a job that will write (or
        a harness that checks a restart cleans up) may call this before its first save. It
        proves the store's conditional writes first, as the first save would.

        Returns:
            The ``step-XXXXXXXX/<save_id>`` prefixes removed (``[]`` on other ranks).

        Raises:
            CheckpointError: The store lets a conditional create overwrite an object.
            LoadEnvironmentError: The store cannot be reached.

        Example:
            >>> mgr.clean_uploads()  # doctest: +SKIP
            ['step-00000004/5be0c1...']
        """
        if self.rank != 0:
            return []
        if not self._writing:
            self.storage.check_conditional_writes()
            self._writing = True
        removed = clean_uncommitted(self.storage)
        for attempt in removed:
            log.info("%s: removed an upload nobody committed (its writer's lease expired)", attempt)
        return removed

    def _clean(self) -> None:  # rank 0, after each save: a long run also sweeps up after dead writers
        if not self._writing:
            return
        try:
            for attempt in clean_uncommitted(self.storage):
                log.info("%s: removed an upload nobody committed (its writer's lease expired)", attempt)
        except CheckpointError as exc:  # the save is committed; the leftovers wait for the next pass
            log.warning("%s: uploads of dead writers not cleaned this time (%s)", self.url, exc)

    def close(self) -> None:
        """As :meth:`DistributedCheckpointManager.close`; a restore with no step after it goes unrecorded."""
        try:
            super().close()
        finally:
            self._drop_recorder()

    def step_dir(self, step: int) -> str:  # type: ignore[override]
        """The URL of ``step``'s saves (its ``COMMIT`` marker and one prefix per attempt)."""
        return self.storage.where(step_dir_name(step))

    # ------------------------------------------------------------------ save

    def _begin(
        self, model: Any, optimizer: Any, scheduler: Any, state: Any, data_state: Any, rng: Any = None
    ) -> SaveJob:
        if self._closed:
            raise CheckpointError(f"{self.url}: this manager is closed; create a new one.")
        step, state_dict, covers = check_inputs(
            ctl=self._ctl,
            model=model,
            optimizer=optimizer,
            scheduler=scheduler,
            state=state,
            data_state=data_state,
            rng=rng,
            emit=self._emit,
        )
        self._first_step_done(step)  # a loop that saves without asking should_save still gets its record
        stack, save_id, refusal, lease = ExitStack(), None, None, None
        if self.rank == 0:
            try:
                save_id = uuid.uuid4().hex
                lease = stack.enter_context(self._attempt(step, save_id))
            except CheckpointError as exc:
                stack.close()
                refusal = exc
        save_id, refusal = self._ctl.broadcast((save_id, refusal))
        if refusal is not None:
            raise refusal
        writer = StoreCommitWriter(
            self.storage,
            step=step,
            save_id=save_id,
            manifest_fields=manifest_fields(self._ctl, state, covers, self.metadata),
            algo=self.algo,
            emit=self._emit,
            after_publish=self._retention.after_publish if self.rank == 0 else None,
            thread_count=self.thread_count,
            storage_options=self.storage_options,
            lease=lease,
        )
        job = SaveJob(step, self.step_dir(step), writer, state_dict, stack)
        self._cadence.mark_saved(step)  # at request time: a save in flight must not be requested again
        return job

    @contextmanager
    def _attempt(self, step: int, save_id: str) -> Iterator[LeaseRenewer]:
        """Rank 0: refuse a committed step, hold a renewed LEASE; on failure remove the (uncommitted) upload.

        The renewer stops when the save ends either way (the writer already stopped it before
        ``COMMIT``), so a finished or failed save never leaves a LEASE that keeps coming back.
        """
        self._open_for_writing()
        if f"{step_dir_name(step)}/{COMMIT_NAME}" in self.storage.list_keys(step_dir_name(step)):
            raise CheckpointError(
                f"{self.step_dir(step)}: step {step} is already committed; a save is never overwritten. "
                "Save a later step (or is another writer running this run?)."
            )
        attempt = f"{step_dir_name(step)}/{save_id}"
        lease = LeaseRenewer(self.storage, attempt, self.lease_seconds)
        try:
            yield lease
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

    # ------------------------------------------------------------------ restore

    def restore_latest(self, *args: Any, **kwargs: Any) -> Any:
        """As :meth:`DistributedCheckpointManager.restore_latest`; rank 0 also prepares its recovery record.

        The record (chosen step, skipped saves, age of the save, time to recover) is
        written to ``URL/recovery.jsonl`` when the first step after the restore is done:
        at the next :meth:`should_save` or save, whichever comes first.
        """
        found = super().restore_latest(*args, **kwargs)
        if found is not None and self.rank == 0 and self.last_restore is not None:
            self._prepare_record(self.last_restore)
        return found

    def should_save(self, step: int) -> bool:
        """As :meth:`DistributedCheckpointManager.should_save`; the first call after a restore records it."""
        self._first_step_done(step)
        return super().should_save(step)

    def _prepare_record(self, restored: DistributedRestore) -> None:
        """Rank 0: fetch the bucket's recovery log and note this restore (written after the next step)."""
        self._drop_recorder()
        folder = Path(tempfile.mkdtemp(prefix="ckpt-lesson-recovery-"))  # scratch: it dies with the machine
        try:
            self._recorder = StoreRecoveryRecorder(self.url, folder, storage_options=self.storage_options)
        except CheckpointError as exc:  # a report, never a reason to stop training
            shutil.rmtree(folder, ignore_errors=True)
            log.warning("%s: this restore is not recorded (%s)", self.url, exc)
            return
        created = None
        try:  # the marker's time gives the save's age; a marker field is data, so only a number counts
            found = read_commit(self.storage, restored.step)[0].get("created_at")
            if isinstance(found, (int, float)) and not isinstance(found, bool) and math.isfinite(found):
                created = float(found)
        except CheckpointError:
            pass
        self._recorder.restored(
            {
                "step": restored.step,
                "save_id": restored.save_id,
                "skipped": list(restored.skipped),
                "manifest": {"created_at": created},
            }
        )

    def _first_step_done(self, step: int) -> None:
        if self._recorder is None:
            return
        try:
            self._recorder.step_done(step)
        except CheckpointError as exc:
            log.warning("%s: could not add this restore to recovery.jsonl (%s)", self.url, exc)
        finally:
            self._drop_recorder()

    def _drop_recorder(self) -> None:
        recorder, self._recorder = self._recorder, None
        if recorder is not None:
            shutil.rmtree(recorder.run_dir, ignore_errors=True)

    def _restore_newest(self, steps: list[int], **options: Any) -> DistributedRestore | None:
        if isinstance(steps, LoadEnvironmentError):  # rank 0 could not list the run (see StoreRetention)
            raise steps
        restored = restore_newest(
            [PurePosixPath(step_dir_name(step)) for step in steps],  # type: ignore[misc]
            where=self.url,
            verify=lambda folder, comm: verify_store_save(self.storage, step_of(folder.name), comm),
            make_reader=lambda verified: StoreReader(verified, self.storage_options),
            **options,
        )
        if restored is None:
            return None
        return replace(restored, path=self.step_dir(restored.step))
