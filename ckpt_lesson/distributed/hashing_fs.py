"""DCP file systems that hash every byte on its way to storage: a local folder's and fsspec's.

DCP opens every file it writes, data and ``.metadata`` alike, through
``fs.create_stream``. The file systems here hand out a :class:`HashingStream`
that feeds each ``write`` to the hasher, so a file's digest costs no second
read, and keep one record (size, digest) per file that was written *completely*:
the :class:`~.writer.CommitWriter` lists only those in the manifest.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint._fsspec_filesystem import FileSystem as FsspecFileSystem
from torch.distributed.checkpoint.filesystem import FileSystem

from ckpt_lesson.files.tagged_hash import DEFAULT_ALGO, new_hasher

__all__ = ["Emit", "HashingFileSystem", "HashingFsspecFileSystem", "HashingStream", "no_event"]

#: ``emit(name, **info)``: the manager's event hook (tests kill ranks from it).
Emit = Callable[..., None]


def no_event(name: str, **info: Any) -> None:
    """The default event hook: does nothing."""


class HashingStream:
    """A write-only file wrapper: every byte written also goes through the hasher."""

    def __init__(self, raw: Any, algo: str, on_first_write: Callable[[], None]) -> None:
        self._raw = raw
        self._hasher = new_hasher(algo)
        self._on_first_write: Callable[[], None] | None = on_first_write
        self.size = 0

    def write(self, data: Any) -> int:
        written = self._raw.write(data)
        view = memoryview(data).cast("B")
        n = len(view) if written is None else written
        self._hasher.update(view[:n])  # exactly the bytes the file took, nothing it refused
        self.size += n
        if self._on_first_write is not None:
            hook, self._on_first_write = self._on_first_write, None
            hook()
        return n

    def hexdigest(self) -> str:
        return self._hasher.hexdigest()

    def tell(self) -> int:
        return self._raw.tell()  # DCP records each item's offset from this

    def fileno(self) -> int:
        return self._raw.fileno()  # DCP fsyncs through this

    def flush(self) -> None:
        self._raw.flush()

    def close(self) -> None:
        self._raw.close()

    def writable(self) -> bool:
        return True

    @property
    def closed(self) -> bool:
        return self._raw.closed


class _Hashing:
    """What both hashing file systems add to DCP's: exclusive creates, and a record per finished file.

    Files are created exclusively (``"xb"``; ``If-None-Match: *`` on S3): a save's folder or
    prefix is fresh, so an existing name means two writers collided, and that must fail,
    not overwrite. A file that failed halfway gets no record, so it can never be listed in
    a manifest.

    Args:
        algo: Hash algorithm for the records.
        emit: Event hook; called with ``file_begin``, ``file_partial`` (after the
            first bytes reached the file) and ``file_written``.
    """

    def __init__(self, algo: str = DEFAULT_ALGO, emit: Emit = no_event) -> None:
        super().__init__()
        self.algo, self.emit = algo, emit
        #: file name -> (bytes, {"algo", "digest"}), for every file this process wrote completely.
        self.records: dict[str, tuple[int, dict[str, str]]] = {}
        self._lock = threading.Lock()  # DCP may write several files from several threads

    def _open_new(self, path: str | os.PathLike[str], mode: str) -> Any:  # a context manager
        raise NotImplementedError

    @contextmanager
    def create_stream(self, path: str | os.PathLike[str], mode: str) -> Iterator[Any]:
        if "w" not in mode:
            with super().create_stream(path, mode) as stream:  # type: ignore[misc]
                yield stream
            return
        name = os.fspath(path).rsplit("/", 1)[-1]
        self.emit("file_begin", file=name)
        with self._open_new(path, mode.replace("w", "x")) as raw:
            stream = HashingStream(raw, self.algo, lambda: self.emit("file_partial", file=name))
            yield stream
        # Reached only when DCP's block finished without an error.
        with self._lock:
            self.records[name] = (stream.size, {"algo": self.algo, "digest": stream.hexdigest()})
        self.emit("file_written", file=name, bytes=stream.size)

    def rename(self, path: str | os.PathLike[str], new_path: str | os.PathLike[str]) -> None:
        super().rename(path, new_path)  # type: ignore[misc]  # DCP: .metadata.tmp -> .metadata
        with self._lock:  # the record follows the name
            record = self.records.pop(os.fspath(path).rsplit("/", 1)[-1], None)
            if record is not None:
                self.records[os.fspath(new_path).rsplit("/", 1)[-1]] = record


class HashingFileSystem(_Hashing, FileSystem):
    """DCP's local file system, with write streams that record each file's size and digest."""

    def _open_new(self, path: str | os.PathLike[str], mode: str) -> Any:
        return Path(path).open(mode)


class HashingFsspecFileSystem(_Hashing, FsspecFileSystem):
    """DCP's fsspec file system, with write streams that record each object's size and digest.

    An upload that fails halfway is discarded (its multipart upload aborted), never completed.
    """

    @contextmanager
    def _open_new(self, path: str | os.PathLike[str], mode: str) -> Iterator[Any]:
        raw = self.fs.open(os.fspath(path), mode)
        try:
            yield raw
            raw.close()  # the object appears here (one PUT, or the multipart upload completes)
        except BaseException:
            try:
                discard = getattr(raw, "discard", None)
                if discard is not None:
                    discard()
            finally:
                try:
                    raw.closed = True  # fsspec completes an open write file on close() and in __del__
                except AttributeError:
                    pass
            raise
