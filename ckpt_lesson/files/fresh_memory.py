"""Memory for a mapped restore's private copies, faulted in while the file is still being hashed.

Why this exists: a mapped restore (see :mod:`~ckpt_lesson.files.mapped_restore`)
must copy the optimizer's moments out of the file's mapping. The copy itself is
cheap (a memcpy at 10+ GB/s), but the destination is fresh memory, and the first
write to each fresh 4 KiB page costs the kernel a page fault: for 256 MB of AdamW
moments that is about 0.1 s here, as long as reading them from the disk.
``torch.load`` pays the same faults, but while it reads, so the disk and the
faults overlap. Our restore reads the file first (to hash it: nothing is
unpickled before its digest checks out) and copies afterwards, so it paid both
in a row.

What we can do while the hash runs is prepare the destination. The zip
archive's directory lists every record's size without any unpickling; a helper
thread allocates buffers of those sizes and touches every page, last record
first (``torch.save`` writes the optimizer's records after the model's). After
verification, each tensor to copy takes a ready buffer of exactly its size, and
the copy is a plain memcpy; a tensor that finds none is cloned as before.

The sizes come from bytes not yet verified, so they decide nothing but how much
memory is touched early: never more in total than the file's size (what a plain
``torch.load`` allocates anyway), and every unused buffer is freed when the
restore ends. A damaged or hostile directory only means no buffers.
"""

from __future__ import annotations

import struct
import threading
import zipfile
from typing import Any, BinaryIO

import torch

from ckpt_lesson.files.private_copy import private_buffer

__all__ = ["FreshMemory", "record_sizes", "record_spans"]

#: Records smaller than this are not worth a buffer: their pages fault in quickly anyway.
MIN_RECORD_BYTES = 1 << 20


def record_sizes(f: BinaryIO, size: int) -> list[int]:
    """Sizes of the tensor records in a ``torch.save`` archive, last record first; ``[]`` when unsure.

    Only stored (uncompressed) records of at least :data:`MIN_RECORD_BYTES`
    count, and the list is empty when their sum exceeds ``size`` (a directory
    that lies) or the archive cannot be read. ``f`` is left at offset 0.

    Example:
        >>> with open("ckpt/last.pt", "rb") as f:  # doctest: +SKIP
        ...     record_sizes(f, os.fstat(f.fileno()).st_size)[:2]
        [16777216, 16777216]
    """
    return [n for _, n in record_spans(f, size)]


def record_spans(f: BinaryIO, size: int) -> list[tuple[int, int]]:
    """``(offset of the data, size)`` of each record :func:`record_sizes` counts, last first."""
    try:
        with zipfile.ZipFile(f) as archive:
            infos = archive.infolist()
        stored = (i for i in infos if "/data/" in i.filename and i.compress_type == zipfile.ZIP_STORED)
        records = [i for i in stored if i.file_size >= MIN_RECORD_BYTES]
        records.sort(key=lambda i: i.header_offset, reverse=True)
        if sum(i.file_size for i in records) > size:
            return []
        spans = []
        for info in records:  # the data follows the local header, whose extra field torch pads
            f.seek(info.header_offset)
            head = f.read(30)
            if len(head) != 30 or head[:4] != b"PK\x03\x04":
                return []
            name_len, extra_len = struct.unpack("<HH", head[26:30])
            start = info.header_offset + 30 + name_len + extra_len
            if start + info.file_size > size:
                return []
            spans.append((start, info.file_size))
        return spans
    except Exception:  # any failure: no early buffers (the verified load judges the file)
        return []
    finally:
        f.seek(0)


