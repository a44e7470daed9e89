"""A DCP storage writer that hashes while it writes and commits in ``finish``.

Stock ``FileSystemWriter`` gets a save onto disk; it does not make it a
*commit*. It never fsyncs the directory, deletes an existing ``.metadata``
before renaming the new one in, records nothing about its files' contents, and
with ``thread_count > 1`` a writer thread that dies takes its items with it
while ``dcp.save`` returns normally. :class:`CommitWriter` keeps DCP's planning
and file format and changes three things:

1. **Every byte is hashed on its way to disk.** DCP opens every file, data and
   ``.metadata`` alike, through ``self.fs.create_stream``; our file system
   hands out a stream that feeds each ``write`` to the hasher, so the digest
   costs no second read. (The stream keeps ``tell`` for DCP's offsets and
   ``fileno`` for its fsync; without ``fileno`` DCP falls back to a machine-wide
   ``os.sync()``.)
2. **Digests travel with DCP's own results.** ``write_data`` returns one
   ``WriteResult`` per item and DCP gathers them to rank 0 for ``finish``; each
   result carries its file's size and digest, so no extra collective is needed.
3. **Rank 0's** ``finish`` **is the commit.** DCP calls it once, after every
   rank wrote. It checks that every planned item was written, lets DCP write
   ``.metadata``, writes the manifest, publishes the staging folder with one
   rename and fsyncs the parent. ``dcp.async_save`` calls the same ``finish``
   in its background thread, so an asynchronous save runs the same protocol.

Until the rename, everything lives in a ``.staging-step-...`` folder that no
reader mistakes for a save: a kill of any rank at any earlier point leaves the
previous save as the newest one.
"""

from __future__ import annotations

import dataclasses
import os
import threading
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from ckpt_lesson.errors import CheckpointError, IncompleteCheckpointError
from ckpt_lesson.files.atomic import atomic_write_json
from ckpt_lesson.files.record_seal import seal_record
from ckpt_lesson.files.tagged_hash import DEFAULT_ALGO, new_hasher
from ckpt_lesson.runs.commit import publish
from ckpt_lesson.runs.dcp_manifest import METADATA_FILE, build_manifest
from ckpt_lesson.runs.dcp_marker import write_commit_marker
from ckpt_lesson.runs.layout import MANIFEST_NAME

__all__ = ["CommitWriter", "Digested", "HashingFileSystem", "HashingStream", "check_and_unwrap"]

#: ``emit(name, **info)``: the manager's event hook (tests kill ranks from it).
Emit = Callable[..., None]


def _no_event(name: str, **info: Any) -> None:
    pass


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


