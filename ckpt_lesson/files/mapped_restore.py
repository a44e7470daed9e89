"""What a mapped restore may keep mapped, what it must copy out first, and the memory it copies into.

``load_checkpoint(mmap=True)`` (the default) maps the verified private copy of
the file, sealed so that nobody can change or truncate it
(:mod:`~ckpt_lesson.files.private_copy`), and lets ``model.load_state_dict``
copy the weights straight from it. A tensor left on that mapping keeps the whole
copy (the file's size) in memory, and a tensor written in place (an optimizer's
moment) would be copied page by page beside it. So nothing mapped may outlive
the restore:

* every bucket but ``model`` is copied out at once (:func:`copy_out`; the
  optimizer would otherwise keep its moments mapped: ``Optimizer.load_state_dict``
  keeps a tensor that already has the parameter's dtype and device). A large
  record is already in a buffer of its own, filled by the hash pass (then nothing
  is copied); the small rest is cloned;
* in ``model``, parameters and buffers are *copied* by ``load_state_dict``
  (``param.copy_(saved)``), but **extra state** (``*._extra_state``) is handed
  to the module's ``set_extra_state`` as it is, and a module may keep it. It is
  copied out too (:func:`keep_no_mapped_extra_state`).

Why :class:`FreshMemory`: the first write to each fresh 4 KiB page costs the
kernel a page fault: for 256 MB of AdamW moments that is about 0.1 s here, as
long as reading them from the disk. ``torch.load`` pays the same faults, but
while it reads, so the disk and the faults overlap; our hash pass would pay
them in a row. So the zip archive's directory (read without any unpickling)
lists the large records, and a helper thread allocates a buffer for each and
touches every page, last record first (``torch.save`` writes the optimizer's
records after the model's), while the hash pass reads the disk. The pass reads
each record into its buffer when the helper got there first, else into a new one
(:class:`~ckpt_lesson.files.private_copy.PrivateCopy`).

The sizes come from bytes not yet verified, so they decide nothing but how much
memory is touched early: never more in total than the file's size (what a plain
``torch.load`` allocates anyway), and every unused buffer is freed when the
restore ends. A damaged or hostile directory only means no buffers.
"""

from __future__ import annotations

import struct
import threading
import zipfile
from collections import OrderedDict
from typing import Any, BinaryIO

import torch

from ckpt_lesson.files.private_copy import private_buffer

__all__ = [
    "FreshMemory",
    "copy_out",
    "keep_no_mapped_extra_state",
    "record_spans",
]

#: Records smaller than this are not worth a buffer: their pages fault in quickly anyway.
MIN_RECORD_BYTES = 1 << 20


def record_spans(f: BinaryIO, size: int) -> list[tuple[int, int]]:
    """``(offset of the data, size)`` of each large tensor record of a ``torch.save`` archive, last first.

    Only stored (uncompressed) records of at least :data:`MIN_RECORD_BYTES`
    count, and the list is empty when their sum exceeds ``size`` (a directory
    that lies) or the archive cannot be read. ``f`` is left at offset 0.

    Example:
        >>> with open("ckpt/last.pt", "rb") as f:  # doctest: +SKIP
        ...     [n for _, n in record_spans(f, os.fstat(f.fileno()).st_size)][:2]
        [16777216, 16777216]
    """
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
    """Buffers faulted in by a helper thread, one per large record; use it as a context manager.

    :func:`~ckpt_lesson.files.loading.load_verified_file` makes one per load and hands it to
    its ``private`` rule after a mapped load.

    Example:
        >>> payload, digest = load_verified_file(  # doctest: +SKIP
        ...     path, mmap=True, private=lambda p, fresh: copy_out(p, fresh=fresh))
    """

    def __init__(self) -> None:
        self._at: dict[int, torch.Tensor] = {}  # faulted-in buffers by the offset of their record
        self._mine: set[int] = set()  # data pointers of buffers a private copy took
        self._claimed: set[int] = set()  # record offsets a private copy took or made
        self.spans: list[tuple[int, int]] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        #: Buffers faulted in so far (tests read it).
        self.faulted = 0

    def start(self, f: BinaryIO, size: int) -> None:
        """Start faulting in buffers for the records of the open archive ``f`` (``size`` bytes); once."""
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
                self._at[offset] = buf
                self.faulted += 1
        # Keep the buffers until the restore ends, then free the unused ones here: freeing 64-128 MB
        # of them took 15-60 ms on the training thread when it did it (measured at 384 MB).
        self._stop.wait()
        with self._lock:
            leftovers, self._at = self._at, {}
        del leftovers

    def copy(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` itself when it lies on a buffer the hash pass filled (private already), else a clone."""
        if t.device.type == "cpu" and t.untyped_storage().data_ptr() in self._mine:
            return t
        return t.clone()

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
        if buf is None or buf.nbytes != nbytes:
            buf = private_buffer(nbytes)
        with self._lock:
            self._mine.add(buf.untyped_storage().data_ptr())
        return buf

    def close(self, *, wait: bool = False) -> None:
        """Stop the helper; it frees the unused buffers in the background (``wait``: before returning)."""
        self._stop.set()
        if wait and self._thread is not None:
            self._thread.join()

    def __enter__(self) -> FreshMemory:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


#: torch's suffix for a module's extra state in ``state_dict()`` (``_EXTRA_STATE_KEY_SUFFIX``).
EXTRA_STATE_SUFFIX = "_extra_state"


def copy_out(tree: Any, *, fresh: FreshMemory | None = None) -> Any:
    """``tree`` with every CPU tensor cloned into memory of its own (device tensors are copies already).

    Every mapped restore calls this on what it keeps (see the module's docstring). Tensors
    that ``map_location`` already moved to a device are copies; cloning them again
    would only double, for a moment, the device memory they take. A dict keeps its
    type when it is an ``OrderedDict`` (state dicts are). With ``fresh``, a tensor
    on a buffer the hash pass filled is kept as it is (see :class:`FreshMemory`).

    Example:
        >>> copy_out({"t": [torch.zeros(2)]})["t"][0].sum().item()
        0.0
    """
    if isinstance(tree, torch.Tensor):
        if tree.device.type != "cpu":
            return tree
        return fresh.copy(tree) if fresh is not None else tree.clone()
    if isinstance(tree, dict):
        kind = OrderedDict if isinstance(tree, OrderedDict) else dict
        return kind((k, copy_out(v, fresh=fresh)) for k, v in tree.items())
    if isinstance(tree, (list, tuple)):
        return type(tree)(copy_out(v, fresh=fresh) for v in tree)
    return tree


def keep_no_mapped_extra_state(state_dict: Any) -> Any:
    """A module's loaded ``state_dict`` with every ``*._extra_state`` entry copied out of the mapping.

    Args:
        state_dict: The module's part of a payload; anything but a dict is returned as it is.

    Returns:
        A shallow copy with those entries copied, or ``state_dict`` itself when it holds none.

    Example:
        >>> keep_no_mapped_extra_state({"w": torch.ones(1)})["w"].item()
        1.0
    """
    if not isinstance(state_dict, dict):
        return state_dict
    extra = {k for k in state_dict if isinstance(k, str) and k.endswith(EXTRA_STATE_SUFFIX)}
    return {k: copy_out(v) if k in extra else v for k, v in state_dict.items()} if extra else state_dict
