"""The private copy a restore verifies and loads: filled by the very reads that hash the file.

Why: hashing a file and then handing its *path* (or a mapping of it) to
``torch.load`` reads it twice, and a rewrite in place between the two reads
loaded bytes that were never verified (7.0 where the verified file said 1.0).
A mapping is no shelter: a ``MAP_PRIVATE`` page shows the file's current
contents until the process writes to it.

So the hash pass copies each chunk it reads into memory of our own, at the
same offset, and the load reads that copy, never the file again. On Linux the
copy is a ``memfd`` (an anonymous in-memory file): once filled it is sealed
against writes, shrinking and growing, so ``torch.load(mmap=True)`` can map it
and no other process can change or truncate what the tensors share. (A
truncated *file* can no longer kill a mapped restore with SIGBUS either.)
Elsewhere the copy is a ``bytearray`` read by the ordinary load.

What a byte costs: the hash pass already copied every byte out of the page
cache into its chunk buffer; now it also copies the chunk into the memfd.
"""

from __future__ import annotations

import fcntl
import io
import os
from pathlib import Path
from typing import Any, BinaryIO

__all__ = ["PrivateCopy"]

_SEALS = sum(
    getattr(fcntl, name, 0) for name in ("F_SEAL_SHRINK", "F_SEAL_GROW", "F_SEAL_WRITE", "F_SEAL_SEAL")
)


class PrivateCopy:
    """A file's bytes, copied into private memory by the reads that hash them.

    Read the file through :meth:`reader` (every byte read lands in the copy at its
    offset; a byte read twice keeps its last reading, which is the one hashed last),
    then :meth:`seal` and load from :meth:`open` or :attr:`map_path`.

    Example:
        >>> with open("ckpt/last.pt", "rb") as f, PrivateCopy(size) as copy:  # doctest: +SKIP
        ...     digest = verify_footer(copy.reader(f), name="last.pt")
        ...     copy.seal()
        ...     payload = torch.load(copy.map_path, mmap=True, weights_only=True)
    """

    def __init__(self, size: int) -> None:
        self.size = size
        self.fd: int | None = None
        self._buf: bytearray | None = None
        memfd = getattr(os, "memfd_create", None)
        if memfd is not None and _SEALS and Path("/proc/self/fd").is_dir():
            try:
                self.fd = memfd("ckpt-lesson-restore", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
            except OSError:  # a sandbox without memfd: the bytearray below is just as private
                self.fd = None
        if self.fd is None:
            self._buf = bytearray(size)

    @property
    def map_path(self) -> Path | None:
        """A path ``torch.load(mmap=True)`` can map (the sealed memfd), or ``None`` without one."""
        return None if self.fd is None else Path(f"/proc/self/fd/{self.fd}")

    def reader(self, f: BinaryIO) -> _CopyingReader:
        """``f`` wrapped so that every byte read from it is also written into the copy."""
        return _CopyingReader(f, self)

    def write_at(self, data: Any, offset: int) -> None:
        view = memoryview(data).cast("B")
        if offset + len(view) > self.size:  # the file grew under us: what it became is not ours to load
            view = view[: max(0, self.size - offset)]
        if self._buf is not None:
            self._buf[offset : offset + len(view)] = view
            return
        while len(view):
            done = os.pwrite(self.fd, view, offset)
            view, offset = view[done:], offset + done

    def seal(self) -> None:
        """Make the memfd immutable: no write, shrink or grow, by anyone, from now on."""
        if self.fd is not None:
            os.ftruncate(self.fd, self.size)  # a short read left it shorter: its size is the record's
            fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS, _SEALS)

    def open(self) -> BinaryIO:
        """A file object over the copy (its own descriptor; close it when done)."""
        if self.fd is None:
            return io.BytesIO(self._buf)
        return os.fdopen(os.dup(self.fd), "rb")

    def close(self) -> None:
        """Drop our descriptor; mapped tensors keep the memory alive until they are freed."""
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
        self._buf = None

    def __enter__(self) -> PrivateCopy:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class _CopyingReader:
    """The file-like view :func:`~ckpt_lesson.files.integrity.verify_footer` hashes through."""

    def __init__(self, f: BinaryIO, copy: PrivateCopy) -> None:
        self._f = f
        self._copy = copy

    def fileno(self) -> int:
        return self._f.fileno()

    def seek(self, offset: int, whence: int = 0) -> int:
        return self._f.seek(offset, whence)

    def tell(self) -> int:
        return self._f.tell()

    def readinto(self, view: Any) -> int:
        at = self._f.tell()
        got = self._f.readinto(view)
        if got:
            self._copy.write_at(memoryview(view)[:got], at)
        return got or 0

    def read(self, n: int = -1) -> bytes:
        at = self._f.tell()
        data = self._f.read(n)
        if data:
            self._copy.write_at(data, at)
        return data