class HashingFileSystem(FileSystem):
    """DCP's local file system, with write streams that record each file's size and digest.

    Files are created exclusively (``"xb"``): a staging folder is fresh, so an
    existing name means two writers collided, and that must fail, not overwrite.

    Args:
        algo: Hash algorithm for the records.
        emit: Event hook; called with ``file_begin``, ``file_partial`` (after the
            first bytes reached the file) and ``file_written``.
    """

    def __init__(self, algo: str = DEFAULT_ALGO, emit: Emit = _no_event) -> None:
        super().__init__()
        self.algo = algo
        self.emit = emit
        #: file name -> (bytes, {"algo", "digest"}), for every file this process wrote completely.
        self.records: dict[str, tuple[int, dict[str, str]]] = {}
        self._lock = threading.Lock()  # DCP may write several files from several threads

    @contextmanager
    def create_stream(self, path: str | os.PathLike[str], mode: str) -> Iterator[Any]:
        if "w" not in mode:
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        path = Path(path)
        name = path.name
        self.emit("file_begin", file=name)
        with path.open(mode.replace("w", "x")) as raw:
            stream = HashingStream(raw, self.algo, lambda: self.emit("file_partial", file=name))
            yield stream
        # Reached only when DCP's block finished without an error: a file that failed halfway
        # gets no record, so it can never be listed in a manifest.
        with self._lock:
            self.records[name] = (stream.size, {"algo": self.algo, "digest": stream.hexdigest()})
        self.emit("file_written", file=name, bytes=stream.size)

    def rename(self, path: str | os.PathLike[str], new_path: str | os.PathLike[str]) -> None:
        super().rename(path, new_path)  # DCP: .metadata.tmp -> .metadata; the record follows the name
        with self._lock:
            record = self.records.pop(Path(path).name, None)
            if record is not None:
                self.records[Path(new_path).name] = record


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
    """Writes one save into ``staging`` and, on rank 0, commits it to ``final``.

    Args:
        staging: The staging folder (created and locked by rank 0 beforehand).
        final: Where the save is published, e.g. ``RUN_DIR/step-00000040``.
        step: The step being saved.
        manifest_fields: ``world_size``, ``per_rank_keys``, ``state`` and
            ``metadata`` for :func:`~.manifest.build_manifest` (used on rank 0).
        algo: Hash algorithm for every file.
        emit: Event hook: ``file_*`` on every rank; ``finish_begin``,
            ``metadata_written``, ``manifest_written`` and ``published`` on rank 0.
        after_publish: Called on rank 0 with ``(final, manifest)`` once the
            save is durable (retention goes here); its errors are the caller's.
        thread_count: DCP writer threads per rank.
        publish: ``"rename"``: ``staging`` is renamed to ``final``; ``"marker"``:
            ``staging`` *is* ``final`` and a commit marker written last publishes it
            (see :mod:`ckpt_lesson.runs.dcp_marker`).

    Example:
        >>> writer = CommitWriter(staging, run / "step-00000040", step=40,  # doctest: +SKIP
        ...     manifest_fields={"world_size": 2, "per_rank_keys": [...], "state": {}, "metadata": {}})
        >>> dcp.save(state_dict, storage_writer=writer)  # doctest: +SKIP
    """

    def __init__(
        self,
        staging: Path,
        final: Path,
        *,
        step: int,
        manifest_fields: dict[str, Any],
        algo: str = DEFAULT_ALGO,
        emit: Emit = _no_event,
        after_publish: Callable[[Path, dict[str, Any]], None] | None = None,
        thread_count: int = 1,
        publish: str = "rename",
    ) -> None:
        super().__init__(staging, single_file_per_rank=True, sync_files=True, thread_count=thread_count)
        self.publish = publish
        self.overwrite = False
        self.fs = HashingFileSystem(algo, emit)
        self.staging, self.final, self.step = Path(staging), Path(final), step
        self.manifest_fields = manifest_fields
        self.emit = emit
        self.after_publish = after_publish
        self.save_id = uuid.uuid4().hex
        self._planned: set[Any] | None = None

    def storage_meta(self) -> StorageMeta:
        # .metadata records where the save lives; with publish-by-rename that is the final
        # folder, not the staging folder the bytes were written in.
        return StorageMeta(checkpoint_id=str(self.final), save_id=self.save_id)

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        plans = super().prepare_global_plan(plans)
        self._planned = {item.index for plan in plans for item in plan.items}  # rank 0 only
        return plans

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        results = super().write_data(plan, planner).wait()
        wrapped, used, empty = digested_results(
            results,
            dict(self.fs.records),
            unhashed="was written without a digest; only CommitWriter's file system may write into "
            "a staging folder.",
            where=self.staging.name,
        )
        for name in empty:
            (self.staging / name).unlink(missing_ok=True)
        self.emit("writes_complete", files=sorted(used))
        done: Future[list[WriteResult]] = Future()
        done.set_result(wrapped)
        return done

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        self.emit("finish_begin", step=self.step)
        plain, parts = check_and_unwrap(results, self._planned, where=self.staging.name)
        super().finish(metadata, plain)  # .metadata.tmp through our stream, fsync, rename
        if METADATA_FILE not in self.fs.records:
            raise CheckpointError(f"{self.staging.name}: DCP wrote no {METADATA_FILE}; nothing published.")
        size, record = self.fs.records[METADATA_FILE]
        parts[METADATA_FILE] = {"file": METADATA_FILE, "bytes": size, **record}
        self.emit("metadata_written", step=self.step)
        manifest = build_manifest(
            step=self.step,
            parts=list(parts.values()),
            save_id=self.save_id,
            dcp_version=metadata.version,
            publish=self.publish,
            **self.manifest_fields,
        )
        # Sealed like every commit record: a flipped bit in the manifest itself is damage, not a refusal.
        atomic_write_json(seal_record(manifest), self.staging / MANIFEST_NAME)  # fsyncs file and folder
        self.emit("manifest_written", step=self.step, save_id=self.save_id)
        if self.publish == "marker":  # no rename: the marker, written last, is the commit
            write_commit_marker(self.final, manifest, (self.final / MANIFEST_NAME).read_bytes())
        else:
            if self.final.exists():
                raise CheckpointError(
                    f"{self.final}: appeared while this save was written (another writer?); not replacing it."
                )
            publish(self.staging, self.final)  # one rename, then fsync of the run directory
        self.emit("published", step=self.step, path=str(self.final), save_id=self.save_id)
        if self.after_publish is not None:
            self.after_publish(self.final, manifest)


