"""The parts of a distributed save around DCP's own call: preparing it, failing it, purging after it.

:func:`prepare_save` runs before any byte is written and is where the ranks
agree: every rank checks its own input first (a bad ``data_state``, a
``state`` that is not a ``TrainState``) and the outcomes are gathered, so a
refusal on one rank becomes the same refusal on all of them instead of one
rank raising while the others wait inside a collective. Only then does rank 0
take the staging folder (with its ``flock``, as in the single-process manager)
and tell the others its name.

:class:`Retention` is the run directory's memory of which saves are known to
be good, and applies the package's retention policy after each publish. It
runs on rank 0 inside ``CommitWriter.finish``, so in the background thread
for an asynchronous save, and it never turns a published save into a failure.
"""

from __future__ import annotations

import logging
import os
import uuid
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

from torch.distributed.checkpoint.api import CheckpointException

from ckpt_lesson.errors import CheckpointError
from ckpt_lesson.files.atomic import fsync_dir
from ckpt_lesson.files.rng import capture_rng_state
from ckpt_lesson.runs.commit import QUARANTINE_PREFIX, open_staging
from ckpt_lesson.runs.dcp_marker import open_marker_folder
from ckpt_lesson.runs.deleter import BackgroundRetention
from ckpt_lesson.runs.layout import published_steps, step_dir_name, step_of
from ckpt_lesson.runs.retention import RetentionPolicy
from ckpt_lesson.runs.reverify import check_save

from .comm import Comm, raise_from_checkpoint_exception
from .reader import verify_save
from .state import build_save_state, encode_rank_state, rank_key
from .writer import CommitWriter

__all__ = ["Retention", "SaveJob", "check_inputs", "fail_save", "manifest_fields", "prepare_save"]

log = logging.getLogger("ckpt_lesson.distributed")

Emit = Callable[..., None]


@dataclass
class SaveJob:
    """One save between preparation and its end: what to hand DCP, and how to clean up."""

    step: int
    final: Path | str  # a folder, or a save's URL on an object store
    writer: Any  # CommitWriter, or StoreCommitWriter for an object store
    state_dict: dict[str, Any]
    stack: ExitStack  # rank 0: holds the staging folder's lock; closing with an error removes the folder

    def abort(self, exc: BaseException) -> None:
        self.stack.__exit__(type(exc), exc, exc.__traceback__)


def prepare_save(
    *,
    ctl: Comm,
    run_dir: Path,
    model: Any,
    optimizer: Any,
    scheduler: Any,
    state: Any,
    data_state: Any,
    writer_options: dict[str, Any],
    emit: Emit,
    after_publish: Callable[[Path, dict[str, Any]], None],
    rng: dict[str, Any] | None = None,
) -> SaveJob:
    """Check the input on every rank, agree, and set up staging folder and writer; collective.

    Args:
        ctl: The control group.
        run_dir: The run directory.
        model, optimizer, scheduler, state, data_state: As ``DistributedCheckpointManager.save``.
        writer_options: ``algo``, ``thread_count``, ``publish`` and the manifest's ``metadata``.
        emit: The manager's event hook.
        after_publish: Rank 0's post-publish callback (retention).
        rng: This rank's generators captured earlier (e.g. before a prefetch); ``None`` captures them now.

    Returns:
        The job: the state dict for DCP and a :class:`~.writer.CommitWriter` aimed at the staging folder.

    Raises:
        CheckpointError: On every rank alike: some rank's input is invalid, the
            ranks disagree on the step, or a good save of this step exists.

    Example:
        >>> job = prepare_save(ctl=Comm(), run_dir=run, model=m, optimizer=opt,  # doctest: +SKIP
        ...     scheduler=None, state=state, data_state=None, writer_options=opts, emit=emit,
        ...     after_publish=hook)
    """
    step, state_dict, covers = check_inputs(
        ctl=ctl,
        model=model,
        optimizer=optimizer,
        scheduler=scheduler,
        state=state,
        data_state=data_state,
        rng=rng,
        emit=emit,
    )
    final, stack, staging, refusal = run_dir / step_dir_name(step), ExitStack(), None, None
    if ctl.rank == 0:
        try:
            clear_target(run_dir, final, emit)
            by_marker = writer_options["publish"] == "marker"  # then the final folder is written in place
            folder = open_marker_folder(final) if by_marker else open_staging(run_dir, step)
            staging = stack.enter_context(folder).name
        except (CheckpointError, OSError) as exc:
            stack.close()
            refusal = str(exc)
    staging, refusal = ctl.broadcast((staging, refusal))
    if refusal:
        raise CheckpointError(refusal)
    fields = manifest_fields(ctl, state, covers, writer_options["metadata"])
    writer = CommitWriter(
        run_dir / staging,
        final,
        step=step,
        manifest_fields=fields,
        algo=writer_options["algo"],
        emit=emit,
        after_publish=after_publish if ctl.rank == 0 else None,
        thread_count=writer_options["thread_count"],
        publish=writer_options["publish"],
    )
    return SaveJob(step, final, writer, state_dict, stack)


