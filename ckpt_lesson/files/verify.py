"""Check one file of a save against its record: size first (free), then one read for the digest.

A record is what a manifest or an index says about a part: its byte count and
its digest (``{"algo", "digest"}``, or ``{"sha256"}`` from earlier versions).
Nothing here unpickles anything: a scan of a whole run costs one read of
every byte, no more.

The same checks serve ``verify_on_save`` on a part just written
(:func:`check_written_part`), in one of two modes, ``"writer"`` and ``"device"``.
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

A part held in memory is checked here too. A restore from an object store
streams every part down and hashes it on the way (:mod:`ckpt_lesson.runs.store_restore`);
writing the bytes to a local file only for the loader to read and hash them again
would cost a disk write and a second pass for nothing. So the loaders also accept
a :class:`VerifiedBytes`: the bytes and the record they were checked against.
"""

from __future__ import annotations

import contextlib
import io
import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ckpt_lesson.errors import CheckpointError, CorruptCheckpointError
from ckpt_lesson.files.hashing import part_digest
from ckpt_lesson.files.integrity import file_digest
from ckpt_lesson.files.safe_read import SAFE_OPEN_FLAGS

__all__ = [
    "VerifiedBytes",
    "check_written_part",
    "drop_cached_pages",
    "verify_mode",
    "verify_part",
    "verify_record",
]


def verify_record(path: Path, part: dict[str, Any]) -> str | None:
    """:func:`verify_part` against a manifest or index record, old or new form.

    Example:
        >>> verify_record(Path("run/step-00000240/checkpoint.pt"), part)  # doctest: +SKIP
    """
    algo, digest = part_digest(part)
    return verify_part(path, size=part["bytes"], digest=digest, algo=algo)


def verify_part(
    path: Path,
    *,
    size: int,
    sha256: str | None = None,
    digest: str | None = None,
    algo: str | None = None,
) -> str | None:
    """Check one file against its recorded size and digest.

    The size is checked first (a ``stat``, free); only then is the file read,
    once, to compute its digest and check its in-file footer when it has one.

    Args:
        path: The file.
        size: Recorded byte count.
        sha256: Recorded hex sha256 of the whole file (the older form).
        digest: Recorded hex digest of the whole file in ``algo`` (the newer
            form; ``algo`` defaults to sha256 when only ``digest`` is given).
        algo: The recorded digest's algorithm.

    Returns:
        ``None`` if the file matches, else a short reason naming the file,
        e.g. ``"checkpoint.pt: size 100 != recorded 200"``.

    Example:
        >>> verify_part(Path("run/step-00000240/checkpoint.pt"), size=1, sha256="0" * 64)  # doctest: +SKIP
        'checkpoint.pt: size 35210 != recorded 1'
    """
    path = Path(path)
    name = path.name
    wrong = _size_problem(path, size)
    if wrong is not None:
        return wrong
    if sha256 is not None:
        digest, algo = sha256, "sha256"
    if digest is None:
        raise CheckpointError(f"{name}: verify_part needs the recorded sha256=, or digest= and algo=.")
    algo = algo or "sha256"
    try:
        found = file_digest(path, algo=algo)
    except CorruptCheckpointError:
        return f"{name}: contents do not match the file's own integrity footer"
    except OSError as exc:
        return f"{name}: unreadable ({type(exc).__name__}: {exc.strerror or exc})"
    if found.digest != digest:
        return f"{name}: {algo} {found.digest[:12]}... != recorded {digest[:12]}..."
    return None


def _size_problem(path: Path, size: int) -> str | None:
    """Why ``path`` is not a regular file (never a symlink) of ``size`` bytes, or ``None``: one ``lstat``."""
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return f"{path.name}: missing"
    if stat.S_ISLNK(info.st_mode):
        return f"{path.name}: is a symlink; parts must be regular files inside the save folder"
    if not stat.S_ISREG(info.st_mode):
        return f"{path.name}: not a regular file"
    if info.st_size != size:
        return f"{path.name}: size {info.st_size} != recorded {size}"
    return None


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
    if value in ("writer", "device"):
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
    fd = os.open(path, os.O_RDONLY | SAFE_OPEN_FLAGS)
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
    if mode == "writer":
        return _size_problem(path, part["bytes"])
    with contextlib.suppress(OSError):  # a file that cannot be opened: verify_record says why
        drop_cached_pages(path)
    return verify_record(path, part)


@dataclass(frozen=True, eq=False)
class VerifiedBytes:
    """One part's bytes and the digest they were verified against while they streamed in.

    Build one only *after* the bytes matched their record (size and digest):
    the loaders trust ``digest`` and do not hash ``data`` again. Nor do they check
    the footer against the content: that was done when the save was written, and
    identical bytes carry an intact, matching footer; they read only its presence
    and shape (a few dozen bytes at the end).

    Attributes:
        data: The part's bytes (``bytes``, so ``io.BytesIO`` shares them instead of copying).
        name: Where they came from, for messages (a URL such as ``s3://b/run/step-00000240/...``).
        algo: The algorithm of ``digest``.
        digest: The whole part's hex digest, as its manifest records it.

    Example:
        >>> from ckpt_lesson.files.hashing import digest_bytes
        >>> part = VerifiedBytes(b"abc", "mem://abc", "sha256", digest_bytes(b"abc", "sha256"))
        >>> part.size
        3
    """

    data: bytes
    name: str
    algo: str
    digest: str

    def __str__(self) -> str:
        return self.name

    @property
    def size(self) -> int:
        """Bytes in the part."""
        return len(self.data)

    def open(self) -> io.BytesIO:
        """A fresh read-only-by-convention file object over the bytes (no copy of ``bytes``)."""
        return io.BytesIO(self.data)
