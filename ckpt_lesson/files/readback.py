"""The two checks ``verify_on_save`` can run on a part just written: ``"writer"`` and ``"device"``.

Re-reading a file right after ``fsync`` looks like a check of the disk, but it
is not: the bytes come back from the page cache, the same memory they were
written from. What that re-read proves is that *our writer* stored what it
hashed, and it costs 15-20 % of a save. There are two honest options instead:

* ``"writer"`` (cheap, the default): the digest was taken from the very bytes
  handed to ``write()`` (see :mod:`ckpt_lesson.files.integrity`), so what is
  left to check is that the file holds *all* of them: it is a regular file of
  the recorded size. This catches a short or lost write, a writer that skipped
  a chunk, a file swapped or truncated before publishing. A ``stat`` per part.
* ``"device"`` (a real read-back): drop the file's clean pages from the page
  cache with ``posix_fadvise(POSIX_FADV_DONTNEED)`` (the data was fsynced, so
  they are clean and the kernel can let them go), then hash the file again. Now
  the bytes come from the device, so this also catches corruption on the way
  to the disk (a controller, a firmware bug, a network file system). It costs
  one read of the save at the device's speed.

Neither can see what happens to the bytes *later* (bit rot): that is the job
of the re-checks retention makes before it deletes anything (:mod:`ckpt_lesson.runs.reverify`).
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Any

from ckpt_lesson.errors import CheckpointError
from ckpt_lesson.files.verify import verify_record

__all__ = ["VERIFY_MODES", "check_written_part", "drop_cached_pages", "verify_mode"]

#: What ``verify_on_save`` accepts besides ``True`` (= ``"device"``) and ``False`` (no check).
VERIFY_MODES = ("writer", "device")


def verify_mode(value: Any) -> str | None:
    """Normalise a ``verify_on_save`` setting to ``None``, ``"writer"`` or ``"device"``.

    Raises:
        CheckpointError: Anything else.

    Example:
        >>> verify_mode(True), verify_mode(False), verify_mode("writer")
        ('device', None, 'writer')
    """
    if value is True:
        return "device"
    if value is False or value is None:
        return None
    if isinstance(value, str) and value in VERIFY_MODES:
        return value
    raise CheckpointError(
        f"verify_on_save must be True, False, 'writer' or 'device', got {value!r}: "
        "'writer' checks every part's size (cheap), 'device' re-reads it from the disk."
    )


def drop_cached_pages(path: Path) -> None:
    """Ask the kernel to forget ``path``'s clean cached pages, so the next read comes from the device.

    A no-op where ``posix_fadvise`` does not exist (macOS): the read-back then
    comes from the cache, and is a writer check only.

    Example:
        >>> drop_cached_pages(Path("run/step-00000240/checkpoint.pt"))  # doctest: +SKIP
    """
    advise = getattr(os, "posix_fadvise", None)
    if advise is None:
        return
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    try:
        advise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def check_written_part(path: Path, part: dict[str, Any], mode: str) -> str | None:
    """Check one part written moments ago; ``None`` when it is good, else the reason.

    Args:
        path: The part's file.
        part: Its record: ``{"file", "bytes", "algo", "digest"}``.
        mode: ``"writer"`` (type and size) or ``"device"`` (evict, then hash).

    Example:
        >>> check_written_part(staging / "checkpoint.pt", part, "writer")  # doctest: +SKIP
    """
    name = path.name
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return f"{name}: missing"
    if not stat.S_ISREG(info.st_mode):
        return f"{name}: not a regular file"
    if info.st_size != part["bytes"]:
        return f"{name}: size {info.st_size} != recorded {part['bytes']}"
    if mode == "writer":
        return None
    try:
        drop_cached_pages(path)
    except OSError as exc:
        return f"{name}: unreadable ({exc.strerror or exc})"
    return verify_record(path, part)
