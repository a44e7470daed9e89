"""The object-store side of :class:`~ckpt_lesson.runs.manager.CheckpointManager`.

``CheckpointManager("s3://bucket/runs/exp1")`` is the same manager as for a
folder; only where the durable copy lives and how it is committed differ, and
those differences are this class, which the manager holds as ``self.store``.
A save is the ordinary local save into a local *cache* folder (scratch space:
the machine may vanish, the bucket is what counts), then uploaded and committed
(:mod:`~ckpt_lesson.runs.store_commit`), then retention runs on the store. A
restore verifies each committed save into memory
(:mod:`~ckpt_lesson.runs.store_restore`) and the ordinary restore loads it.

The default cache folder is ``$TMPDIR/ckpt-lesson-cache-XXXXXXXX``
(:class:`StagingFolder`). A process killed mid-upload (the very case a bucket
is for) leaves its whole staged save there, and nothing else would remove it.
So the folder's owner holds an exclusive ``flock`` on ``.owner.lock`` inside it
for the folder's whole life (a lock, not a pid: see :mod:`~ckpt_lesson.runs.commit`).
Every new cache folder first reclaims the ``ckpt-lesson-cache-*`` folders beside
it whose lock is free; a folder in use is never touched.

* The folder is made under a hidden name, locked, then renamed into place, so
  no reclaimer ever sees a ``ckpt-lesson-cache-*`` folder without its lock held.
* A reclaimer renames a dead folder to ``.ckpt-lesson-reclaim-*`` before it
  deletes it: one killed half-way leaves a name that is garbage by definition,
  and the next reclaimer finishes the job (a second reclaimer's rename fails).
* A folder without ``.owner.lock`` (made by an older version) is left alone:
  nothing proves its owner is gone.
* :meth:`StagingFolder.remove` (the manager's ``close()``) and interpreter exit
  remove the current folder; a forked child never removes its parent's.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import tempfile
import weakref
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from ckpt_lesson.errors import CheckpointError, CorruptCheckpointError, IncompleteCheckpointError
from ckpt_lesson.files.side_files import open_beside
from ckpt_lesson.files.storage import open_storage
from ckpt_lesson.files.storage_transfer import check_timeout
from ckpt_lesson.runs.commit import delete_save, lock_is_free, log
from ckpt_lesson.runs.layout import step_dir_name
from ckpt_lesson.runs.restore import Candidates, SaveSource
from ckpt_lesson.runs.retention import RetentionPolicy
from ckpt_lesson.runs.store_commit import (
    COMMIT_NAME,
    CommitConflictError,
    apply_store_retention,
    clean_uncommitted,
    commit_checks,
    committed_steps,
    upload_save,
)
from ckpt_lesson.runs.store_restore import open_verified, verify_store_save

__all__ = ["DEFAULT_LEASE_SECONDS", "STAGING_PREFIX", "StagingFolder", "StoreRun", "reclaim_dead_staging"]

#: How long a writer that stopped renewing its lease still counts as alive.
DEFAULT_LEASE_SECONDS = 900.0
STAGING_PREFIX = "ckpt-lesson-cache-"
_NEW_PREFIX = ".ckpt-lesson-new-"
_RECLAIM_PREFIX = ".ckpt-lesson-reclaim-"
_OWNER_LOCK = ".owner.lock"


class StoreRun:
    """A run's prefix in an object store: its committed saves, their upload and their cleanup.

    Args:
        url: The run's prefix, e.g. ``s3://bucket/runs/exp1``.
        storage_options: fsspec options; ``None`` reads credentials and endpoint from the environment.
        cache_dir: The local scratch folder (``None``: a fresh, locked one in ``$TMPDIR``,
            see :class:`StagingFolder`).
        lease_seconds: How long this writer's uploads count as alive after its last sign of life.
        read_only: Refuse every save.
        timeout: Seconds any one store request may wait.
        emit: The manager's event hook, ``emit(name, **info)``.

    Raises:
        CheckpointError: A bad ``lease_seconds``, or the store client is missing.
        LoadEnvironmentError: The bucket cannot be reached (or does not exist).

    Example:
        >>> store = StoreRun("s3://my-bucket/runs/exp1", None, None, 900, False, 300, emit)  # doctest: +SKIP
        >>> store.all_steps()  # doctest: +SKIP
        [40, 80]
    """

    def __init__(
        self,
        url: str,
        storage_options: Mapping[str, Any] | None,
        cache_dir: str | Path | None,
        lease_seconds: float,
        read_only: bool,
        timeout: float,
        emit: Callable[..., None],
    ) -> None:
        if not lease_seconds > 0:
            raise CheckpointError(f"lease_seconds must be > 0, got {lease_seconds!r}.")
        self.url = str(url).rstrip("/")
        self.storage = open_storage(self.url, storage_options, timeout=check_timeout(timeout))
        self.read_only = bool(read_only)
        self.lease_seconds = float(lease_seconds)
        self._emit = emit
        # A manager opened to restore, scan or report writes nothing to the store (an eval job
        # may hold read-only credentials): the probe and the cleanup wait for the first save.
        self.writing = False
        self.storage.check_reachable()  # a read: a missing bucket or wrong credentials named now
        self.downloaded: list[Path] = []  # sharded saves fetched by the restore in progress
        # Default staging: $TMPDIR/ckpt-lesson-cache-*, locked for this manager's life, removed by
        # close() or interpreter exit; a killed process's folder is reclaimed by the next manager.
        self._staging = StagingFolder() if cache_dir is None else None
        #: The local folder each save is staged in before its upload.
        self.cache = self._staging.path if self._staging else Path(cache_dir)  # type: ignore[arg-type]

    def close(self) -> None:
        """Remove the staging folder (if this run made it)."""
        if self._staging is not None:
            self._staging.remove()

    def url_of(self, step: int) -> str:
        """``url/step-XXXXXXXX``."""
        return f"{self.url}/{step_dir_name(step)}"

    # ------------------------------------------------------------------ discovery

    def all_steps(self) -> list[int]:
        """Committed steps in the store (a ``COMMIT`` marker each), ascending."""
        return committed_steps(self.storage)

    def latest_step(self) -> int | None:
        """The newest step whose marker and manifest check out (parts are not downloaded)."""
        return next((step for step in reversed(self.all_steps()) if commit_checks(self.storage, step)), None)

    # ------------------------------------------------------------------ save

    def open_for_writing(self) -> None:
        """Before the first save: refuse a reader, prove the marker fences, clean up dead writers."""
        if self.read_only:
            raise CheckpointError(
                f"{self.url}: this manager was opened with read_only=True and never writes to the store; "
                "open one without read_only=True (and with write credentials) to save."
            )
        if self.writing:
            return
        self.storage.check_conditional_writes()  # a store whose marker fences nothing is refused
        self.writing = True
        clean_uncommitted(self.storage)

    def upload(self, local: Path, step: int, *, algo: str, policy: RetentionPolicy) -> str:
        """Upload and commit the published local save ``local``, drop it, run retention; returns its URL.

        Raises:
            CommitConflictError: Another writer committed this step first.
            CheckpointError: The lease ran out before the commit (nothing is committed).
        """
        try:
            try:
                upload_save(self.storage, local, step, algo=algo, lease_seconds=self.lease_seconds)
            except CommitConflictError:
                if not self._retire_if_damaged(step):
                    raise  # a whole save of this step exists: another writer really won
                # The damaged save's marker is gone: commit this one.
                upload_save(self.storage, local, step, algo=algo, lease_seconds=self.lease_seconds)
            self._emit("uploaded", step=step, url=self.url_of(step))
        finally:
            delete_save(local)  # scratch either way: the store holds the durable copy
        deleted = apply_store_retention(self.storage, policy)
        if deleted:
            self._emit("store_retention", deleted=deleted)
        return self.url_of(step)

    def _retire_if_damaged(self, step: int) -> bool:
        """Remove ``step``'s marker if the save it commits is damaged; False when it is whole.

        A flipped byte in a committed save makes every restore skip it, and its
        marker would refuse every later commit of the step. Only a save that
        fails verification here loses its marker, and only by a delete
        conditional on the ETag just read (``If-Match``), so a marker another
        writer created meanwhile is never removed; the caller then uploads its
        save again (the refused attempt deleted its own objects). The damaged
        parts stay until the next cleanup (no marker names them).
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
        self._emit("quarantined", step=step, path=self.url_of(step), reason=reason)
        return True

    def clean_stale(self) -> list[str]:
        """Uploads whose writer's lease has expired, once this manager has saved (else nothing)."""
        return clean_uncommitted(self.storage) if self.writing else []

    # ------------------------------------------------------------------ restore

    def candidates(self) -> Candidates:
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
        source = open_verified(self.storage, step, self.cache)
        if isinstance(source, Path):
            self.downloaded.append(source)
        return source

    def drop_downloads(self) -> None:
        """Remove the sharded saves the last restore downloaded into the cache folder."""
        for folder in self.downloaded:
            delete_save(folder)
        self.downloaded = []


