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
6. release the lock; retention runs *behind* the save, on its own thread (runs/deleter.py).

A crash before step 5 leaves only a staging folder, which nobody mistakes for
a save; a crash after it leaves a complete, verifiable save. Discovery trusts
nothing else: a ``step-*`` folder counts only if its manifest exists and every
part it lists has the recorded size and sha256.

Why ``flock`` and not a pid file: the kernel releases a ``flock`` when its
owner dies, even by ``SIGKILL``, so "can I take the lock?" is an exact test of
"is the writer dead?". A pid can be reused; a lock cannot lie. One writer per
run directory (readers, scans and restores may be many).

This class reads as the protocol; each step is a small function elsewhere: folder moves in
:mod:`~ckpt_lesson.runs.commit`, parts in :mod:`~ckpt_lesson.runs.save_parts`, settings in
:mod:`~ckpt_lesson.runs.manager_config`, restore checks in :mod:`~ckpt_lesson.runs.restore`.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from ckpt_lesson.errors import CheckpointError
from ckpt_lesson.files.apply import Restored
from ckpt_lesson.files.hashing import DEFAULT_ALGO
from ckpt_lesson.files.payload import build_state_payload
from ckpt_lesson.files.storage import is_store_url
from ckpt_lesson.runs.cadence import SaveCadence
from ckpt_lesson.runs.commit import clean_stale, open_staging, publish
from ckpt_lesson.runs.contract import ENV_POLICIES
from ckpt_lesson.runs.deleter import BackgroundRetention
from ckpt_lesson.runs.loop_api import LoopMethods, default_run_dir
from ckpt_lesson.runs.manager_config import EventHook, ManagerConfig
from ckpt_lesson.runs.restore import check_resume_contract, restore_newest
from ckpt_lesson.runs.restore_state import loader_for
from ckpt_lesson.runs.retention import RetentionPolicy
from ckpt_lesson.runs.save_parts import refuse_if_already_saved, stage_payload_save, stage_save
from ckpt_lesson.runs.save_source import Candidates, SaveSource, folder_candidates
from ckpt_lesson.runs.scan import MANIFEST_NAME, ScanResult, inspect_save, published_steps, step_dir_name
from ckpt_lesson.runs.state_args import is_state_call, positional_save_args

__all__ = ["CheckpointManager"]

log = logging.getLogger(__name__)


