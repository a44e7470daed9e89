"""CheckpointManager: every save is committed, every restore is verified.

A single file written atomically is safe; a *run* of checkpoints needs more:
a save made of several files, old saves purged without ever leaving zero good
ones, and a restore that finds the newest save that is actually intact. The
manager does that with a commit protocol borrowed from databases:

1. ``mkdir RUN_DIR/.staging-step-XXXXXXXX-<pid>-<hex8>/`` and hold an
   exclusive ``flock`` on its ``.lock`` file for the whole save;
2. write every part atomically, hashing each while it is written;
3. write ``manifest.json`` (every part's size and sha256), fsync the folder;
4. check the parts (``verify_on_save``: sizes, or a read-back from the device);
5. publish: ``os.replace`` the staging folder to ``RUN_DIR/step-XXXXXXXX``
   and fsync ``RUN_DIR``: one atomic rename makes the whole save visible;
6. release the lock; retention runs *behind* the save, on its own thread (runs/retention.py).

A crash before step 5 leaves only a staging folder, which nobody mistakes for
a save; a crash after it leaves a complete, verifiable save. Discovery trusts
nothing else: a ``step-*`` folder counts only if its manifest exists and every
part it lists has the recorded size and sha256. Why a ``flock`` and not a pid file
is told in :mod:`~ckpt_lesson.runs.commit`. One writer per run directory (readers,
scans and restores may be many).

A URL (``s3://bucket/prefix``) gives the same manager over an object store: each save is
made this way in a local cache folder, then uploaded and committed by a conditional marker
under a lease (:class:`~ckpt_lesson.runs.store_run.StoreRun`, held as ``self.store``).

This class reads as the protocol; each step is a small function elsewhere: folder moves in
:mod:`~ckpt_lesson.runs.commit`, parts in :mod:`~ckpt_lesson.runs.save_parts`, settings in
:mod:`~ckpt_lesson.runs.manager_config`, listing and restoring in :mod:`~ckpt_lesson.runs.manager_restore`.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from ckpt_lesson.errors import CheckpointError
from ckpt_lesson.files.hashing import DEFAULT_ALGO
from ckpt_lesson.files.payload import build_state_payload
from ckpt_lesson.files.storage import Storage, is_store_url
from ckpt_lesson.files.storage_transfer import DEFAULT_TIMEOUT
from ckpt_lesson.runs.commit import clean_stale, open_staging, publish
from ckpt_lesson.runs.contract import ENV_POLICIES
from ckpt_lesson.runs.cost import SaveCadence
from ckpt_lesson.runs.layout import step_dir_name
from ckpt_lesson.runs.loop_api import LoopMethods, default_run_dir
from ckpt_lesson.runs.manager_config import EventHook, ManagerConfig, is_state_call, positional_save_args
from ckpt_lesson.runs.manager_restore import RestoreMethods
from ckpt_lesson.runs.retention import BackgroundRetention, RetentionPolicy
from ckpt_lesson.runs.save_parts import refuse_if_already_saved, stage_payload_save, stage_save
from ckpt_lesson.runs.store_run import DEFAULT_LEASE_SECONDS, StoreRun

__all__ = ["CheckpointManager", "StoreCheckpointManager"]


class CheckpointManager(RestoreMethods, LoopMethods):
    """Save, purge, scan and restore the checkpoints of one run, in a folder or an object store.

    Args:
        run_dir: The run's folder (created if missing), or its prefix in an object store
            (``s3://bucket/runs/exp1``; also ``gs://``, ``az://``). Default:
            ``$CKPT_LESSON_CKPT_DIR`` when set (``resume-test`` sets it), else ``checkpoints``.
        keep_last: How many verified saves retention keeps.
        every_steps: Cadence for :meth:`should_save`: every this many steps.
        every_seconds: Cadence for :meth:`should_save`: this many seconds after the last save
            (at least one of the two is set).
        num_shards: ``None`` for one ``checkpoint.pt`` per save, else that many shards.
        clock: Time source for ``every_seconds`` (tests pass a fake one).
        verify_on_save: How saves are checked; see :class:`~ckpt_lesson.ManagerConfig`.
        scrub_bytes_per_s: How saves are re-checked; see :class:`~ckpt_lesson.ManagerConfig`.
        background_retention: How saves are deleted; see :class:`~ckpt_lesson.ManagerConfig`.
        hash_algo: How saves are hashed; see :class:`~ckpt_lesson.ManagerConfig`.
        zip_crc32: How saves are written (zip CRC32s); see :class:`~ckpt_lesson.ManagerConfig`.
        data: Dataset description recorded in payload and manifest, e.g.
            ``{"fingerprint": ds.fingerprint(), "order_seed": 11}``.
        metadata: Caller's dict copied into every manifest (run id, config hash).
        on_event: ``on_event(name, info)`` at each stage of a save (the
            names are listed at :data:`~ckpt_lesson.runs.manager_config.EventHook`).
        retention: A policy object overriding ``keep_last`` (e.g. ``KeepBest``).
        expect: What a resume must match, checked from each candidate's
            manifest *before* any tensor is read: ``{"data": {...},
            "config_fingerprint": ..., "model_fingerprint": ...}`` (see
            :mod:`ckpt_lesson.runs.contract`). The environment is always compared.
        env_policy: ``"refuse"`` (default), ``"warn"`` or ``"allow"`` an
            environment change on resume; data/model/config changes are always refused.
        storage_options: (store) fsspec options; ``None`` reads credentials and endpoint
            from the environment (``AWS_ENDPOINT_URL``, ...).
        cache_dir: (store) Local scratch folder where each save is staged before its upload
            (and a sharded save is downloaded for its restore). By default a fresh
            ``ckpt-lesson-cache-*`` folder in ``$TMPDIR``, removed by :meth:`close` or at exit,
            reclaimed by a later manager if this process is killed; a folder passed is never removed.
        lease_seconds: (store) How long this writer's uploads count as alive after its
            last sign of life; a dead writer's leftovers go after that.
        read_only: (store) Refuse every save. Without it a manager writes nothing either until
            its first save (the conditional-write probe and the cleanup of dead writers' uploads
            run then), so read-only credentials can restore, scan and list.
        timeout: (store) Seconds any one store request may wait (default 300): a store that goes
            silent is a one-line ``LoadEnvironmentError`` naming the bucket and what waited.

    Raises:
        CheckpointError: Invalid settings, ``run_dir`` is a file, a store option given for a
            folder, or the store client is missing (``pip install ckpt_lesson[s3]``).
        LoadEnvironmentError: The bucket cannot be reached (or does not exist).

    Example:
        >>> with CheckpointManager("runs/a", keep_last=2, every_steps=50) as mgr:  # doctest: +SKIP
        ...     start, state = mgr.resume(model=model, optimizer=opt)  # 0 on a first run
        ...     for step in range(start + 1, 501):
        ...         train_one_step(model, opt)
        ...         mgr.save_if_due(step, state)
    """

    def __init__(
        self,
        run_dir: str | os.PathLike[str] | None = None,
        *,
        keep_last: int = 3,
        every_steps: int | None = None,
        every_seconds: float | None = None,
        num_shards: int | None = None,
        clock: Callable[[], float] = time.monotonic,
        verify_on_save: bool | str = "writer",
        data: dict[str, Any] | None = None,
        metadata: dict[str, Any] | None = None,
        on_event: EventHook | None = None,
        retention: RetentionPolicy | None = None,
        expect: Mapping[str, Any] | None = None,
        env_policy: str = "refuse",
        hash_algo: str = DEFAULT_ALGO,
        zip_crc32: bool = False,
        scrub_bytes_per_s: float | None = None,
        background_retention: bool = True,
        storage_options: Mapping[str, Any] | None = None,
        cache_dir: str | os.PathLike[str] | None = None,
        lease_seconds: float = DEFAULT_LEASE_SECONDS,
        read_only: bool = False,
        timeout: float = DEFAULT_TIMEOUT,
    ) -> None:
        if env_policy not in ENV_POLICIES:
            raise CheckpointError(f"env_policy must be one of {ENV_POLICIES}, got {env_policy!r}.")
        self.expect = dict(expect or {})
        self.env_policy = env_policy
        self.config = ManagerConfig(
            keep_last=keep_last,
            every_steps=every_steps,
            every_seconds=every_seconds,
            num_shards=num_shards,
            verify_on_save=verify_on_save,
            data=data,
            metadata=metadata or {},
            retention=retention,
            hash_algo=hash_algo,
            zip_crc32=zip_crc32,
            scrub_bytes_per_s=scrub_bytes_per_s,
            background_retention=background_retention,
        )
        self.on_event = on_event
        location = default_run_dir(run_dir)
        #: The object-store side of this run (``None`` for a folder): where saves are committed.
        self.store: StoreRun | None = None
        if is_store_url(location):
            self.store = StoreRun(
                str(location), storage_options, cache_dir, lease_seconds, read_only, timeout, self._emit
            )
            location = self.store.cache
        else:
            given = {"storage_options": storage_options, "cache_dir": cache_dir, "read_only": read_only}
            wrong = [k for k, v in given.items() if v] + (["timeout"] if timeout != DEFAULT_TIMEOUT else [])
            if wrong or lease_seconds != DEFAULT_LEASE_SECONDS:
                raise CheckpointError(
                    f"{location}: {', '.join(wrong) or 'lease_seconds'} only apply to an object store "
                    "(s3://bucket/prefix); leave them out for a folder."
                )
        #: The run's folder (for a store: the local cache each save is staged in).
        self.run_dir = Path(location)
        if self.run_dir.exists() and not self.run_dir.is_dir():
            raise CheckpointError(f"{self.run_dir}: exists and is not a directory; pass a run directory.")
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._cadence = SaveCadence(every_steps, every_seconds, clock=clock)
        # Retention's worker owns what is known to verify (written+checked here, or verified by a
        # scan/restore); everything below that reads or changes it waits for the worker first.
        self._retention = BackgroundRetention(
            self.run_dir,
            self.config.policy,
            emit=self._emit,
            after_pass=lambda: self.clean_stale(spare_own=True),
            scrub_bytes_per_s=scrub_bytes_per_s,
            background=background_retention,
        )
        self._closed = False
        #: What the last :meth:`restore_latest` did (chosen step, save_id, skipped saves, manifest).
        self.last_restore: dict[str, Any] | None = None
        #: What the last :meth:`save` did (step, path, save_id, seconds).
        self.last_save: dict[str, Any] | None = None
        self.clean_stale()

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        c = self.config
        return f"CheckpointManager({self.url!r}, keep_last={c.keep_last}, layout={c.layout!r})"

    @property
    def url(self) -> str:
        """Where the run lives: its folder, or its object-store prefix."""
        return self.store.url if self.store is not None else str(self.run_dir)

    @property
    def storage(self) -> Storage | None:
        """The object store's backend (``None`` for a folder)."""
        return self.store.storage if self.store is not None else None

    def close(self) -> None:
        """Wait for the retention pass in flight, stop accepting saves, remove a store's default cache."""
        self._retention.wait()
        self._closed = True
        if self.store is not None:
            self.store.close()

    def wait_retention(self) -> list[int]:
        """Wait until the background retention pass (if any) is done; returns every step deleted so far.

        Example:
            >>> deleted = mgr.wait_retention()  # doctest: +SKIP
        """
        self._retention.wait()
        return list(self._retention.deleted)

    def check_open(self) -> None:
        """Raise :class:`CheckpointError` once :meth:`close` was called."""
        if self._closed:
            raise CheckpointError(f"{self.run_dir}: this CheckpointManager is closed; create a new one.")

    def _emit(self, name: str, **info: Any) -> None:
        if self.on_event is not None:
            self.on_event(name, info)

    def step_dir(self, step: int) -> Path:
        """Where the published save of ``step`` lives (whether or not it exists)."""
        return self.run_dir / step_dir_name(step)

    @property
    def last_saved_step(self) -> int | None:
        """Step of the last save (or restore) this manager made; ``None`` before any."""
        return self._cadence.last_step

    def should_save(self, step: int) -> bool:
        """True when the cadence says the state after ``step`` steps is due for a save."""
        return self._cadence.should_save(step)

    # ------------------------------------------------------------------ save

    def save(self, *args: Any, extras: dict[str, Any] | None = None, rng: Any = None) -> Any:
        """Save the training state at a step with the commit protocol, then apply retention.

        Two forms:

        * ``save(step, state, *, rng=True)``: the state API (:mod:`~ckpt_lesson.files.payload`);
          ``rng=False`` saves no generators, a dict from ``capture_rng_state()`` taken earlier
          (before a prefetch) is saved as given.
        * ``save(model, optimizer, scheduler, train_state, *, extras=None, rng=None)``: positional.

        Returns:
            The published ``step-XXXXXXXX`` folder; for a store, the committed save's URL.

        Raises:
            CheckpointError: The manager is closed, a part or value is refused (named, before
                anything is written), a good save of this step exists, or ``verify_on_save``
                found the written bytes differ (nothing is published then). For a store also:
                ``read_only``, or the lease ran out before the commit (nothing is committed).
            CommitConflictError: Another writer committed this step to the store first.

        Example:
            >>> mgr.save(240, {"model": model, "optimizer": opt, "best": 0.31}).name  # doctest: +SKIP
            'step-00000240'
        """
        self.check_open()
        if is_state_call(args):
            step, state = args
            if extras is not None:
                raise CheckpointError("extras= is for the positional form; put values in the state.")
            return self.save_payload(build_state_payload(step, state, rng=rng, data=self.config.data))
        model, optimizer, scheduler, state = positional_save_args(args)
        step = state.step
        return self._commit(step, lambda staging: stage_save(
            staging, self.config, model, optimizer, scheduler, state, extras=extras, rng=rng, emit=self._emit
        ))  # fmt: skip

    def save_payload(self, payload: dict[str, Any]) -> Any:
        """Commit a payload from ``build_state_payload`` (or an asynchronous snapshot of one)."""
        self.check_open()
        return self._commit(payload["step"], lambda staging: stage_payload_save(
            staging, self.config, payload, emit=self._emit
        ))  # fmt: skip

    def _commit(self, step: int, stage: Callable[[Path], dict[str, Any]]) -> Any:
        if self.store is not None:
            self.store.open_for_writing()  # refuse a reader; at the first save prove the marker fences
        refuse_if_already_saved(self.step_dir(step), step)
        started = time.perf_counter()
        # Ctrl-C or an error in this block: open_staging removes the staging folder and releases the lock.
        with open_staging(self.run_dir, step) as staging:
            self._emit("save_begin", step=step, staging=staging.name)
            manifest = stage(staging)  # parts, then the sealed manifest (fsynced), then the optional re-read
            final = publish(
                staging,
                self.step_dir(step),
                on_quarantined=lambda aside: self._emit("quarantined", step=step, path=str(aside)),
            )
            self._cadence.mark_saved(step)
            self._emit("published", step=step, path=str(final), save_id=manifest["save_id"])
            seconds = time.perf_counter() - started
            save_id = manifest["save_id"]
            self.last_save = {"step": step, "path": str(final), "save_id": save_id, "seconds": seconds}
            self._emit("save_end", step=step, path=str(final), seconds=seconds)
        # Retention (and the cleanup of stale folders) runs behind, off this thread; this call
        # waits only if the previous pass is still running (see runs/retention.py).
        self._retention.submit(step, checked=self.config.verify_on_save is not False)
        if self.store is None:
            return final
        # A store: the local save is scratch; upload and commit it, then retention runs on the store.
        url = self.store.upload(final, step, algo=self.config.hash_algo, policy=self.config.policy)
        self.last_save["path"] = url
        return url

    # ------------------------------------------------------------------ retention and cleanup

    def apply_retention(self) -> list[int]:
        """Run one retention pass now, on this thread; returns the steps it deleted.

        Every save the policy would keep instead gets the cheap checks, and the
        least recently hashed of them is hashed again: see :mod:`~ckpt_lesson.runs.reverify`.
        """
        return self._retention.run_now()  # it waits for the pass in flight first

    def clean_stale(self, *, spare_own: bool = False) -> list[str]:
        """Remove staging folders of dead writers and ``.deleting-`` leftovers; see ``commit.clean_stale``.

        ``spare_own`` leaves this process's staging folders alone (the background pass, which may
        run while a save of this process is starting).
        """
        local = clean_stale(self.run_dir, spare_pid=os.getpid() if spare_own else None)
        # A store's uploads whose writer's lease expired, once this manager has saved.
        return local + self.store.clean_stale() if self.store is not None else local


#: The name of the object-store manager before there was one manager: the same class.
StoreCheckpointManager = CheckpointManager
