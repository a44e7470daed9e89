"""Where a bucket manager stages its saves, and how staging space left by dead processes comes back.

A :class:`~ckpt_lesson.runs.manager.CheckpointManager` over a store writes each
save to a local folder first (the ordinary protocol), uploads it, then deletes
it. By default that folder is ``$TMPDIR/ckpt-lesson-cache-XXXXXXXX``. A process
killed mid-upload (the very case a bucket is for) leaves the whole staged save
there, and nothing else would ever remove it.

So each folder carries a lock its owner holds for the folder's whole life: an
exclusive ``flock`` on ``.owner.lock`` inside it. The kernel drops the lock
when the owner dies, even by ``SIGKILL``, so "can I take the lock?" is an
exact test of "is the owner gone?" (a pid could be reused; a lock cannot lie).
Every new staging folder first reclaims the ``ckpt-lesson-cache-*`` folders
beside it whose lock it can take; a folder in use is never touched.

* The folder is made under a hidden name, locked, then renamed into place, so
  no reclaimer ever sees a ``ckpt-lesson-cache-*`` folder without its lock held.
* A reclaimer renames a dead folder to ``.ckpt-lesson-reclaim-*`` before it
  deletes it (still holding the lock): one killed half-way leaves a name that
  is garbage by definition, and the next reclaimer finishes the job.
* A folder without ``.owner.lock`` (made by an older version) is left alone:
  nothing proves its owner is gone.
* :meth:`StagingFolder.remove` (the manager's ``close()``) and interpreter exit
  remove the current folder; a forked child never removes its parent's.
"""

from __future__ import annotations

import fcntl
import logging
import os
import shutil
import tempfile
import weakref
from pathlib import Path

__all__ = ["STAGING_PREFIX", "StagingFolder", "reclaim_dead_staging"]

log = logging.getLogger("ckpt_lesson.runs.manager")

STAGING_PREFIX = "ckpt-lesson-cache-"
_NEW_PREFIX = ".ckpt-lesson-new-"
_RECLAIM_PREFIX = ".ckpt-lesson-reclaim-"
LOCK_NAME = ".owner.lock"
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)


def _take_lock_if_dead(folder: Path) -> int | None:
    """An fd holding ``folder``'s owner lock, or ``None`` while its owner lives (or it has no lock)."""
    try:
        fd = os.open(folder / LOCK_NAME, os.O_RDONLY | _NOFOLLOW)
    except OSError:  # no lock file (another version's folder), not ours to read, or gone meanwhile
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:  # held: the owner is alive
        os.close(fd)
        return None
    return fd


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
        fd = _take_lock_if_dead(entry)
        if fd is None:
            continue
        try:
            aside = parent / f"{_RECLAIM_PREFIX}{entry.name[len(STAGING_PREFIX) :]}"
            try:
                os.rename(entry, aside)  # still locked: no other reclaimer can be in the middle of it
            except OSError:
                continue  # another reclaimer took it first
            shutil.rmtree(aside, ignore_errors=True)
            log.info("removed %s: staging space of a process that has exited", entry)
            removed.append(entry)
        finally:
            os.close(fd)
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
        fd = os.open(hidden / LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_EXCL | _NOFOLLOW, 0o600)
        fcntl.flock(fd, fcntl.LOCK_EX)  # nobody else can know this file yet: never waits
        os.write(fd, f"{os.getpid()}\n".encode())
        self.path = parent / f"{STAGING_PREFIX}{hidden.name[len(_NEW_PREFIX) :]}"
        os.rename(hidden, self.path)  # appears under its real name already locked
        # Runs at remove(), when the manager is garbage-collected, or at interpreter exit.
        self._finalizer = weakref.finalize(self, _remove, self.path, fd, os.getpid())

    def remove(self) -> None:
        """Delete the folder and release its lock (idempotent)."""
        self._finalizer()
