"""One DCP storage writer for every storage: it hashes while it writes and commits in ``finish``.

Stock ``FileSystemWriter`` gets a save onto disk; it does not make it a
*commit*. It never fsyncs the directory, deletes an existing ``.metadata``
before renaming the new one in, records nothing about its files' contents, and
with ``thread_count > 1`` a writer thread that dies takes its items with it
while ``dcp.save`` returns normally. :class:`CommitWriter` keeps DCP's planning
and file format and changes three things:

1. **Every byte is hashed on its way to storage.** DCP opens every file, data and
   ``.metadata`` alike, through ``self.fs.create_stream``; our file systems
   (a local folder, or any fsspec URL) hand out a stream that feeds each
   ``write`` to the hasher, so the digest costs no second read.
2. **Digests travel with DCP's own results.** ``write_data`` returns one
   ``WriteResult`` per item and DCP gathers them to rank 0 for ``finish``; each
   result carries its file's size and digest, so no extra collective is needed.
3. **Rank 0's** ``finish`` **is the commit.** DCP calls it once, after every
   rank wrote. It checks that every planned item was written, lets DCP write
   ``.metadata``, writes the manifest and hands it to the save's *target*, the
   commit strategy of its storage. ``dcp.async_save`` calls the same ``finish``
   in its background thread, so an asynchronous save runs the same protocol.

The two targets live with their storage's backend (:class:`~.saving.FolderTarget`,
:class:`~.store_saves.StoreTarget`). A kill of any rank before the commit leaves the
previous save as the newest one.
"""

from __future__ import annotations

import dataclasses
import json
import os
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint._fsspec_filesystem import FileSystem as FsspecFileSystem
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from ckpt_lesson.errors import CheckpointError, IncompleteCheckpointError
from ckpt_lesson.files.hashing import DEFAULT_ALGO, new_hasher
from ckpt_lesson.files.record_seal import seal_record
from ckpt_lesson.runs.dcp_manifest import METADATA_FILE, build_manifest

__all__ = [
    "CommitWriter",
    "Emit",
    "HashingFileSystem",
    "HashingFsspecFileSystem",
    "no_event",
]


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
                with suppress(AttributeError):
                    raw.closed = True  # fsspec completes an open write file on close() and in __del__
            raise


@dataclasses.dataclass(frozen=True)
class Digested:
    """DCP's per-item storage info plus the size and digest of the file it lives in.

    Exists only between ``write_data`` and ``finish``; ``finish`` unwraps it, so
    ``.metadata`` holds DCP's own ``_StorageInfo`` and stays readable by stock DCP.
    """

    info: Any
    file: str
    size: int
    record: dict[str, str]