class FreshMemory:
    """Buffers faulted in by a helper thread, handed out by size; use it as a context manager.

    Example:
        >>> with FreshMemory() as fresh:  # doctest: +SKIP
        ...     payload, digest = load_verified_file(path, mmap=True, fresh=fresh)
        ...     moments = copy_out(payload["optimizer"], fresh=fresh)
    """

    def __init__(self) -> None:
        self._ready: dict[int, list[torch.Tensor]] = {}
        self._at: dict[int, torch.Tensor] = {}  # the same buffers, by the offset of their record
        self._mine: set[int] = set()  # data pointers of buffers a private copy took
        self._claimed: set[int] = set()  # record offsets a private copy took or made
        self.spans: list[tuple[int, int]] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        #: Buffers faulted in so far, and copies that found one ready (tests and benchmarks read them).
        self.faulted = 0
        self.used = 0

    def start(self, f: BinaryIO, size: int) -> None:
        """Start faulting in buffers for the records of the open archive ``f`` (``size`` bytes)."""
        if self._thread is not None:
            return
        self.spans = record_spans(f, size)
        if self.spans:
            self._thread = threading.Thread(
                target=self._fault_in, args=(self.spans,), name="ckpt-fresh-memory", daemon=True
            )
            self._thread.start()

    def _fault_in(self, spans: list[tuple[int, int]]) -> None:
        for offset, nbytes in spans:
            if self._stop.is_set():
                break
            with self._lock:
                if offset in self._claimed:  # the hash pass got there first and made its own
                    continue
            # One write per 4 KiB faults every page in here, not in the copy (2 MiB at a time
            # where private_buffer got huge pages); writing every byte would only cost bandwidth.
            buf = private_buffer(nbytes)
            buf[::4096].zero_()
            with self._lock:
                if offset in self._claimed:
                    continue
                self._ready.setdefault(nbytes, []).append(buf)
                self._at[offset] = buf
                self.faulted += 1
        # Keep the buffers until the restore ends, then free the unused ones here: freeing 64-128 MB
        # of them took 15-60 ms on the training thread when it did it (measured at 384 MB).
        self._stop.wait()
        with self._lock:
            leftovers, self._ready, self._at = self._ready, {}, {}
        del leftovers

    def copy(self, t: torch.Tensor) -> torch.Tensor:
        """``t.clone()``, into a ready buffer when one of ``t``'s size is waiting.

        Only plain, contiguous CPU tensors without autograd use a buffer; every
        other tensor (a view with gaps, a ``Parameter``, a conjugate view) is
        cloned exactly as before.
        """
        if t.device.type == "cpu" and t.untyped_storage().data_ptr() in self._mine:
            return t  # filled by the hash pass itself (a private copy's record): private already
        if (
            type(t) is not torch.Tensor
            or t.device.type != "cpu"
            or t.requires_grad
            or not t.is_contiguous()
            or t.is_conj()
            or t.is_neg()
            or t.is_quantized
            or t.nbytes < MIN_RECORD_BYTES
        ):
            return t.clone()
        with self._lock:
            waiting = self._ready.get(t.nbytes)
            buf = waiting.pop() if waiting else None
            if buf is not None:
                self._at = {k: v for k, v in self._at.items() if v is not buf}
        if buf is None:
            return t.clone()
        try:
            out = buf.view(t.dtype).view(t.shape)
        except RuntimeError:  # a dtype that cannot view bytes: clone it
            return t.clone()
        out.copy_(t)
        self.used += 1
        return out

    def take(self, offset: int, nbytes: int) -> torch.Tensor:
        """The buffer for the record of ``nbytes`` whose data starts at ``offset``.

        The one the helper faulted in when it is ready, else a new one (its pages fault in as
        the record is written into it; the helper then skips that record). A
        :class:`~ckpt_lesson.files.private_copy.PrivateCopy` fills it with the record's bytes
        as they are hashed; :meth:`copy` then hands tensors on it back as they are.
        """
        with self._lock:
            self._claimed.add(offset)
            buf = self._at.pop(offset, None)
            if buf is not None:
                self._ready[buf.nbytes] = [b for b in self._ready.get(buf.nbytes, []) if b is not buf]
        if buf is None or buf.nbytes != nbytes:
            buf = private_buffer(nbytes)
        with self._lock:
            self._mine.add(buf.untyped_storage().data_ptr())
        return buf

    def close(self, *, wait: bool = False) -> None:
        """Stop the helper; it frees the unused buffers in the background (``wait``: before returning)."""
        self._stop.set()
        if self._thread is None:
            return
        if wait:
            self._thread.join()

    def __enter__(self) -> FreshMemory:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