class CheckpointManager(LoopMethods):
    """Save, purge, scan and restore the checkpoints of one run directory.

    Args:
        run_dir: The run's folder (created if missing). Default: ``$CKPT_LESSON_CKPT_DIR``
            when set (``resume-test`` sets it), else ``checkpoints``.
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

    Raises:
        CheckpointError: Invalid settings, or ``run_dir`` is a file.

    Example:
        >>> with CheckpointManager("runs/a", keep_last=2, every_steps=50) as mgr:  # doctest: +SKIP
        ...     start, state = mgr.resume(model=model, optimizer=opt)  # 0 on a first run
        ...     for step in range(start + 1, 501):
        ...         train_one_step(model, opt)
        ...         mgr.save_if_due(step, state)
    """

    def __new__(cls, run_dir: Any = None, *args: Any, **kwargs: Any) -> CheckpointManager:
        # A URL (s3://bucket/prefix): same API, plus an object store's commit (runs/store_manager.py).
        if cls is CheckpointManager and is_store_url(default_run_dir(run_dir)):
            from ckpt_lesson.runs.store_manager import StoreCheckpointManager

            return super().__new__(StoreCheckpointManager)
        return super().__new__(cls)

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
    ) -> None:
        if env_policy not in ENV_POLICIES:
            raise CheckpointError(f"env_policy must be one of {ENV_POLICIES}, got {env_policy!r}.")
        self.expect = dict(expect or {})
        self.env_policy = env_policy
        self._contract: tuple[Any, list[str]] | None = None
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
        self.run_dir = Path(default_run_dir(run_dir))
        if self.run_dir.exists() and not self.run_dir.is_dir():
            raise CheckpointError(f"{self.run_dir}: exists and is not a directory; pass a run directory.")
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.on_event = on_event
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
        return f"CheckpointManager({str(self.run_dir)!r}, keep_last={c.keep_last}, layout={c.layout!r})"

    def close(self) -> None:
        """Wait for the retention pass in flight, then stop accepting saves."""
        self._retention.wait()
        self._closed = True

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

    # ------------------------------------------------------------------ discovery

    def _published(self) -> list[int]:
        return published_steps(self.run_dir)

    def all_steps(self) -> list[int]:
        """Published steps that have a manifest, ascending. Nothing is hashed."""
        self._retention.wait()
        return [s for s in self._published() if (self.step_dir(s) / MANIFEST_NAME).is_file()]

    def verify_step(self, step: int) -> ScanResult:
        """Hash every part of one save against its manifest; updates the known-good set."""
        self._retention.wait()
        result, _ = inspect_save(self.step_dir(step))
        if result.ok:
            self._retention.known.mark_hashed(step)
        else:
            self._retention.known.forget([step])
        return result

    def latest_step(self) -> int | None:
        """The newest step whose save verifies (hashing newest first), or ``None``."""
        for step in reversed(self._published()):
            if self.verify_step(step).ok:
                return step
        return None

    # ------------------------------------------------------------------ save

    def save(self, *args: Any, extras: dict[str, Any] | None = None, rng: Any = None) -> Path:
        """Save the training state at a step with the commit protocol, then apply retention.

        Two forms:

        * ``save(step, state, *, rng=True)``: the state API (:mod:`~ckpt_lesson.files.payload`);
          ``rng=False`` saves no generators, a dict from ``capture_rng_state()`` taken earlier
          (before a prefetch) is saved as given.
        * ``save(model, optimizer, scheduler, train_state, *, extras=None, rng=None)``: positional.

        Returns:
            The published ``step-XXXXXXXX`` folder.

        Raises:
            CheckpointError: The manager is closed, a part or value is refused (named, before
                anything is written), a good save of this step exists, or ``verify_on_save``
                found the written bytes differ (nothing is published then).

        Example:
            >>> mgr.save(240, {"model": model, "optimizer": opt, "best": 0.31}).name  # doctest: +SKIP
            'step-00000240'
        """
        self.check_open()
        if is_state_call(args):
            step, state = args
            if extras is not None:
                raise CheckpointError("extras= is for the positional form; put values in the state.")
            return self._save_payload(build_state_payload(step, state, rng=rng, data=self.config.data))
        model, optimizer, scheduler, state = positional_save_args(args)
        step = state.step
        return self._commit(step, lambda staging: stage_save(
            staging, self.config, model, optimizer, scheduler, state, extras=extras, rng=rng, emit=self._emit
        ))  # fmt: skip

    def save_payload(self, payload: dict[str, Any]) -> Path:
        """Commit a payload from ``build_state_payload`` (or an asynchronous snapshot of one)."""
        return self._save_payload(payload)

    def _save_payload(self, payload: dict[str, Any]) -> Path:
        self.check_open()
        return self._commit(payload["step"], lambda staging: stage_payload_save(
            staging, self.config, payload, emit=self._emit
        ))  # fmt: skip

    def _commit(self, step: int, stage: Callable[[Path], dict[str, Any]]) -> Path:
        refuse_if_already_saved(self.step_dir(step), step)
        started = time.perf_counter()
        # Ctrl-C or an error anywhere in this block: open_staging removes the staging folder
        # (garbage, never a save) and releases the lock, so the error surfaces with nothing half-made.
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
        # waits only if the previous pass is still running (see runs/deleter.py).
        self._retention.submit(step, checked=self.config.verify_on_save is not False)
        return final

    # ------------------------------------------------------------------ retention and cleanup

    def apply_retention(self, *, fresh: tuple[int, ...] = ()) -> list[int]:
        """Run one retention pass now, on this thread; returns the steps it deleted.

        Every save the policy would keep instead gets the cheap checks, and the
        least recently hashed of them is hashed again (``fresh`` ones count as
        hashed just now): see :mod:`~ckpt_lesson.runs.reverify`.
        """
        self._retention.wait()
        for step in fresh:
            self._retention.known.mark_hashed(step)
        return self._retention.run_now()

    def clean_stale(self, *, spare_own: bool = False) -> list[str]:
        """Remove staging folders of dead writers and ``.deleting-`` leftovers; see ``commit.clean_stale``.

        ``spare_own`` leaves this process's staging folders alone (the background pass, which may
        run while a save of this process is starting).
        """
        return clean_stale(self.run_dir, spare_pid=os.getpid() if spare_own else None)

    # ------------------------------------------------------------------ restore

    def restore_latest(
        self, *args: Any, strict: bool = True, map_location: Any = "cpu", mmap: bool = True
    ) -> Any:
        """Restore the newest save that verifies; skip (and log) damaged newer ones.

        Two forms:

        * ``restore_latest(state, *, strict=True)``: the state API; objects restored in place,
          the RNG too, a :class:`~ckpt_lesson.files.apply.Restored` returned.
          ``strict=False`` ignores parts present on one side only.
        * ``restore_latest(model, optimizer, scheduler)``: returns the :class:`TrainState`.

        Either way a file is read once, into a sealed private copy that is verified and loaded
        (``mmap=True`` maps the copy, ``mmap=False`` reads it); its changes after the hash do not count.

        Returns:
            The result above, or ``None`` when the run directory holds no save at all (a fresh start).

        Raises:
            CheckpointError: Saves exist but none is usable (each reason listed); errors that
                are not damage (a state that does not fit, an unsafe file) are raised at once.

        Example:
            >>> restored = mgr.restore_latest({"model": model, "best": None})  # doctest: +SKIP
            >>> start = restored.step + 1 if restored else 1  # doctest: +SKIP
        """
        self.check_open()
        self._retention.wait()
        self._contract = None
        self.last_restore = {}
        load = loader_for(
            args, strict=strict, map_location=map_location, mmap=mmap, check_contract=self._check_contract
        )
        found = restore_newest(self._restore_candidates(), load, record=self.last_restore)
        self._retention.known.forget([s["step"] for s in self.last_restore["skipped"]])
        if found is None:
            return None
        step, result = found
        self._retention.known.mark_hashed(step)
        self._cadence.mark_saved(step)
        contract = self._contract
        self.last_restore["contract"] = contract[0].to_dict() if contract else None
        self.last_restore["contract_warnings"] = contract[1] if contract else []
        if isinstance(result, Restored):
            result.skipped = list(self.last_restore["skipped"])
        return result

    def _restore_candidates(self) -> Candidates:
        """The saves :meth:`restore_latest` may choose from: the run directory's published ones."""
        return folder_candidates(self.run_dir, self._published())._replace(relist=self._published)

    def _check_contract(self, target: SaveSource, manifest: dict[str, Any]) -> None:
        """Refuse a save this run must not resume (see ``restore.check_resume_contract``)."""
        self._contract = check_resume_contract(
            target, manifest, expect=self.expect, env_policy=self.env_policy, emit=self._emit
        )