class CommitWriter(FileSystemWriter):
    """Writes one save through its target's file system and, on rank 0, commits it.

    Args:
        target: Where and how the save is committed: a folder's :class:`~.saving.FolderTarget`
            or a store's :class:`~.store_saves.StoreTarget`. Each has ``save_id``, ``where``,
            ``checkpoint_id``, ``publish``, ``sync_files``, ``file_system(algo, emit)`` (DCP's
            hashing file system and path), ``remove(names)`` and ``commit(step, manifest, raw, written)``.
        step: The step being saved.
        manifest_fields: ``world_size``, ``per_rank_keys``, ``state``, ``covers`` and
            ``metadata`` for :func:`~ckpt_lesson.runs.dcp_manifest.build_manifest` (used on rank 0).
        algo: Hash algorithm for every file.
        emit: Event hook: ``file_*`` on every rank; ``finish_begin``,
            ``metadata_written``, ``manifest_written`` and ``published`` on rank 0.
        after_publish: Called on rank 0 with ``(where, manifest)`` once the
            save is durable (retention goes here); its errors are the caller's.
        thread_count: DCP writer threads per rank.

    Raises:
        CommitConflictError: (from ``finish``, on every rank through DCP) another
            writer committed this step of a store first.
        CheckpointError: (from ``finish``) the store lease expired before the commit.

    Example:
        >>> target = FolderTarget(staging, run / "step-00000040")  # doctest: +SKIP
        >>> writer = CommitWriter(target, step=40,  # doctest: +SKIP
        ...     manifest_fields={"world_size": 2, "per_rank_keys": [...], "state": {}, "metadata": {}})
        >>> dcp.save(state_dict, storage_writer=writer)  # doctest: +SKIP
    """

    def __init__(
        self,
        target: Any,
        *,
        step: int,
        manifest_fields: dict[str, Any],
        algo: str = DEFAULT_ALGO,
        emit: Emit = no_event,
        after_publish: Callable[[str, dict[str, Any]], None] | None = None,
        thread_count: int = 1,
    ) -> None:
        super().__init__(
            target.checkpoint_id,
            single_file_per_rank=True,
            sync_files=target.sync_files,
            thread_count=thread_count,
            overwrite=False,
        )
        self.fs, self.path = target.file_system(algo, emit)
        self.target, self.step, self.save_id = target, step, target.save_id
        self.manifest_fields, self.emit, self.after_publish = manifest_fields, emit, after_publish
        self._planned: set[Any] | None = None

    def storage_meta(self) -> StorageMeta:
        # .metadata records where the save lives: the final folder (not the staging folder the
        # bytes were written in), or the save's prefix in a store.
        return StorageMeta(checkpoint_id=self.target.checkpoint_id, save_id=self.save_id)

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        plans = super().prepare_global_plan(plans)
        self._planned = {item.index for plan in plans for item in plan.items}  # rank 0 only
        return plans

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        results = super().write_data(plan, planner).wait()
        records, wrapped, used = dict(self.fs.records), [], set()
        for result in results:  # each result carries its file's size and digest to rank 0's finish
            name = result.storage_data.relative_path
            if name not in records:
                raise CheckpointError(
                    f"{self.target.where}: {name} was written without a digest; only CommitWriter's "
                    "file system may write a save. Nothing is committed."
                )
            size, record = records[name]
            used.add(name)
            digested = Digested(result.storage_data, name, size, record)
            wrapped.append(dataclasses.replace(result, storage_data=digested))
        empty = [name for name, (size, _) in records.items() if name not in used and size == 0]
        if empty:  # a rank with nothing to write still opens one file
            self.target.remove(empty)
        self.emit("writes_complete", files=sorted(used))
        done: Future[list[WriteResult]] = Future()
        done.set_result(wrapped)
        return done

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        self.emit("finish_begin", step=self.step)
        # Every planned item was written (a writer thread or rank may have died quietly); then DCP's
        # own results go on, digests stripped (``.metadata`` stays stock), and one part per file.
        missing = (self._planned or set()) - {r.index for rank_results in results for r in rank_results}
        if self._planned is None or missing:
            names = sorted({index.fqn for index in missing})[:5]
            raise IncompleteCheckpointError(
                f"{self.target.where}: {len(missing)} planned item(s) were not written (e.g. {names}); "
                "a writer thread or rank failed. Nothing was published; the previous save stays the latest."
            )
        plain: list[list[WriteResult]] = []
        parts: dict[str, dict[str, Any]] = {}
        for rank_results in results:
            row = []
            for result in rank_results:
                digested = result.storage_data
                if not isinstance(digested, Digested):
                    raise CheckpointError(f"{self.target.where}: a rank wrote without a hashing writer.")
                info = digested.info
                if info.offset + info.length > digested.size:
                    raise CheckpointError(
                        f"{digested.file}: an item ends past the file's {digested.size} bytes."
                    )
                part = {"file": digested.file, "bytes": digested.size, **digested.record}
                if parts.setdefault(digested.file, part) != part:
                    raise CheckpointError(f"{digested.file}: two ranks reported different contents.")
                row.append(dataclasses.replace(result, storage_data=info))
            plain.append(row)
        super().finish(metadata, plain)  # .metadata.tmp through our stream, fsync, rename
        if METADATA_FILE not in self.fs.records:
            raise CheckpointError(f"{self.target.where}: DCP wrote no {METADATA_FILE}; nothing published.")
        size, record = self.fs.records[METADATA_FILE]
        parts[METADATA_FILE] = {"file": METADATA_FILE, "bytes": size, **record}
        self.emit("metadata_written", step=self.step)
        manifest = build_manifest(
            step=self.step,
            parts=list(parts.values()),
            save_id=self.save_id,
            dcp_version=metadata.version,
            publish=self.target.publish,
            **self.manifest_fields,
        )
        # Sealed like every commit record: a flipped bit in the manifest itself is damage, not a refusal.
        raw = (json.dumps(seal_record(manifest), indent=2, sort_keys=True, allow_nan=False) + "\n").encode()
        written = lambda: self.emit("manifest_written", step=self.step, save_id=self.save_id)  # noqa: E731
        final = self.target.commit(self.step, manifest, raw, written)
        self.emit("published", step=self.step, path=final, save_id=self.save_id)
        if self.after_publish is not None:
            self.after_publish(final, manifest)