def digested_results(
    results: list[WriteResult], records: dict[str, tuple[int, dict[str, str]]], *, unhashed: str, where: str
) -> tuple[list[WriteResult], set[str], list[str]]:
    """One rank's write results, each carrying its file's size and digest to rank 0's ``finish``.

    Shared by :class:`CommitWriter` and the object-store writer (:mod:`.store_writer`).

    Args:
        results: What DCP's ``write_data`` returned on this rank.
        records: The hashing file system's ``{file: (size, record)}``.
        unhashed: The end of the message for a result whose file was not hashed.
        where: The save, for messages.

    Returns:
        ``(wrapped results, names written, empty files opened but never written)``: a rank
        with nothing to write still opens one file, which the caller removes.

    Raises:
        CheckpointError: A result names a file the hashing file system never saw.
    """
    wrapped, used = [], set()
    for result in results:
        name = result.storage_data.relative_path
        if name not in records:
            raise CheckpointError(f"{where}: {name} {unhashed}")
        size, record = records[name]
        used.add(name)
        wrapped.append(
            dataclasses.replace(result, storage_data=Digested(result.storage_data, name, size, record))
        )
    empty = [name for name, (size, _) in records.items() if name not in used and size == 0]
    return wrapped, used, empty


def check_and_unwrap(
    results: list[list[WriteResult]], planned: set[Any] | None, *, where: str
) -> tuple[list[list[WriteResult]], dict[str, Any]]:
    """Check every planned item was written, strip digests from the results, and collect one part per file.

    Shared by :class:`CommitWriter` and the object-store writer (:mod:`.store_writer`).

    Args:
        results: What DCP gathered to rank 0's ``finish``.
        planned: Every item index of the global plan (``None``: no plan was seen, a failure).
        where: The save, for messages.

    Returns:
        ``(results as DCP wrote them, {file: part record})``.

    Raises:
        IncompleteCheckpointError: Planned items are missing (a writer thread or rank failed).
        CheckpointError: A result without a digest, an item past its file's end, or two ranks
            that disagree on one file.
    """
    written = {r.index for rank_results in results for r in rank_results}
    missing = (planned or set()) - written
    if planned is None or missing:
        names = sorted({index.fqn for index in missing})[:5]
        raise IncompleteCheckpointError(
            f"{where}: {len(missing)} planned item(s) were not written (e.g. {names}); "
            "a writer thread or rank failed. Nothing was published; the previous save stays the latest."
        )
    plain: list[list[WriteResult]] = []
    parts: dict[str, dict[str, Any]] = {}
    for rank_results in results:
        row = []
        for result in rank_results:
            digested = result.storage_data
            if not isinstance(digested, Digested):
                raise CheckpointError(f"{where}: a rank wrote without a hashing writer.")
            info = digested.info
            if info.offset + info.length > digested.size:
                raise CheckpointError(f"{digested.file}: an item ends past the file's {digested.size} bytes.")
            part = {"file": digested.file, "bytes": digested.size, **digested.record}
            if parts.setdefault(digested.file, part) != part:
                raise CheckpointError(f"{digested.file}: two ranks reported different contents.")
            row.append(dataclasses.replace(result, storage_data=info))
        plain.append(row)
    return plain, parts