def reclaim_dead_staging(parent: str | os.PathLike[str] | None = None) -> list[Path]:
    """Remove the staging folders in ``parent`` whose owning process is gone; returns what was removed.

    Args:
        parent: The folder that holds ``ckpt-lesson-cache-*`` folders (default: the temp dir).

    Returns:
        The folders removed (their names before removal).

    Example:
        >>> reclaim_dead_staging()  # doctest: +SKIP
        [PosixPath('/tmp/ckpt-lesson-cache-k2j4x9az')]
    """
    parent = Path(tempfile.gettempdir() if parent is None else parent)
    removed = []
    try:
        entries = sorted(parent.iterdir())
    except OSError:
        return []
    for entry in entries:
        if entry.name.startswith(_RECLAIM_PREFIX) and entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry, ignore_errors=True)  # a reclaimer died half-way: finish its job
            continue
        if not entry.name.startswith(STAGING_PREFIX) or entry.is_symlink() or not entry.is_dir():
            continue
        if not lock_is_free(entry / _OWNER_LOCK):  # held (its owner lives), missing, or not a file
            continue
        aside = parent / f"{_RECLAIM_PREFIX}{entry.name[len(STAGING_PREFIX) :]}"
        try:
            os.rename(entry, aside)
        except OSError:
            continue  # another reclaimer took it first
        shutil.rmtree(aside, ignore_errors=True)
        log.info("removed %s: staging space of a process that has exited", entry)
        removed.append(entry)
    return removed


