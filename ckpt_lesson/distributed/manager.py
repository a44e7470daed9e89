"""DistributedCheckpointManager: the commit protocol of the single-process manager, for every rank at once.

The life of one save of step 40 by two ranks::

    rank 0: .staging-step-00000040-<pid>-<hex8>/ + .lock held     (open_staging, as CheckpointManager)
    all:    dcp.save(..., storage_writer=CommitWriter(staging))   every rank writes and hashes its files
    rank 0: CommitWriter.finish: every item written? .metadata, manifest.json, fsync,
            rename to step-00000040/, fsync RUN_DIR, retention      (DCP calls it after all ranks wrote)

``save_async`` runs the same save through ``dcp.async_save``: the state is copied
to CPU on the calling thread; writing *and commit* run in DCP's background thread.

One manager for every storage: where the saves live is a small backend
(:class:`~.restore.Saves`: a shared folder, or an object store's URL such as ``s3://bucket/run``).

Every call here is **collective**: all ranks call ``save``, ``save_async``,
``wait``, ``should_save`` and ``restore_latest`` in the same order (why, and how
decisions are shared: :mod:`.comm`).
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch.distributed.checkpoint as dcp

from ckpt_lesson.errors import CheckpointError
from ckpt_lesson.files.apply import Restored
from ckpt_lesson.files.hashing import DEFAULT_ALGO
from ckpt_lesson.runs.async_report import forget_failure, note_failure_of
from ckpt_lesson.runs.cost import SaveCadence
from ckpt_lesson.runs.loop_api import LoopMethods, default_run_dir
from ckpt_lesson.runs.retention import KeepLastK, RetentionPolicy
from ckpt_lesson.runs.store_run import DEFAULT_LEASE_SECONDS

from .comm import Comm, failure_summary, new_checkpoint_group, quiet_single_process, release_groups
from .restore import WORLD_SIZE_POLICIES, DistributedRestore, restore_newest
from .saving import SaveJob, fail_save, open_save, open_saves
from .state import apply_rank_parts, check_rank_parts, restore_args, save_args

__all__ = ["DistributedCheckpointManager"]

log = logging.getLogger("ckpt_lesson.distributed")


class DistributedCheckpointManager(LoopMethods):
    """Save, purge and restore the DCP checkpoints of a multi-rank run.

    Args:
        run_dir: The run's folder on a file system every rank shares, or an fsspec URL such
            as ``s3://bucket/runs/a`` (every rank reaches the store itself, credentials from
            the environment or ``storage_options``).
            Default: ``$CKPT_LESSON_CKPT_DIR`` when set, else ``checkpoints``.
        keep_last: How many verified saves retention keeps (ignored when ``retention`` is given).
        every_steps: Save every this many steps (with ``every_seconds``, at least one is set).
        every_seconds: Save when this many seconds passed since the last save; the time rule
            is decided on rank 0 and broadcast, so ranks never disagree.
        clock: Time source for ``every_seconds``.
        retention: A policy with ``to_delete(steps, verified)``, e.g. ``KeepBest``.
        metadata: JSON dict copied into every manifest (run id, config hash).
        on_event: ``on_event(name, info)`` at each stage; ``info["rank"]`` says where.
            Every rank: ``save_begin``, ``file_begin``, ``file_partial``, ``file_written``,
            ``writes_complete``; rank 0: ``finish_begin``, ``metadata_written``,
            ``manifest_written``, ``published``, ``retention_delete``, ``quarantined``, ``save_end``.
        algo: Hash algorithm of the manifest records.
        thread_count: DCP writer threads per rank.
        publish: ``"rename"`` (a folder's default): publish by renaming a staging folder (a POSIX
            file system); ``"marker"`` (the only choice for a URL): write in place and publish by
            a commit marker written last (see :mod:`ckpt_lesson.runs.commit`).
        storage_options: A URL's fsspec options (``key``, ``secret``, ``client_kwargs``).
        lease_seconds: A URL's writer lease: a silent writer's upload counts as alive this
            long, and a live save renews its lease every third of it.

    Raises:
        CheckpointError: Invalid settings, ``run_dir`` is a file, ``publish="rename"`` for a
            URL, or the store client is missing (``pip install ckpt_lesson[s3]``). A store
            without conditional writes is refused at the first save.
        LoadEnvironmentError: The bucket cannot be reached; every rank raises it.

    Example:
        >>> mgr = DistributedCheckpointManager("/shared/run", keep_last=2, every_steps=100)  # doctest: +SKIP
        >>> restored = mgr.restore_latest(model, opt, sched)  # doctest: +SKIP
        >>> state = restored.state if restored else TrainState()  # doctest: +SKIP
        >>> # after each optimizer step, on every rank:
        >>> if mgr.should_save(state.step):  # doctest: +SKIP
        ...     mgr.save_async(model, opt, sched, state, data_state=loader.state_dict())
        >>> mgr.close()  # doctest: +SKIP
    """

    def __init__(
        self,
        run_dir: str | os.PathLike[str] | None = None,
        *,
        keep_last: int = 3,
        every_steps: int | None = None,
        every_seconds: float | None = None,
        clock: Callable[[], float] = time.monotonic,
        retention: RetentionPolicy | None = None,
        metadata: dict[str, Any] | None = None,
        on_event: Callable[[str, dict[str, Any]], None] | None = None,
        algo: str = DEFAULT_ALGO,
        thread_count: int = 1,
        publish: str | None = None,
        storage_options: Mapping[str, Any] | None = None,
        lease_seconds: float = DEFAULT_LEASE_SECONDS,
    ) -> None:
        if retention is not None and not callable(getattr(retention, "to_delete", None)):
            raise CheckpointError("retention needs a to_delete(steps, verified) method, e.g. KeepLastK(3).")
        self.policy = retention if retention is not None else KeepLastK(keep_last)
        self.saves = open_saves(
            default_run_dir(run_dir), self.policy, self._emit, publish=publish,
            storage_options=storage_options, lease_seconds=lease_seconds,
        )  # fmt: skip
        self.run_dir, self.url, self.publish = self.saves.run_dir, self.saves.where, self.saves.publish
        self._cadence = SaveCadence(every_steps, every_seconds, clock=clock)
        try:
            self.metadata = json.loads(json.dumps(dict(metadata or {}), allow_nan=False))
        except (TypeError, ValueError) as exc:
            raise CheckpointError(f"metadata must be a JSON dict: {exc}") from exc
        self.algo, self.thread_count, self.on_event = algo, thread_count, on_event
        # Two groups of our own: control decisions on the training thread, and DCP's collectives,
        # which an asynchronous save issues from its background thread (see comm.py).
        self._ctl_group = new_checkpoint_group()
        self._ctl = Comm(self._ctl_group)
        self._io_group = new_checkpoint_group()
        self.rank, self.world_size = self._ctl.rank, self._ctl.world_size
        self._no_dist = not self._ctl.enabled  # says so to DCP, which otherwise warns on every call
        self._pending: tuple[SaveJob, Future[Any]] | None = None
        self._closed = False
        self.last_restore: DistributedRestore | None = None
        self._ctl.on_rank0(self.saves.open_run)

    def __repr__(self) -> str:
        return f"DistributedCheckpointManager({self.url!r})"

    # ------------------------------------------------------------------ basics

    def __enter__(self) -> DistributedCheckpointManager:
        return self

    def __exit__(self, exc_type: object, *rest: object) -> None:
        try:
            self.close()
        except CheckpointError as exc:
            if exc_type is None:
                raise
            log.error("the save in flight failed too: %s", exc)  # the body's error is the one to see

    def close(self) -> None:
        """Wait for a save in flight, then free the manager's two gloo groups; collective.

        Call it before ``dist.destroy_process_group()``: the groups' native threads are joined here,
        not left to interpreter teardown (see :func:`~.comm.release_groups`). Later saves are refused.
        """
        if not self._closed:
            try:
                self.wait()
                self.saves.wait()  # rank 0's purge behind the last save
            finally:
                self._closed = True
                self.saves.close()  # a restore with no step after it goes unrecorded
                self._ctl, io_group, self._io_group = Comm.solo(), self._io_group, None
                release_groups(self._ctl_group, io_group)
                self._ctl_group = None

    def step_dir(self, step: int) -> Path | str:
        """Where the published save of ``step`` lives (whether or not it exists): a folder, or a URL."""
        return self.saves.step_dir(step)

    def clean_uploads(self) -> list[str]:
        """Remove now what dead writers left (as the first save of a store does); rank 0 only.

        A manager opened only to restore writes nothing to a store; a job that will write
        (or a harness that checks a restart cleans up) may call this before its first save.
        On a store it proves the conditional writes first, as the first save would.

        Returns:
            What was removed: staging folders, or ``step-XXXXXXXX/<save_id>`` prefixes of
            expired leases (``[]`` on other ranks).

        Raises:
            CheckpointError: The store lets a conditional create overwrite an object.
            LoadEnvironmentError: The store cannot be reached.

        Example:
            >>> mgr.clean_uploads()  # doctest: +SKIP
            ['step-00000004/5be0c1...']
        """
        return self.saves.clean_uploads() if self.rank == 0 else []

    def _emit(self, name: str, **info: Any) -> None:
        if self.on_event is not None:
            self.on_event(name, {**info, "rank": self.rank})

    def should_save(self, step: int) -> bool:
        """True when the cadence says ``step`` is due; the same answer on every rank (collective).

        The first call after a restore (or the first save) also records that restore (a store's
        ``recovery.jsonl``).
        """
        self.saves.step_done(step)
        due = self._cadence.should_save(step)
        if self._cadence.every_seconds is None:
            return due  # the step rule is a pure function of the step: no need to ask rank 0
        return bool(self._ctl.broadcast(due))

    # ------------------------------------------------------------------ save

    def save(self, *args: Any, data_state: Any = None, rng: Any = None) -> Path:
        """Save one step from every rank and commit it; collective.

        Two forms, as :class:`~ckpt_lesson.CheckpointManager`: ``save(step, state, *, rng=True)``
        (the state API, see :mod:`.state`) and ``save(model, optimizer, scheduler, state, *,
        data_state=None)`` (``data_state``: this rank's data position, plain values/tensors).
        ``rng`` may be this rank's generators captured earlier (before a prefetch).

        Returns:
            The published ``step-XXXXXXXX`` folder.

        Raises:
            CheckpointError: Invalid input on any rank, a good save of this step exists, or
                the save failed (nothing is published; the previous save stays the latest).

        Example:
            >>> mgr.save(40, {"model": model, "optimizer": opt, "loader": loader})  # doctest: +SKIP
            PosixPath('/shared/runs/a/step-00000040')
        """
        job = self._begin(args, data_state, rng)
        try:
            with quiet_single_process(self._no_dist):
                dcp.save(
                    job.state_dict,
                    storage_writer=job.writer,
                    process_group=self._io_group,
                    no_dist=self._no_dist,
                )
        except BaseException as exc:
            fail_save(job, exc, self.rank)
        return self._end(job)

    def save_async(self, *args: Any, data_state: Any = None, rng: Any = None) -> None:
        """Like :meth:`save` (either form), but write and commit in the background; collective.

        Returns once the state is copied to CPU (and the RNG captured), so
        training may go on changing the live tensors. At most one save is in
        flight: a second call first waits for the previous one.

        Raises:
            CheckpointError: As :meth:`save` for what is checked before writing;
                failures of the background part surface from :meth:`wait`.

        Example:
            >>> mgr.save_async(40, {"model": model, "optimizer": opt})  # doctest: +SKIP
            >>> # train on while it is written, then, before the next save or at exit:
            >>> mgr.wait()  # doctest: +SKIP
        """
        job = self._begin(args, data_state, rng)
        try:
            future = dcp.async_save(
                job.state_dict, storage_writer=job.writer, process_group=self._io_group, no_dist=self._no_dist
            )
        except BaseException as exc:
            fail_save(job, exc, self.rank)
        note_failure_of(future, job.step, explain=failure_summary)  # no wait() before exit: reported then
        self._pending = (job, future)

    def wait(self) -> Path | None:
        """Finish the asynchronous save in flight, if any; collective.

        Returns:
            The published folder, or ``None`` when nothing was in flight.

        Raises:
            CheckpointError: The background save failed (nothing was published).
        """
        if self._pending is None:
            return None
        job, future = self._pending
        self._pending = None
        try:
            future.result()
        except BaseException as exc:
            forget_failure(future)  # raised just below: the exit report has nothing left to say
            fail_save(job, exc, self.rank)
        return self._end(job)

    def _begin(self, args: tuple[Any, ...], data_state: Any, rng: Any) -> SaveJob:
        self.wait()  # at most one save in flight
        if self._closed:
            raise CheckpointError(f"{self.url}: this manager is closed; create a new one.")
        job = open_save(self.saves, self._ctl, save_args(args, data_state, rng), metadata=self.metadata,
                        algo=self.algo, thread_count=self.thread_count, emit=self._emit)  # fmt: skip
        self._cadence.mark_saved(job.step)  # at request time: a save in flight must not be requested again
        return job

    def _end(self, job: SaveJob) -> Path:
        job.stack.close()  # rank 0: releases the lock or lease (the save is published by now)
        if self.rank == 0:
            self.saves.clean()
        self._emit("save_end", step=job.step, path=str(job.final))
        return job.final

    # ------------------------------------------------------------------ restore

    def restore_latest(
        self,
        *args: Any,
        strict: bool = True,
        on_world_size_change: str = "refuse",
        reseed_base: int = 0,
        check_values: Callable[[dict[str, Any], int], None] | None = None,
    ) -> Any:
        """Restore the newest save every rank agrees is intact; collective.

        Damaged newer saves (a flipped byte, a missing file) are skipped and logged. A crafted
        file (:class:`~ckpt_lesson.UnsafeCheckpointError`) and a save that does not fit (world
        size under ``"refuse"``, scheduler) are raised at once: an older save would not fix them.

        Two forms: ``restore_latest(state, *, strict=True)`` (the state API: returns a
        :class:`~ckpt_lesson.Restored`) and ``restore_latest(model, optimizer, scheduler=None)``.

        Args:
            args: The state mapping, or model, optimizer and scheduler (restored in place).
            strict: State API: refuse parts present on one side only.
            on_world_size_change: ``"refuse"`` (default) or ``"reseed"`` (see :mod:`.restore`).
            reseed_base: Base seed for ``"reseed"``.
            check_values: State API: ``check_values(values, step)`` sees a save's values on
                every rank before anything is restored, and may raise to refuse it.

        Returns:
            This rank's :class:`~.restore.DistributedRestore`, or ``None`` for a run with no saves.

        Raises:
            CheckpointError: Saves exist but none is usable (each reason listed), or as above.

        Example:
            >>> restored = mgr.restore_latest(model, opt, sched)  # doctest: +SKIP
            >>> loader.load_state_dict(restored.data_state)  # doctest: +SKIP
        """
        if self._closed:
            raise CheckpointError(f"{self.url}: this manager is closed; create a new one.")
        if on_world_size_change not in WORLD_SIZE_POLICIES:
            raise CheckpointError(f"on_world_size_change must be one of {WORLD_SIZE_POLICIES}.")
        self.wait()
        state, model, optimizer, scheduler = restore_args(args)
        check = None
        if state is not None:

            def check(data: Any, *, source: str, step: int) -> None:
                values = check_rank_parts(data, state, source=source, strict=strict)["values"]
                if check_values is not None:
                    check_values(values, step)

        restored = restore_newest(
            saves=self.saves, ctl=self._ctl, io_group=self._io_group,
            model=model, optimizer=optimizer, scheduler=scheduler, check=check,
            on_world_size_change=on_world_size_change, reseed_base=reseed_base,
        )  # fmt: skip
        if restored is not None:
            self.saves.mark_good(restored.step)
            self._cadence.mark_saved(restored.step)
            self.last_restore = restored
            if self.rank == 0:  # a store's recovery record, written once the next step is done
                self.saves.restored(restored)
        if state is None or restored is None:
            return restored
        values = apply_rank_parts(restored.data_state, state, source=str(restored.path), strict=strict)
        return Restored(
            step=restored.step, values=values, rng=restored.rng, path=restored.path,
            save_id=restored.save_id, skipped=list(restored.skipped),
        )  # fmt: skip
