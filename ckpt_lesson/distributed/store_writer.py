"""DCP's fsspec writer, hashing every byte it streams up, committed by a conditional marker.

The object-store twin of :class:`~.writer.CommitWriter`. Every rank streams its
files straight into the store through DCP's own ``FsspecWriter``; the streams
it opens are wrapped so that each ``write`` also feeds the hasher (one pass, no
read-back), and each file's size and digest ride to rank 0 inside DCP's
``WriteResult`` s. Rank 0's ``finish`` is the commit, in the order of
:mod:`ckpt_lesson.runs.store_commit`::

    RUN/step-00000040/<save_id>/LEASE            written before any rank starts, renewed (rank 0)
    RUN/step-00000040/<save_id>/__0_0.distcp     every rank, hashed while uploaded
    RUN/step-00000040/<save_id>/.metadata        rank 0, after every rank wrote
    RUN/step-00000040/<save_id>/manifest.json    rank 0: every file's size and digest
    RUN/step-00000040/COMMIT                     rank 0, last, create-if-absent, if the lease still runs

Each save writes under its own ``save_id``, so a zombie writer of the same
step never overwrites a committed save's objects; of the two, only one
creates ``COMMIT`` and the other deletes its upload. Nothing is renamed (on
S3 a rename is a copy and a delete): a save without its marker is not a save.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from torch.distributed.checkpoint._fsspec_filesystem import FileSystem as FsspecFileSystem
from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from ckpt_lesson.errors import CheckpointError
from ckpt_lesson.files.record_seal import seal_record
from ckpt_lesson.files.storage import Storage
from ckpt_lesson.files.tagged_hash import DEFAULT_ALGO
from ckpt_lesson.runs.dcp_manifest import METADATA_FILE, build_manifest
from ckpt_lesson.runs.layout import MANIFEST_NAME, step_dir_name
from ckpt_lesson.runs.store_commit import commit_attempt
from ckpt_lesson.runs.store_lease import LeaseRenewer

from .writer import HashingStream, check_and_unwrap, digested_results

__all__ = ["HashingFsspecFileSystem", "StoreCommitWriter"]

Emit = Callable[..., None]


def _no_event(name: str, **info: Any) -> None:
    pass


def _discard(raw: Any) -> None:
    """Drop an unfinished upload: abort its multipart upload and never complete it (not even at GC)."""
    try:
        discard = getattr(raw, "discard", None)
        if discard is not None:
            discard()
    finally:
        try:
            raw.closed = True  # fsspec completes an open write file on close() and in __del__
        except AttributeError:
            pass


class HashingFsspecFileSystem(FsspecFileSystem):
    """DCP's fsspec file system, with write streams that record each object's size and digest.

    Objects are created with ``"xb"`` (``If-None-Match: *`` on S3): a save's
    prefix is fresh, so an existing name means two writers collided. An upload
    that fails halfway is discarded, not completed, and gets no record.

    Args:
        algo: Hash algorithm for the records.
        emit: Event hook (``file_begin``, ``file_partial``, ``file_written``).
    """

    def __init__(self, algo: str = DEFAULT_ALGO, emit: Emit = _no_event) -> None:
        super().__init__()
        self.algo, self.emit = algo, emit
        #: object name -> (bytes, {"algo", "digest"}), for every object this process uploaded completely.
        self.records: dict[str, tuple[int, dict[str, str]]] = {}
        self._lock = threading.Lock()

    @contextmanager
    def create_stream(self, path: str | os.PathLike[str], mode: str) -> Iterator[Any]:
        if "w" not in mode:
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        name = os.fspath(path).rsplit("/", 1)[-1]
        self.emit("file_begin", file=name)
        raw = self.fs.open(os.fspath(path), mode.replace("w", "x"))
        try:
            stream = HashingStream(raw, self.algo, lambda: self.emit("file_partial", file=name))
            yield stream
            raw.close()  # the object appears here (one PUT, or the multipart upload completes)
        except BaseException:
            _discard(raw)
            raise
        with self._lock:
            self.records[name] = (stream.size, {"algo": self.algo, "digest": stream.hexdigest()})
        self.emit("file_written", file=name, bytes=stream.size)

    def rename(self, path: str | os.PathLike[str], new_path: str | os.PathLike[str]) -> None:
        super().rename(path, new_path)  # DCP: .metadata.tmp -> .metadata (a server-side copy on S3)
        with self._lock:
            record = self.records.pop(os.fspath(path).rsplit("/", 1)[-1], None)
            if record is not None:
                self.records[os.fspath(new_path).rsplit("/", 1)[-1]] = record


class StoreCommitWriter(FsspecWriter):
    """Writes one save under ``URL/step-XXXXXXXX/<save_id>/`` and, on rank 0, commits it.

    Args:
        storage: The run's store (rank 0 writes manifest and marker through it).
        step: The step being saved.
        save_id: This save's id, the same on every rank (rank 0 chose it).
        manifest_fields: ``world_size``, ``per_rank_keys``, ``state``, ``covers``, ``metadata``.
        algo: Hash algorithm for every object.
        emit: Event hook: ``file_*`` on every rank; ``finish_begin``,
            ``metadata_written``, ``manifest_written`` and ``published`` on rank 0.
        after_publish: Called on rank 0 with ``(url, manifest)`` once committed (retention).
        thread_count: DCP writer threads per rank.
        storage_options: fsspec options for DCP's file system (``None``: the environment).
        lease: Rank 0: the renewer of this save's ``LEASE``; ``finish`` stops it
            just before ``COMMIT`` and refuses to commit if the lease ran out.

    Raises:
        CommitConflictError: (from ``finish``, on every rank through DCP) another
            writer committed this step first; this upload was deleted.
        CheckpointError: (from ``finish``) the lease expired before the commit.

    Example:
        >>> writer = StoreCommitWriter(store, step=40, save_id=sid, manifest_fields=fields)  # doctest: +SKIP
        >>> dcp.save(state_dict, storage_writer=writer)  # doctest: +SKIP
    """

    def __init__(
        self,
        storage: Storage,
        *,
        step: int,
        save_id: str,
        manifest_fields: dict[str, Any],
        algo: str = DEFAULT_ALGO,
        emit: Emit = _no_event,
        after_publish: Callable[[str, dict[str, Any]], None] | None = None,
        thread_count: int = 1,
        storage_options: dict[str, Any] | None = None,
        lease: LeaseRenewer | None = None,
    ) -> None:
        self.attempt = f"{step_dir_name(step)}/{save_id}"
        url = storage.where(self.attempt)
        options = dict(storage_options or {})
        # sync_files=False: an upload is durable when its PUT returns; DCP's fsync fallback would
        # otherwise be a machine-wide os.sync() per file (an S3 stream has no fileno).
        super().__init__(
            url,
            single_file_per_rank=True,
            sync_files=False,
            thread_count=thread_count,
            overwrite=False,
            **options,
        )
        self.fs = HashingFsspecFileSystem(algo, emit)
        self.path = self.fs.init_path(url, **options)
        self.storage, self.url, self.step, self.attempt_id = storage, url, step, save_id
        self.manifest_fields, self.algo, self.emit, self.after_publish = (
            manifest_fields,
            algo,
            emit,
            after_publish,
        )
        self.committed, self.lease = False, lease
        self._planned: set[Any] | None = None

    def storage_meta(self) -> StorageMeta:
        return StorageMeta(checkpoint_id=self.url, save_id=self.attempt_id)

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        plans = super().prepare_global_plan(plans)
        self._planned = {item.index for plan in plans for item in plan.items}  # rank 0 only
        return plans

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        results = super().write_data(plan, planner).wait()
        wrapped, used, empty = digested_results(
            results,
            dict(self.fs.records),
            unhashed="was uploaded without a digest; nothing is committed.",
            where=self.url,
        )
        if empty:  # a rank with nothing to write still opens one file
            self.storage.delete([f"{self.attempt}/{name}" for name in empty])
        self.emit("writes_complete", files=sorted(used))
        done: Future[list[WriteResult]] = Future()
        done.set_result(wrapped)
        return done

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        self.emit("finish_begin", step=self.step)
        plain, parts = check_and_unwrap(results, self._planned, where=self.url)
        super().finish(metadata, plain)  # .metadata through our stream
        if METADATA_FILE not in self.fs.records:
            raise CheckpointError(f"{self.url}: DCP wrote no {METADATA_FILE}; nothing was committed.")
        size, record = self.fs.records[METADATA_FILE]
        parts[METADATA_FILE] = {"file": METADATA_FILE, "bytes": size, **record}
        self.emit("metadata_written", step=self.step)
        manifest = build_manifest(
            step=self.step,
            parts=list(parts.values()),
            save_id=self.attempt_id,
            dcp_version=metadata.version,
            publish="marker",
            **self.manifest_fields,
        )
        raw = (json.dumps(seal_record(manifest), indent=2, sort_keys=True, allow_nan=False) + "\n").encode()
        self.storage.put_bytes(f"{self.attempt}/{MANIFEST_NAME}", raw)
        self.emit("manifest_written", step=self.step, save_id=self.attempt_id)
        if self.lease is not None:
            # Renewing stops first: commit_attempt deletes the LEASE, and a renewal must not bring it
            # back. A lease that already ran out may have let a cleaner in, so nothing is committed.
            self.lease.stop()
            self.lease.check()
        commit_attempt(self.storage, self.step, self.attempt_id, raw, algo=self.algo)  # last; conditional
        self.committed = True
        final = self.storage.where(step_dir_name(self.step))
        self.emit("published", step=self.step, path=final, save_id=self.attempt_id)
        if self.after_publish is not None:
            self.after_publish(final, manifest)
