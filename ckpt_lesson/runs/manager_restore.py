"""Finding and restoring a run's saves: the reading half of the ``CheckpointManager``.

The manager is split by job: :mod:`~ckpt_lesson.runs.manager` writes saves,
this mixin lists, verifies and restores them. A folder and a bucket are read
through the same loop (:func:`restore_newest`, which loads each candidate with
:func:`~ckpt_lesson.runs.restore.load_save`); only the list of candidates
differs: the run directory's published saves, or the store's committed ones
(:class:`~ckpt_lesson.runs.store_run.StoreRun`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ckpt_lesson.errors import CheckpointError, CorruptCheckpointError, IncompleteCheckpointError
from ckpt_lesson.files.apply import Restored
from ckpt_lesson.runs.layout import MANIFEST_NAME, ScanResult, inspect_save, published_steps, step_dir_name
from ckpt_lesson.runs.restore import check_resume_contract, loader_for, log
from ckpt_lesson.runs.save_source import Candidates, SaveSource, folder_candidates

if TYPE_CHECKING:  # for the annotations only
    from ckpt_lesson.runs.cost import SaveCadence
    from ckpt_lesson.runs.retention import BackgroundRetention
    from ckpt_lesson.runs.store_run import StoreRun

__all__ = ["RestoreMethods", "load_newest_good", "restore_newest"]


class RestoreMethods:
    """Discovery and restore for :class:`~ckpt_lesson.runs.manager.CheckpointManager` (a mixin)."""

    # Set by CheckpointManager.__init__ (as are check_open, step_dir and _emit).
    run_dir: Path
    store: StoreRun | None
    expect: dict[str, Any]
    env_policy: str
    _retention: BackgroundRetention
    _cadence: SaveCadence
    _contract: tuple[Any, list[str]] | None
    last_restore: dict[str, Any] | None

    # ------------------------------------------------------------------ discovery

    def _published(self) -> list[int]:
        return published_steps(self.run_dir)

    def all_steps(self) -> list[int]:
        """Saved steps, ascending (folders with a manifest, or committed steps). Nothing is hashed."""
        if self.store is not None:
            return self.store.all_steps()
        self._retention.wait()
        return [s for s in self._published() if (self.step_dir(s) / MANIFEST_NAME).is_file()]

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
        for step in reversed(self._published()):
            if self.verify_step(step).ok:
                return step
        return None

    # ------------------------------------------------------------------ restore

    def restore_latest(
        self, *args: Any, strict: bool = True, map_location: Any = "cpu", mmap: bool = True
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
        self._contract = None
        self.last_restore = {}
        load = loader_for(
            args, strict=strict, map_location=map_location, mmap=mmap, check_contract=self._check_contract
        )
        try:
            found = restore_newest(self._restore_candidates(), load, record=self.last_restore)
        finally:
            if self.store is not None:
                self.store.drop_downloads()
        self._retention.known.forget([s["step"] for s in self.last_restore["skipped"]])
        if found is None:
            return None
        step, result = found
        if self.store is not None:  # the URL, also for a save that went through the cache folder
            self.last_restore["path"] = self.store.url_of(step)
        self._retention.known.mark_hashed(step)
        self._cadence.mark_saved(step)
        contract = self._contract
        self.last_restore["contract"] = contract[0].to_dict() if contract else None
        self.last_restore["contract_warnings"] = contract[1] if contract else []
        if isinstance(result, Restored):
            result.skipped = list(self.last_restore["skipped"])
            if self.store is not None:
                result.path = self.last_restore["path"]
        return result

    def _restore_candidates(self) -> Candidates:
        """The saves :meth:`restore_latest` may choose from: published folders, or committed saves."""
        if self.store is not None:
            return self.store.candidates()
        return folder_candidates(self.run_dir, self._published())._replace(relist=self._published)

    def _check_contract(self, target: SaveSource, manifest: dict[str, Any]) -> None:
        """Refuse a save this run must not resume (see ``restore.check_resume_contract``)."""
        self._contract = check_resume_contract(
            target,
            manifest,
            expect=self.expect,
            env_policy=self.env_policy,
            emit=self._emit,
        )


def load_newest_good(
    candidates: Candidates,
    load: Callable[[SaveSource, int], tuple[dict[str, Any], Any]],
    *,
    skipped: list[dict[str, Any]],
) -> tuple[int, SaveSource, dict[str, Any], Any]:
    """Try the saves newest first; load the first that verifies, skipping (and logging) damage.

    When a save turns out damaged or gone and ``candidates.relist`` is set, the
    saves are listed again and the newest one not tried yet comes next, newer
    ones included: a restore that races another process's retention (which
    deleted the save being read, after committing a newer one) follows the run.

    Args:
        candidates: The steps to try and how to open each (a folder, or a save
            verified into memory; see :mod:`~ckpt_lesson.runs.save_source`).
        load: ``load(source, step) -> (manifest, result)``: :func:`load_save` with the live
            objects bound, or the state API's ``load_state_save``; raises on damage.
        skipped: A list this function appends ``{"step", "status", "reason"}`` to,
            one per damaged or incomplete save passed over (the caller keeps it
            for its report even when this raises); with a re-listing also
            ``"relisted"``, the steps found then.

    Returns:
        ``(step, source, manifest, result)`` of the save that was loaded.

    Raises:
        CheckpointError: No save is usable (the message lists each one's
            reason), or an error that is not damage (an older save would not fix it).

    Example:
        >>> step, source, manifest, state = load_newest_good(  # doctest: +SKIP
        ...     folder_candidates(run_dir, [40, 80]), load, skipped=[])
    """
    steps, tried = list(candidates.steps), set()
    while untried := [s for s in steps if s not in tried]:
        step = max(untried)  # the newest not tried yet: after a re-listing, possibly newer than the last
        tried.add(step)
        try:
            # Opening is inside: a download that finds a part damaged or gone is damage too.
            target = candidates.open(step)
            manifest, state = load(target, step)
        except (CorruptCheckpointError, IncompleteCheckpointError, OSError) as exc:
            # An OSError (EIO) reading a part is damage to this copy, like a wrong hash: fall back.
            # LoadEnvironmentError is not caught: once the hashes match, an older save would fail alike
            # (and a store that cannot be reached is no reason to pick an older save either).
            status = "incomplete" if isinstance(exc, IncompleteCheckpointError) else "corrupt"
            entry = {"step": step, "status": status, "reason": str(exc)}
            if candidates.relist is not None:
                # The run may have moved on meanwhile (another process's retention removed this save,
                # and its next save is newer): follow it rather than only falling back.
                steps = candidates.relist()
                newer = sorted(s for s in steps if s > step and s not in tried)
                entry["relisted"] = steps
                if newer:
                    entry["reason"] = (
                        f"{str(exc).rstrip('.')}. Listed the saves again: newer step(s) {newer} appeared; "
                        "trying them."
                    )
            skipped.append(entry)
            log.warning("restore: skipping %s (%s): %s", step_dir_name(step), status, entry["reason"])
            continue
        if skipped:
            which = "newer" if all(s["step"] > step for s in skipped) else "other"
            log.warning("restored step %d after skipping %d %s save(s)", step, len(skipped), which)
        else:
            log.info("restored step %d from %s", step, target)
        return step, target, manifest, state
    lines = "\n".join(f"  step {s['step']}: {s['status']}: {s['reason']}" for s in skipped)
    raise CheckpointError(
        f"{candidates.where}: {len(skipped)} {candidates.noun} found but none is usable:\n{lines}\n"
        f"Nothing was restored. {candidates.hint}"
    )


def restore_newest(
    candidates: Candidates,
    load: Callable[[SaveSource, int], tuple[dict[str, Any], Any]],
    *,
    record: dict[str, Any],
) -> tuple[int, Any] | None:
    """:func:`load_newest_good`, filling ``record`` (the manager's ``last_restore``) as it goes.

    Args:
        record: Filled with ``step``, ``save_id``, ``path``, ``skipped`` and
            ``manifest`` at once (so a failed restore still reports what it
            skipped), and ``layout`` and ``seconds`` after a restore.

    Returns:
        ``(step, result)``, or ``None`` when there are no candidates (a fresh start).

    Raises:
        CheckpointError: As :func:`load_newest_good`.

    Example:
        >>> found = restore_newest(folder_candidates(run_dir, [40, 80]), load, record={})  # doctest: +SKIP
    """
    started = time.perf_counter()
    skipped: list[dict[str, Any]] = []
    record.update(step=None, save_id=None, path=None, skipped=skipped, manifest=None)
    if not candidates.steps:
        log.info("%s: no saves; starting fresh", candidates.where)
        return None
    step, target, manifest, state = load_newest_good(candidates, load, skipped=skipped)
    record.update(
        step=step,
        save_id=manifest.get("save_id"),
        path=str(target),
        layout=manifest["layout"],
        manifest=manifest,
        seconds=time.perf_counter() - started,
    )
    return step, state
