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

What a byte costs: a read from the page cache is one copy, and so is the
copy into private memory, whose fresh pages also cost a fault each (see
:func:`private_buffer`). So the large tensor records do not go into the memfd
at all: the file is read straight into buffers of their own (the ones
:class:`~ckpt_lesson.files.mapped_restore.FreshMemory` faulted in on a helper thread,
when it got there first), 1 MiB at a time, and each piece is hashed right there
while it is still in the cache (:meth:`PrivateCopy.read_view`): one copy per
byte, and the bytes hashed are the very bytes kept. After the load (of the memfd,
where those records are holes) each tensor of such a record is pointed at its
buffer (:meth:`PrivateCopy.adopt`). Those buffers are what the restore keeps
anyway (the optimizer's moments), so they are copied once, not twice.
"""

from __future__ import annotations

import bisect
import fcntl
import io
import itertools
import mmap
import os
from pathlib import Path
from typing import Any, BinaryIO

import torch

from ckpt_lesson.errors import CheckpointError, CorruptCheckpointError

__all__ = ["PrivateCopy", "private_buffer"]

_names = itertools.count()

#: Bytes per piece read into the copy and hashed at once: small enough to be hashed from the L2 cache.
_PIECE = 1 << 20

#: Buffers at least this large ask for transparent huge pages (smaller ones could not fill one).
_HUGE_BYTES = 2 << 20


def private_buffer(nbytes: int) -> torch.Tensor:
    """``nbytes`` of fresh private memory as a flat ``uint8`` tensor, in huge pages where possible.

    Why: the first write to each fresh page costs a fault, and with 4 KiB pages that
    was the largest cost of a restore after the read itself (256 MB: 0.11 s of
    faults against a 0.06 s memcpy here). A mapping of its own advised
    ``MADV_HUGEPAGE`` faults in 2 MiB at a time where the kernel's transparent
    huge pages are ``madvise`` or ``always`` (0.03 s for the same 256 MB), and is
    returned to the system as soon as the tensor that holds it is freed. Elsewhere
    (another OS, THP off, a failed mapping) it is ``torch.empty``. Like a tensor that
    ``torch.load(mmap=True)`` returns, one on a mapping cannot have its storage resized.

    Args:
        nbytes: Size of the buffer.

    Returns:
        A contiguous CPU ``uint8`` tensor of ``nbytes`` elements; its contents are unspecified.

    Example:
        >>> private_buffer(4 << 20).nbytes
        4194304
    """
    advise = getattr(mmap, "MADV_HUGEPAGE", None)
    if nbytes >= _HUGE_BYTES and advise is not None:
        try:
            region = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE)
            region.madvise(advise)
        except (OSError, ValueError):  # no THP in this kernel, or no address space: plain memory
            pass
        else:
            return torch.frombuffer(region, dtype=torch.uint8)  # the tensor keeps the mapping alive
    return torch.empty(nbytes, dtype=torch.uint8)


_SEALS = sum(
    getattr(fcntl, name, 0) for name in ("F_SEAL_SHRINK", "F_SEAL_GROW", "F_SEAL_WRITE", "F_SEAL_SEAL")
)


class PrivateCopy:
    """A file's bytes, copied into private memory by the reads that hash them.

    Read the file through :meth:`reader`, the copy itself as a file-like view of ``f``
    (every byte read lands in the copy at its offset; a byte read twice keeps its last
    reading, which is the one hashed last), then :meth:`seal` and load from
    :meth:`open` or :attr:`map_path`.

    Example:
        >>> with open("ckpt/last.pt", "rb") as f, PrivateCopy(size) as copy:  # doctest: +SKIP
        ...     digest = verify_footer(copy.reader(f), name="last.pt")
        ...     copy.seal()
        ...     payload = torch.load(copy.map_path, mmap=True, weights_only=True)
    """

    def __init__(self, size: int, *, fresh: Any = None) -> None:
        self.size = size
        self.fd: int | None = None
        self._buf: bytearray | None = None
        self._name = f"ckpt-lesson-restore-{os.getpid()}-{next(_names)}"
        memfd = getattr(os, "memfd_create", None)
        if memfd is not None and _SEALS and Path("/proc/self/fd").is_dir():
            try:
                self.fd = memfd(self._name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
            except OSError:  # a sandbox without memfd: the bytearray below is just as private
                self.fd = None
        if self.fd is None:
            self._buf = bytearray(size)
        # Large records go to FreshMemory's buffers instead (spans: record data offset, size).
        self._fresh = fresh if self.fd is not None else None
        if fresh is not None and self._fresh is None:
            fresh.close()  # no memfd, no mapped load: nothing will take its buffers
        self._spans = sorted(fresh.spans) if self._fresh is not None else []
        self._starts = [start for start, _ in self._spans]
        self._sizes = dict(self._spans)
        self._taken: dict[int, Any] = {}  # span start -> (buffer, its numpy view) or None (memfd)
        self._filled: dict[int, int] = {}
        self._bounce: memoryview | None = None  # read_view's piece for bytes bound for the memfd
        self._f: BinaryIO | None = None  # the file being read, set by reader()

    @property
    def map_path(self) -> Path | None:
        """A path ``torch.load(mmap=True)`` can map (the sealed memfd), or ``None`` without one."""
        return None if self.fd is None else Path(f"/proc/self/fd/{self.fd}")

    def reader(self, f: BinaryIO) -> PrivateCopy:
        """The copy as what :func:`~ckpt_lesson.files.integrity.verify_footer` hashes ``f`` through."""
        self._f = f
        return self

    def fileno(self) -> int:
        return self._f.fileno()

    def seek(self, offset: int, whence: int = 0) -> int:
        return self._f.seek(offset, whence)

    def tell(self) -> int:
        return self._f.tell()

    def read(self, n: int = -1) -> bytes:
        """Up to ``n`` bytes of the file (all with ``-1``), also written into the copy."""
        at = self._f.tell()
        data = self._f.read(n)
        if data:
            self.write_at(data, at)
        return data

    def write_at(self, data: Any, offset: int) -> None:
        """Write ``data`` into the memfd (or bytearray) at ``offset``; buffers are filled by read_view only.

        A byte of a record that went to a buffer, written here (the footer read of a crafted
        file), never reaches the buffer: that record then counts as not filled, and
        :meth:`adopt` refuses it.
        """
        view = memoryview(data).cast("B")
        if offset + len(view) > self.size:  # the file grew under us: what it became is not ours to load
            view = view[: max(0, self.size - offset)]
        if self._buf is not None:
            self._buf[offset : offset + len(view)] = view
            return
        while len(view):
            done = os.pwrite(self.fd, view, offset)
            view, offset = view[done:], offset + done

    def read_view(self, n: int) -> memoryview:
        """Read up to ``n`` bytes from the file's position into the copy; the bytes, where they now lie.

        Bytes of a large record are read straight into its buffer, and the returned
        view is of that buffer: hashing it hashes exactly what the load will use, and
        no byte is copied twice. Other bytes are read into a small piece of our own,
        then written into the copy. An empty view means the end of the file.
        """
        f = self._f
        offset = f.tell()
        i = bisect.bisect_right(self._starts, offset) - 1
        start, n_span = self._spans[i] if i >= 0 else (0, 0)
        if i >= 0 and offset < start + n_span and offset < self.size:  # inside a large record
            taken = self._take(start, offset)
            if taken is not None:
                piece = taken[1][offset - start : offset - start + min(n, _PIECE, start + n_span - offset)]
                got = f.readinto(piece) or 0
                self._filled[start] = self._filled.get(start, 0) + got
                return piece[:got]
            end = start + n_span
        else:
            end = self._starts[i + 1] if i + 1 < len(self._starts) else self.size
        if self._bounce is None:
            self._bounce = memoryview(bytearray(_PIECE))
        piece = self._bounce[: min(n, _PIECE, end - offset if end > offset else _PIECE)]
        got = f.readinto(piece) or 0
        if got:
            self.write_at(piece[:got], offset)
        return piece[:got]

    def _take(self, start: int, offset: int) -> Any:
        if start not in self._taken:  # decided once, at the record's first byte: buffer or memfd
            buf = self._fresh.take(start, self._sizes[start]) if offset == start else None
            self._taken[start] = None if buf is None else (buf, memoryview(buf.numpy()))
        return self._taken[start]

    def adopt(self, tree: Any) -> None:
        """Point every tensor of ``tree`` that lies on a record sent to a buffer at that buffer.

        The memfd holds holes where those records would be; a tensor left there would
        read zeros, so one that fits no buffer exactly is refused.

        Raises:
            CorruptCheckpointError: A tensor overlaps a record that went to a buffer but is
                not exactly on it (the archive's directory changed while it was read).
        """
        taken = {s: t[0] for s, t in self._taken.items() if t is not None}
        if not taken:
            return
        base = self._mapping_base()
        sizes = self._sizes
        for t in _tensors(tree):
            st = t.untyped_storage()
            at = st.data_ptr() - base
            hit = taken.get(at)
            if hit is not None and st.nbytes() == hit.nbytes == self._filled.get(at):
                with torch.no_grad():
                    t.set_(hit.untyped_storage(), t.storage_offset(), t.size(), t.stride())
            elif any(s < at + st.nbytes() and at < s + sizes[s] for s in taken):
                raise CorruptCheckpointError(
                    f"a tensor of {st.nbytes()} bytes at offset {at} overlaps a record the verified "
                    "read placed elsewhere; the archive changed while it was read. Retry the restore."
                )

    def _mapping_base(self) -> int:
        with open("/proc/self/maps") as maps:
            for line in maps:
                fields = line.split()
                if len(fields) >= 6 and fields[5] == f"/memfd:{self._name}":
                    return int(fields[0].split("-")[0], 16) - int(fields[2], 16)
        raise CheckpointError(f"{self._name}: the private copy is not mapped; cannot place its records.")

    @property
    def scattered(self) -> bool:
        """Whether some records went to buffers (then only a mapped load of the copy is whole)."""
        return any(t is not None for t in self._taken.values())

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


def _tensors(tree: Any) -> Any:
    if isinstance(tree, torch.Tensor):
        yield tree
    elif isinstance(tree, dict):
        for value in tree.values():
            yield from _tensors(value)
    elif isinstance(tree, (list, tuple)):
        for value in tree:
            yield from _tensors(value)