def _remove(path: Path, fd: int, owner: int) -> None:
    if os.getpid() != owner:  # a forked child (a DataLoader worker) exiting: not its folder
        return
    shutil.rmtree(path, ignore_errors=True)
    os.close(fd)


class StagingFolder:
    """A private ``ckpt-lesson-cache-*`` folder, locked for its life and removed at close or exit.

    Args:
        parent: Where to make it (default: the temp dir, ``$TMPDIR``). Dead
            owners' folders there are reclaimed first.

    Example:
        >>> staging = StagingFolder()  # doctest: +SKIP
        >>> staging.path.name.startswith("ckpt-lesson-cache-")  # doctest: +SKIP
        True
        >>> staging.remove()  # doctest: +SKIP
    """

    def __init__(self, parent: str | os.PathLike[str] | None = None) -> None:
        parent = Path(tempfile.gettempdir() if parent is None else parent)
        reclaim_dead_staging(parent)
        hidden = Path(tempfile.mkdtemp(prefix=_NEW_PREFIX, dir=parent))
        fd = open_beside(hidden / _OWNER_LOCK, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        fcntl.flock(fd, fcntl.LOCK_EX)  # nobody else can know this file yet: never waits
        os.write(fd, f"{os.getpid()}\n".encode())
        self.path = parent / f"{STAGING_PREFIX}{hidden.name[len(_NEW_PREFIX) :]}"
        os.rename(hidden, self.path)  # appears under its real name already locked
        # Runs at remove(), when the manager is garbage-collected, or at interpreter exit.
        self._finalizer = weakref.finalize(self, _remove, self.path, fd, os.getpid())

    def remove(self) -> None:
        """Delete the folder and release its lock (idempotent)."""
        self._finalizer()
