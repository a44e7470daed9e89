"""A CheckpointManager whose durable copy lives in an object store.

``CheckpointManager("s3://bucket/runs/exp1")`` builds one of these (see
``CheckpointManager.__new__``). It keeps the whole local protocol and adds a
second, remote one around it:

* **save**: the ordinary local save (parts hashed while written, manifest,
  verify, atomic publish) into a local *cache* folder, then
  :func:`~ckpt_lesson.runs.store_commit.upload_save` streams it to the store
  and commits it with a conditional marker; then the local copy is dropped
  and retention runs on the store. The local folder is scratch space: the
  machine and its disk may vanish at any moment, the bucket is what counts.
* **restore**: the committed saves newest first; each one is streamed into
  memory and verified by :func:`~ckpt_lesson.runs.store_restore.open_verified`,
  and the ordinary restore loads it from there (the same archive checks and
  weights-only load as a local file, no second hash, no local copy). Damage
  falls back to the previous committed save. Only a sharded save is
  downloaded into the cache folder first (its loaders read a folder).

Because ``save`` and ``restore_latest`` pass their arguments straight through
to the local manager, every call form it accepts works here unchanged.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ckpt_lesson.errors import CheckpointError, CorruptCheckpointError, IncompleteCheckpointError
from ckpt_lesson.files.apply import Restored
from ckpt_lesson.files.storage import open_storage
from ckpt_lesson.files.storage_transfer import DEFAULT_TIMEOUT, check_timeout
from ckpt_lesson.runs.commit import delete_save
from ckpt_lesson.runs.manager import CheckpointManager, log
from ckpt_lesson.runs.save_source import Candidates, SaveSource
from ckpt_lesson.runs.scan import step_dir_name
from ckpt_lesson.runs.store_commit import (
    COMMIT_NAME,
    CommitConflictError,
    apply_store_retention,
    clean_uncommitted,
    committed_steps,
    read_commit,
    upload_save,
)
from ckpt_lesson.runs.store_restore import open_verified, verify_store_save
from ckpt_lesson.runs.store_staging import StagingFolder

__all__ = ["StoreCheckpointManager"]

#: How long a writer that stopped renewing its lease still counts as alive.
DEFAULT_LEASE_SECONDS = 900.0


class StoreCheckpointManager(CheckpointManager):
    """:class:`CheckpointManager` over an object store (``s3://``, ``gs://``, ``az://``).

    Args:
        url: The run's prefix, e.g. ``s3://bucket/runs/exp1``.
        storage_options: fsspec options; ``None`` reads credentials and
            endpoint from the environment (``AWS_ENDPOINT_URL``, ...).
        cache_dir: Local scratch folder where each save is staged before its
            upload (and a sharded save is downloaded for its restore); not a
            cache of downloads: a restore reads nothing from it and keeps
            nothing in it. By default a fresh ``ckpt-lesson-cache-*`` folder in
            the temp dir (``$TMPDIR``), removed by :meth:`close` or at exit, and
            reclaimed by a later manager if this process is killed
            (:mod:`~ckpt_lesson.runs.store_staging`). A folder passed here is never removed.
        lease_seconds: How long this writer's uploads count as alive after its
            last sign of life; a dead writer's leftovers go after that.
        read_only: Refuse every save (one-line ``CheckpointError``). Without it a manager
            writes nothing either until its first save: the conditional-write probe and the
            cleanup of dead writers' uploads run then, so read-only credentials can restore.
        timeout: Seconds any one store request may wait (default 300): a store that goes
            silent is a one-line ``LoadEnvironmentError`` naming the bucket and what waited.
        **kwargs: Everything :class:`CheckpointManager` accepts.

    Raises:
        CheckpointError: The store client is missing (``pip install ckpt_lesson[s3]``).
        LoadEnvironmentError: The bucket cannot be reached (or does not exist).

    Example:
        >>> mgr = CheckpointManager("s3://my-bucket/runs/exp1", keep_last=2)  # doctest: +SKIP
        >>> state = mgr.restore_latest(model, opt, sched) or TrainState()  # doctest: +SKIP
    """

    def __init__(
        self,
        url: str,
        *,
        storage_options: Mapping[str, Any] | None = None,
        cache_dir: str | Path | None = None,
        lease_seconds: float = DEFAULT_LEASE_SECONDS,
        read_only: bool = False,
        timeout: float = DEFAULT_TIMEOUT,
        **kwargs: Any,
    ) -> None:
        if not lease_seconds > 0:
            raise CheckpointError(f"lease_seconds must be > 0, got {lease_seconds!r}.")
        self.url = str(url).rstrip("/")
        self.storage = open_storage(self.url, storage_options, timeout=check_timeout(timeout))
        self.read_only = bool(read_only)
        # A manager opened to restore, scan or report writes nothing to the store (an eval job
        # may hold read-only credentials): the probe and the cleanup wait for the first save.
        self._writing = False
        self.storage.check_reachable()  # a read: a missing bucket or wrong credentials named now
        self.lease_seconds = float(lease_seconds)
        self._downloaded: list[Path] = []  # sharded saves fetched by the restore in progress
        # Default staging: $TMPDIR/ckpt-lesson-cache-*, locked for this manager's life, removed by
        # close() or interpreter exit; a killed process's folder is reclaimed by the next manager.
        self._staging = StagingFolder() if cache_dir is None else None
        super().__init__(self._staging.path if self._staging else Path(cache_dir), **kwargs)

    def __repr__(self) -> str:
        return f"StoreCheckpointManager({self.url!r}, keep_last={self.config.keep_last})"

    def close(self) -> None:
        """Stop accepting saves and remove the staging folder (if this manager made it)."""
        super().close()
        if self._staging is not None:
            self._staging.remove()

    # ------------------------------------------------------------------ discovery

    def all_steps(self) -> list[int]:
        """Committed steps in the store (a ``COMMIT`` marker each), ascending."""
        return committed_steps(self.storage)

    def latest_step(self) -> int | None:
        """The newest step whose marker and manifest check out (parts are not downloaded)."""
        for step in reversed(self.all_steps()):
            try:
                read_commit(self.storage, step)
                return step
            except (CorruptCheckpointError, IncompleteCheckpointError):
                continue
        return None

    # ------------------------------------------------------------------ save

    def save(self, *args: Any, **kwargs: Any) -> str:  # type: ignore[override]
        """Save locally with the usual protocol, then upload and commit it; returns the step's URL.

        Raises:
            CommitConflictError: Another writer committed this step first.
            CheckpointError: As :meth:`CheckpointManager.save`.
        """
        self._open_for_writing()
        return self._upload(Path(super().save(*args, **kwargs)))

    def save_payload(self, payload: dict[str, Any]) -> str:  # type: ignore[override]
        """:meth:`save` for a state-API payload (what :class:`AsyncCheckpointer` hands over)."""
        self._open_for_writing()
        return self._upload(Path(super().save_payload(payload)))

    def _open_for_writing(self) -> None:
        """Before the first save: refuse a reader, prove the marker fences, clean up dead writers."""
        if self.read_only:
            raise CheckpointError(
                f"{self.url}: this manager was opened with read_only=True and never writes to the store; "
                "open one without read_only=True (and with write credentials) to save."
            )
        if self._writing:
            return
        self.storage.check_conditional_writes()  # a store whose marker fences nothing is refused
        self._writing = True
        clean_uncommitted(self.storage)

    def _upload(self, local: Path) -> str:
        step = int(self.last_save["step"]) if self.last_save else -1
        try:
            try:
                self._upload_once(local, step)
            except CommitConflictError:
                if not self._retire_if_damaged(step):
                    raise  # a whole save of this step exists: another writer really won
                self._upload_once(local, step)  # the damaged save's marker is gone: commit this one
            self._emit("uploaded", step=step, url=f"{self.url}/{step_dir_name(step)}")
        finally:
            delete_save(local)  # scratch either way: the store holds the durable copy
        deleted = apply_store_retention(self.storage, self.config.policy)
        if deleted:
            self._emit("store_retention", deleted=deleted)
        url = f"{self.url}/{step_dir_name(step)}"
        if self.last_save is not None:
            self.last_save["path"] = url
        return url

    def _upload_once(self, local: Path, step: int) -> None:
        upload_save(self.storage, local, step, algo=self.config.hash_algo, lease_seconds=self.lease_seconds)

    def _retire_if_damaged(self, step: int) -> bool:
        """Remove ``step``'s marker if the save it commits is damaged; False when it is whole.

        A flipped byte in a committed save makes every restore skip it, and its
        marker would refuse every later commit of the step. Only a save that
        fails verification here loses its marker, and only by a delete
        conditional on the ETag just read (``If-Match``), so a marker another
        writer created meanwhile is never removed; the caller then uploads its
        save again (the refused attempt deleted its own objects). The damaged
        parts stay until the next :meth:`clean_stale` (no marker names them).
        """
        key = f"{step_dir_name(step)}/{COMMIT_NAME}"
        try:
            _, etag = self.storage.stat(key)  # type: ignore[attr-defined]
        except FileNotFoundError:
            return True  # gone meanwhile (retention?): the conditional create decides again
        try:
            verify_store_save(self.storage, step)
            return False  # a whole save: another writer really committed this step
        except (CorruptCheckpointError, IncompleteCheckpointError) as exc:
            reason = str(exc)
        if not self.storage.delete_if_match(key, etag):  # type: ignore[attr-defined]
            return False
        log.warning("%s/%s: committed save was damaged (%s); its marker was removed", self.url, key, reason)
        self._emit("quarantined", step=step, path=f"{self.url}/{step_dir_name(step)}", reason=reason)
        return True

    def clean_stale(self, *, spare_own: bool = False) -> list[str]:
        """Local leftovers, then (once this manager has saved) uploads whose writer's lease has expired."""
        local = super().clean_stale(spare_own=spare_own)
        return local + clean_uncommitted(self.storage) if self._writing else local

    # ------------------------------------------------------------------ restore

    def _restore_candidates(self) -> Candidates:
        """The committed saves in the store, each verified into memory when the restore opens it."""
        return Candidates(
            self.url,
            self.all_steps(),
            self._open_committed,
            noun="committed save(s)",
            hint="'python -m ckpt_lesson scan URL' shows the same list.",
            relist=self.all_steps,  # the run may move on while this restore reads it
        )

    def _open_committed(self, step: int) -> SaveSource:
        # A sharded save arrives as a folder in the cache: removed again once the restore is over.
        source = open_verified(self.storage, step, self.run_dir)
        if isinstance(source, Path):
            self._downloaded.append(source)
        return source

    def restore_latest(self, *args: Any, **kwargs: Any) -> Any:
        """Download and verify the newest committed save into memory, then restore it; fall back on damage.

        Takes every form :meth:`CheckpointManager.restore_latest` takes; ``mmap``
        has no effect on a save in memory (its tensors are private copies already).

        Returns:
            What :meth:`CheckpointManager.restore_latest` returns, or ``None``
            when the store holds no committed save.

        Raises:
            CheckpointError: Committed saves exist but none is usable (each reason listed).
            LoadEnvironmentError: The store cannot be reached (bucket named).
        """
        self._downloaded = []
        try:
            found = super().restore_latest(*args, **kwargs)
        finally:
            for folder in self._downloaded:
                delete_save(folder)
        record = self.last_restore or {}
        if record.get("step") is not None:  # the URL, also for a save that went through the cache folder
            record["path"] = f"{self.url}/{step_dir_name(record['step'])}"
            if isinstance(found, Restored):
                found.path = record["path"]
        return found
