"""Finding and restoring a run's saves: the reading half of the ``CheckpointManager``.

The manager is split by job: :mod:`~ckpt_lesson.runs.manager` writes saves,
this mixin lists, verifies and restores them through :mod:`~ckpt_lesson.runs.restore`;
a folder and a bucket differ only in the list of candidates.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ckpt_lesson.errors import CheckpointError, StateMismatchError
from ckpt_lesson.files.apply import Restored
from ckpt_lesson.files.checkpoint import BUCKETS
from ckpt_lesson.files.payload import PARTS_SCHEMA
from ckpt_lesson.files.schema import current_env
from ckpt_lesson.runs.contract import check_contract, resume_report
from ckpt_lesson.runs.layout import MANIFEST_NAME, ScanResult, inspect_save, published_steps
from ckpt_lesson.runs.manager_config import positional_restore_args
from ckpt_lesson.runs.restore import Candidates, SaveSource, load_newest_good, load_save, log

if TYPE_CHECKING:  # for the annotations only
    from ckpt_lesson.runs.cost import SaveCadence
    from ckpt_lesson.runs.retention import BackgroundRetention
    from ckpt_lesson.runs.store_run import StoreRun

__all__ = ["RestoreMethods"]


class RestoreMethods:
    """Discovery and restore for :class:`~ckpt_lesson.runs.manager.CheckpointManager` (a mixin)."""

    # Set by CheckpointManager.__init__ (as are check_open, step_dir and _emit).
    run_dir: Path
    store: StoreRun | None
    expect: dict[str, Any]
    env_policy: str
    _retention: BackgroundRetention
    _cadence: SaveCadence
    last_restore: dict[str, Any] | None

    # ------------------------------------------------------------------ discovery

    def all_steps(self) -> list[int]:
        """Saved steps, ascending (folders with a manifest, or committed steps). Nothing is hashed."""
        if self.store is not None:
            return self.store.all_steps()
        self._retention.wait()
        return [s for s in published_steps(self.run_dir) if (self.step_dir(s) / MANIFEST_NAME).is_file()]

    def verify_step(self, step: int) -> ScanResult:
        """Hash every part of one local save against its manifest; updates the known-good set."""
        self._retention.wait()
        result, _ = inspect_save(self.step_dir(step))
        if result.ok:
            self._retention.known.mark_hashed(step)
        else:
            self._retention.known.forget([step])
        return result

    def latest_step(self) -> int | None:
        """The newest step whose save verifies (a store's: marker and manifest, parts not downloaded)."""
        if self.store is not None:
            return self.store.latest_step()
        for step in reversed(published_steps(self.run_dir)):
            if self.verify_step(step).ok:
                return step
        return None

    # ------------------------------------------------------------------ restore

    def restore_latest(
        self,
        *args: Any,
        strict: bool = True,
        map_location: Any = "cpu",
        mmap: bool = True,
        check_values: Callable[[dict[str, Any], int], None] | None = None,
    ) -> Any:
        """Restore the newest save that verifies; skip (and log) damaged ones, following the run.

        Two forms:

        * ``restore_latest(state, *, strict=True)``: the state API; objects restored in place,
          the RNG too, a :class:`~ckpt_lesson.files.apply.Restored` returned.
          ``strict=False`` ignores parts present on one side only.
        * ``restore_latest(model, optimizer, scheduler)``: returns the :class:`TrainState`.

        Either way a file is read once, into a sealed private copy that is verified and loaded
        (``mmap=True`` maps the copy, ``mmap=False`` reads it); its changes after the hash do not count.
        From a store, each committed save is streamed into memory and verified there (``mmap`` has
        no effect on it); a sharded one goes through the cache folder and is removed after.
        ``check_values(values, step)`` (state API) sees a save's values before anything is
        restored and may raise to refuse it (``resume`` checks its tensor values there).

        Returns:
            The result above, or ``None`` when the run holds no save at all (a fresh start).

        Raises:
            CheckpointError: Saves exist but none is usable (each reason listed); errors that
                are not damage (a state that does not fit, an unsafe file) are raised at once.
            LoadEnvironmentError: The store cannot be reached (bucket named).

        Example:
            >>> restored = mgr.restore_latest({"model": model, "best": None})  # doctest: +SKIP
            >>> start = restored.step + 1 if restored else 1  # doctest: +SKIP
        """
        self.check_open()
        self._retention.wait()
        skipped: list[dict[str, Any]] = []
        # Filled at once, so that a failed restore still reports what it skipped.
        self.last_restore = dict(step=None, save_id=None, path=None, skipped=skipped, manifest=None)
        # The call form first, so wrong arguments are named before anything is listed or read.
        if len(args) == 1 and not isinstance(args[0], Mapping):
            raise CheckpointError(
                f"state must be a mapping of named parts, e.g. {{'model': model, 'optimizer': opt}}, "
                f"got {type(args[0]).__name__}."
            )
        into = args[0] if len(args) == 1 else positional_restore_args(args)
        candidates = self._restore_candidates()
        started = time.perf_counter()
        if not candidates.steps:
            log.info("%s: no saves; starting fresh", candidates.where)
            return None
        contracts: list[tuple[Any, list[str]]] = []  # (report, warnings) of each save that passed it
        load = partial(
            load_save,
            into=into,
            strict=strict,
            map_location=map_location,
            mmap=mmap,
            check_values=check_values,
            check_contract=lambda target, manifest: contracts.append(self._check_contract(target, manifest)),
        )
        try:
            step, target, manifest, result = load_newest_good(candidates, load, skipped=skipped)
        finally:
            if self.store is not None:
                self.store.drop_downloads()
        self._retention.known.forget([s["step"] for s in skipped])
        # The chosen save's contract: load_save checks it before reading any of its parts.
        report, warnings = contracts[-1]
        self.last_restore.update(
            step=step,
            save_id=manifest.get("save_id"),
            # A store's URL, also for a save that went through the cache folder.
            path=self.store.url_of(step) if self.store is not None else str(target),
            layout=manifest["layout"],
            manifest=manifest,
            seconds=time.perf_counter() - started,
            contract=report.to_dict(),
            contract_warnings=warnings,
        )
        self._retention.known.mark_hashed(step)
        self._cadence.mark_saved(step)
        if isinstance(result, Restored):
            result.skipped = list(skipped)
            if self.store is not None:
                result.path = self.last_restore["path"]
        return result

    def _restore_candidates(self) -> Candidates:
        """The saves :meth:`restore_latest` may choose from: published folders, or committed saves."""
        if self.store is not None:
            return self.store.candidates()
        listed = partial(published_steps, self.run_dir)  # asked again when a save vanishes mid-restore
        return Candidates(str(self.run_dir), listed(), self.step_dir, relist=listed)

    def _check_contract(self, target: SaveSource, manifest: dict[str, Any]) -> tuple[Any, list[str]]:
        """The resume contract, from the manifest alone: nothing is loaded before it passes.

        A refusal is not damage (see :mod:`ckpt_lesson.runs.restore`). The report is logged,
        emitted (``resume_contract``) and returned with the warnings, for ``last_restore``.

        Raises:
            StateMismatchError: The save does not cover every bucket.
            ContractMismatchError: Data, model, config or (per ``env_policy``) environment differ.
        """
        covers = manifest.get("covers") if isinstance(manifest.get("covers"), list) else []
        # A state-API save covers the parts it was given; the restore compares them by name.
        required = () if manifest.get("payload_schema") == PARTS_SCHEMA else BUCKETS
        missing = [b for b in required if b not in covers]
        if missing:
            raise StateMismatchError(
                f"{target.name}: this save does not cover {missing}; a resume needs every bucket. "
                "Use warm_start_from() to start a new experiment from its weights."
            )
        report = resume_report(manifest, current={**self.expect, "env": current_env()})
        log.info("%s", report.format())
        self._emit("resume_contract", step=manifest["step"], save_id=manifest.get("save_id"), report=report)
        return report, check_contract(report, env_policy=self.env_policy)