def check_inputs(
    *,
    ctl: Comm,
    model: Any,
    optimizer: Any,
    scheduler: Any,
    state: Any,
    data_state: Any,
    rng: Any,
    emit: Emit,
) -> tuple[int, dict[str, Any], list[str]]:
    """Every rank checks and encodes its own input, then all agree; collective.

    Returns:
        ``(step, state dict for DCP, covered buckets)``, the same step on every rank.

    Raises:
        CheckpointError: On every rank alike: some rank's input is invalid, or the ranks disagree.

    Example:
        >>> step, state_dict, covers = check_inputs(ctl=Comm(), model=m, optimizer=opt,  # doctest: +SKIP
        ...     scheduler=None, state=state, data_state=None, rng=None, emit=emit)
    """
    error, state_dict, step = None, {}, getattr(state, "step", None)
    try:  # everything local first; a rank that fails must not leave the others inside a collective
        blob = encode_rank_state(state, capture_rng_state() if rng is None else rng, data_state)
        state_dict = build_save_state(model, optimizer, scheduler, rank=ctl.rank, blob=blob)
    except CheckpointError as exc:
        error = str(exc)
    views = ctl.all_gather((step, scheduler is not None, error))
    errors = [f"rank {r}: {v[2]}" for r, v in enumerate(views) if v[2]]
    if errors:
        raise CheckpointError(f"save refused before writing anything: {errors[0]}")
    if len({v[:2] for v in views}) != 1:
        raise CheckpointError(f"ranks disagree on (step, has scheduler): {[v[:2] for v in views]}.")
    emit("save_begin", step=step)
    covers = ["model", "optimizer", *(["scheduler"] if scheduler is not None else []), "rng", "data"]
    return step, state_dict, covers


def manifest_fields(ctl: Comm, state: Any, covers: list[str], metadata: dict[str, Any]) -> dict[str, Any]:
    """The manifest fields every writer records besides its parts (rank 0's counters, per-rank keys)."""
    return {
        "world_size": ctl.world_size,
        "per_rank_keys": [rank_key(r) for r in range(ctl.world_size)],
        "state": {"step": state.step, "epoch": state.epoch, "batch_in_epoch": state.batch_in_epoch},
        "covers": covers,
        "metadata": metadata,
    }


def clear_target(run_dir: Path, final: Path, emit: Emit) -> None:
    """Rank 0, before writing: refuse over a good save; move a damaged one aside (kept, not deleted)."""
    if not final.exists():
        return
    try:
        verify_save(final, Comm.solo())
    except CheckpointError as exc:
        aside = run_dir / f"{QUARANTINE_PREFIX}{final.name}-{uuid.uuid4().hex[:8]}"
        os.replace(final, aside)
        fsync_dir(run_dir)
        log.warning("%s was damaged (%s); moved it aside to %s", final.name, exc, aside.name)
        emit("quarantined", step=step_of(final.name), path=str(aside))
        return
    raise CheckpointError(
        f"step {step_of(final.name)} is already saved in {final} and verifies; a save is never "
        "overwritten. Save a later step, or move that folder away by hand."
    )


def fail_save(job: SaveJob, exc: BaseException, rank: int) -> NoReturn:
    """Clean up after a failed save (rank 0 removes its staging folder) and raise a CheckpointError."""
    job.abort(exc)
    if isinstance(exc, CheckpointException):  # DCP's gathered failures; a BaseException
        raise_from_checkpoint_exception(exc, f"save of step {job.step}")
    if isinstance(exc, Exception) and not isinstance(exc, CheckpointError):
        # Typically a collective that failed because another rank died: say what it means.
        raise CheckpointError(
            f"save of step {job.step} failed on rank {rank} ({type(exc).__name__}: {exc}); "
            "nothing was published, the previous save stays the latest."
        ) from exc
    raise exc


class Retention:
    """Known-good saves of one run directory, and the purge that follows each publish.

    The purge is the single-process manager's: the same rule
    (:func:`~ckpt_lesson.runs.reverify.retention_pass`: cheap checks of every
    save kept instead, one full re-hash per pass, round robin) on the same
    background thread (:class:`~ckpt_lesson.runs.deleter.BackgroundRetention`).

    Args:
        run_dir: The run directory.
        policy: ``to_delete(steps, verified)``, e.g. ``KeepLastK(3)``.
        emit: Event hook (``retention_delete`` before each delete).
        background: ``False`` runs each pass inside ``after_publish``.

    Example:
        >>> keeper = Retention(run, KeepLastK(2), emit=lambda name, **info: None)  # doctest: +SKIP
        >>> keeper.published()  # doctest: +SKIP
        [2, 4]
    """

    def __init__(
        self, run_dir: Path, policy: RetentionPolicy, emit: Emit, *, background: bool = True
    ) -> None:
        self.run_dir, self.policy, self.emit = run_dir, policy, emit
        self.worker = BackgroundRetention(run_dir, policy, emit=emit, background=background)

    @property
    def verified(self) -> set[int]:
        """Steps known to be good (written, restored or re-checked by this process)."""
        self.worker.wait()
        return self.worker.known.verified

    @verified.setter
    def verified(self, steps: set[int]) -> None:
        self.worker.wait()
        self.worker.known.verified.clear()
        self.worker.known.verified.update(steps)

    def mark_good(self, step: int) -> None:
        """``step`` was verified in full just now (a restore read and hashed it)."""
        self.worker.wait()
        self.worker.known.mark_hashed(step)

    def wait(self) -> None:
        """Wait for the retention pass in flight, if any."""
        self.worker.wait()

    def published(self) -> list[int]:
        """Published steps, ascending (folder names only; nothing is read)."""
        return published_steps(self.run_dir)

    def after_publish(self, final: Path, manifest: dict[str, Any]) -> None:
        """Count the new save as good and start the purge behind it; errors are logged, not raised."""
        try:
            # Every part was hashed as it was written and finish() checked every item was: the
            # write-time check of the single-process manager's "writer" mode.
            self.worker.submit(manifest["step"], checked=True)
        except Exception:  # the save is durable; a failed purge must not turn it into a failure
            log.exception("retention after %s failed; the save itself is published", final.name)

    def sizes_ok(self, step: int) -> bool:
        """A known-good save still has its manifest and every part at its size (a stat each, no hashing)."""
        return check_save(self.run_dir / step_dir_name(step), full=False) is None
