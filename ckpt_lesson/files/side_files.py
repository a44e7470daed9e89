"""Open the small files we keep beside a save without trusting what sits at their names.

Saves live in run directories that other people and programs can write to: a
shared scratch folder, a synced home directory, a cluster's project space. The
save itself is written through a fresh temp name and a rename
(:mod:`ckpt_lesson.files.atomic`), but several *side files* are opened by a
fixed name: the heartbeat ``progress.json``, the ``recovery.jsonl`` log, the
staging ``.lock`` and the marker-mode ``.marker-lock``, resume-test's logs.
A plain ``open(name, "a")`` trusts that name three ways, and each can be
turned against the trainer:

* a **symlink** at the name makes us write (or truncate) the file it points
  to, anywhere the trainer may write: ``O_NOFOLLOW`` refuses to follow it;
* a **FIFO** at the name blocks ``open`` until someone reads it, forever, in
  a process that may not even notice SIGTERM while stuck in the kernel:
  ``O_NONBLOCK`` makes that open fail (``ENXIO``) or return at once, and
  ``fstat`` then refuses anything that is not a regular file;
* a **predictable temp name** (``.progress.json.tmp-<pid>``) can be
  prepared in advance by someone else: ``O_EXCL`` plus a random suffix means
  we only ever write into a file we just created.

Every refusal is a :class:`~ckpt_lesson.errors.CheckpointError` that names
the file and what was there, so callers that treat a side file as best-effort
(the heartbeat) catch it beside ``OSError``.
"""

from __future__ import annotations

import errno
import fcntl
import os
import stat
import uuid
from pathlib import Path

from ckpt_lesson.errors import CheckpointError
from ckpt_lesson.files.safe_read import SAFE_OPEN_FLAGS, file_kind

__all__ = ["append_beside", "open_beside", "replace_beside"]


def _refused(path: Path, what: str) -> CheckpointError:
    return CheckpointError(
        f"{path}: {what}; refusing to write a side file through it. Remove it (only a regular file, "
        "or nothing, may sit at this name beside a save)."
    )


def open_beside(path: str | os.PathLike[str], flags: int, mode: int = 0o644) -> int:
    """Open ``path`` as a regular file without following a symlink or blocking on a FIFO.

    ``flags`` are the usual ``os.O_*`` access flags (``os.O_WRONLY | os.O_APPEND
    | os.O_CREAT``, ``os.O_RDWR | os.O_CREAT | os.O_EXCL``...); this adds
    ``O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC``, checks the opened thing is a regular
    file, then turns blocking back on (regular files never block on open, and
    later writes should behave as usual).

    Args:
        path: The side file.
        flags: ``os.O_*`` flags for :func:`os.open`.
        mode: Permission bits for a new file (minus the umask).

    Returns:
        An open file descriptor; the caller closes it.

    Raises:
        CheckpointError: A symlink, FIFO, directory, socket or device sits at ``path``.
        OSError: Anything else the open itself raises (missing folder, full disk,
            ``FileExistsError`` with ``O_EXCL``).

    Example:
        >>> fd = open_beside(run / "recovery.jsonl", os.O_WRONLY | os.O_CREAT)  # doctest: +SKIP
    """
    path = Path(path)
    try:
        fd = os.open(path, flags | SAFE_OPEN_FLAGS, mode)
    except OSError as exc:
        # ELOOP: the last component is a symlink. ENXIO: a FIFO with no reader opened for writing.
        if exc.errno == errno.ELOOP:
            raise _refused(path, "is a symlink") from None
        if exc.errno == errno.ENXIO:
            raise _refused(path, "is a FIFO (or a socket) with no reader") from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise _refused(path, f"is {file_kind(st.st_mode)}")
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
    except BaseException:
        os.close(fd)
        raise
    return fd


def append_beside(path: str | os.PathLike[str], data: bytes, *, durable: bool = True) -> None:
    """Append ``data`` to the regular file ``path`` (created if missing) in one ``write``.

    Args:
        path: The log file.
        data: Whole records (one or more lines); ``O_APPEND`` keeps concurrent writers' lines apart.
        durable: ``fsync`` before returning.

    Raises:
        CheckpointError: Not a regular file at ``path`` (see :func:`open_beside`).
        OSError: The write failed (full disk, read-only folder).

    Example:
        >>> append_beside(run_dir / "recovery.jsonl", b'{"step": 40}\\n')  # doctest: +SKIP
    """
    fd = open_beside(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        if durable:
            os.fsync(fd)
    finally:
        os.close(fd)


def replace_beside(path: str | os.PathLike[str], data: bytes) -> None:
    """Write ``data`` to a fresh, randomly named temp file beside ``path`` and rename it over ``path``.

    No fsync: this is for small, disposable records such as the heartbeat,
    where a lost update costs nothing but a stale number. The temp name carries
    a random suffix and is created with ``O_EXCL``, so nothing prepared in
    advance under that name can receive our bytes.

    Raises:
        CheckpointError: A directory sits at ``path`` (``os.replace`` would refuse it anyway).
        OSError: The write or the rename failed; the temp file is removed first.

    Example:
        >>> replace_beside(run_dir / "progress.json", b'{"step": 41}')  # doctest: +SKIP
    """
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:12]}")
    fd = open_beside(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
    try:
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
        finally:
            os.close(fd)
        # os.replace swaps the name itself: a symlink at `path` is replaced, never followed.
        os.replace(tmp, path)
    except BaseException:
        try:
            tmp.unlink(missing_ok=True)
        except OSError:
            pass
        raise
