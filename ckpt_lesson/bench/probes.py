"""What the benchmark measures besides time: peak extra memory and page-cache residency.

Both read Linux interfaces and degrade to ``None`` elsewhere, so the bench runs
anywhere but only claims what it could measure.

* **Peak extra memory.** Writing ``5`` to ``/proc/self/clear_refs`` resets the
  kernel's high-water mark of this process's resident memory (``VmHWM``,
  documented in the kernel's ``proc(5)``); reading ``VmHWM`` after an operation
  and subtracting the resident size before it gives the most memory the
  operation held at once. The page cache a save fills is not resident memory
  of the process, so it is not counted.
* **Cold and warm reads.** A file just written sits in the page cache, and a
  "load" then times a memory copy. ``posix_fadvise(DONTNEED)`` asks the kernel
  to drop a clean file's cached pages; ``mincore`` on a mapping of the file then
  says how many pages really are still cached, so a "cold" timing is
  labelled with the residency it actually had.
"""

from __future__ import annotations

import ctypes
import mmap
import os
from pathlib import Path

__all__ = ["drop_from_page_cache", "peak_rss_reset", "peak_rss_since_reset", "resident_fraction"]

_PAGE = mmap.PAGESIZE


def _status_kib(field: str) -> int | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


def peak_rss_reset() -> int | None:
    """Reset the peak-RSS mark; returns the current RSS in bytes (``None`` where unsupported)."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return None
    rss = _status_kib("VmRSS")
    return None if rss is None else rss * 1024


def peak_rss_since_reset() -> int | None:
    """Highest RSS in bytes since :func:`peak_rss_reset` (``None`` where unsupported)."""
    hwm = _status_kib("VmHWM")
    return None if hwm is None else hwm * 1024


def drop_from_page_cache(path: str | os.PathLike[str]) -> None:
    """Ask the kernel to evict a (clean, already fsynced) file's pages from the page cache."""
    if not hasattr(os, "posix_fadvise"):
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)  # dirty pages cannot be dropped
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def resident_fraction(path: str | os.PathLike[str]) -> float | None:
    """Fraction of the file's pages in the page cache, from ``mincore`` (``None`` where unsupported)."""
    size = os.path.getsize(path)
    if size == 0:
        return 1.0
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                              ctypes.c_long]  # fmt: skip
        libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_ubyte)]
    except (OSError, AttributeError):
        return None
    pages = (size + _PAGE - 1) // _PAGE
    vec = (ctypes.c_ubyte * pages)()
    fd = os.open(path, os.O_RDONLY)
    try:
        # A mapping of our own (Python's mmap hides its address); mincore reads the kernel's
        # page tables for it without faulting a single page in.
        addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if addr in (None, ctypes.c_void_p(-1).value):
            return None
        try:
            rc = libc.mincore(addr, size, vec)
        finally:
            libc.munmap(addr, size)
    finally:
        os.close(fd)
    return None if rc != 0 else sum(b & 1 for b in vec) / pages
