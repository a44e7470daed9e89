"""The parts of a distributed save around DCP's own call, and the backend of a run in a POSIX folder.

:func:`open_save` is where the ranks agree before any byte is written, :func:`fail_save` cleans up
after DCP failed; :class:`FolderSaves` is the backend of a folder every rank shares (the object
store's is :class:`~.store_saves.StoreSaves`).
"""

from __future__ import annotations

import logging
import os
import uuid
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

from torch.distributed.checkpoint.api import CheckpointException

from ckpt_lesson.errors import CheckpointError
from ckpt_lesson.files.atomic import atomic_write_bytes, fsync_dir
from ckpt_lesson.files.rng import capture_rng_state
from ckpt_lesson.files.storage import is_store_url
from ckpt_lesson.runs.commit import (
    PUBLISH_MODES,
    QUARANTINE_PREFIX,
    clean_stale,
    open_marker_folder,
    open_staging,
    publish,
    write_commit_marker,
)
from ckpt_lesson.runs.layout import MANIFEST_NAME, published_steps, step_dir_name, step_of
from ckpt_lesson.runs.marker_cleanup import clean_unmarked
from ckpt_lesson.runs.retention import BackgroundRetention, RetentionPolicy

from .comm import Comm, raise_from_checkpoint_exception
from .restore import Saves
from .state import dcp_state_dict, encode_rank_state, rank_key
from .store_saves import StoreSaves
from .verify import verify_save
from .writer import CommitWriter, Emit, HashingFileSystem

__all__ = [
    "FolderSaves",
    "FolderTarget",
    "SaveJob",
    "fail_save",
    "open_save",
    "open_saves",
]

log = logging.getLogger("ckpt_lesson.distributed")


@dataclass
class SaveJob:
    """One save between preparation and its end: what to hand DCP, and how to clean up."""

    step: int
    final: Path | str  # a folder, or a save's URL on an object store
    writer: Any  # a CommitWriter
    state_dict: dict[str, Any]
    stack: ExitStack  # rank 0: holds the attempt (a folder's lock, a store's lease); an error removes it


def open_saves(
    location: str | os.PathLike[str],
    policy: RetentionPolicy,
    emit: Emit,
    *,
    publish: str | None,
    storage_options: Any,
    lease_seconds: float,
) -> FolderSaves | StoreSaves:
    """The backend of a run: a shared folder's, or an object store's for a URL (``s3://bucket/run``).

    ``publish=None`` picks a folder's rename or a URL's marker; the arguments are the
    manager's (see :class:`~.manager.DistributedCheckpointManager`).

    Raises:
        CheckpointError: An unknown ``publish``, or ``publish="rename"`` for a URL.

    Example:
        >>> open_saves("s3://bucket/run", KeepLastK(2), emit, publish=None,  # doctest: +SKIP
        ...     storage_options=None, lease_seconds=900.0).publish
        'marker'
    """
    on_store = is_store_url(location)
    publish = publish or ("marker" if on_store else "rename")
    if publish not in PUBLISH_MODES:
        raise CheckpointError(f"publish must be one of {PUBLISH_MODES}, got {publish!r}.")
    if not on_store:
        return FolderSaves(Path(location), policy, emit, publish=publish)
    if publish == "rename":
        raise CheckpointError(
            f"{location}: publish='rename' needs a POSIX file system; on an object store a rename is a "
            "copy and a delete, never atomic. A URL run publishes by its conditional COMMIT marker: "
            "leave publish unset (or pass publish='marker')."
        )
    return StoreSaves(str(location).rstrip("/"), storage_options, lease_seconds, policy, emit)


def open_save(
    saves: FolderSaves | StoreSaves,
    ctl: Comm,
    args: tuple[Any, ...],
    *,
    metadata: dict[str, Any],
    algo: str,
    thread_count: int,
    emit: Emit,
) -> SaveJob:
    """Check the input on every rank, agree, open the save's attempt and set up its writer; collective.

    Every rank checks its own input first (a bad ``data_state``, a ``state`` that is not a
    ``TrainState``) and the outcomes are gathered, so a refusal on one rank becomes the same
    refusal on all of them instead of one rank raising while the others wait inside a collective.
    Only then does rank 0 open the attempt through ``saves`` (a staging folder, or a ``save_id``
    under a lease) and tell the other ranks its name. ``args`` is ``(model, optimizer, scheduler,
    state, data_state, rng)`` (see :func:`.state.save_args`); the rest are the manager's settings.

    Returns:
        The job: the state dict for DCP and a :class:`~.writer.CommitWriter` aimed at the attempt.

    Raises:
        CheckpointError: On every rank alike: some rank's input is invalid, the ranks
            disagree on the step, or a good save of this step exists.

    Example:
        >>> job = open_save(mgr.saves, Comm(), (m, opt, None, state, None, None),  # doctest: +SKIP
        ...     metadata={}, algo="xxh3_128", thread_count=1, emit=emit)
    """
    model, optimizer, scheduler, state, data_state, rng = args
    error, state_dict, step = None, {}, getattr(state, "step", None)
    try:  # everything local first (see above)
        blob = encode_rank_state(state, capture_rng_state() if rng is None else rng, data_state)
        state_dict = dcp_state_dict(model, optimizer, scheduler, {rank_key(ctl.rank): blob})
    except CheckpointError as exc:
        error = str(exc)
    views = ctl.all_gather((step, scheduler is not None, error))
    errors = [f"rank {r}: {v[2]}" for r, v in enumerate(views) if v[2]]
    if errors:
        raise CheckpointError(f"save refused before writing anything: {errors[0]}")
    if len({v[:2] for v in views}) != 1:
        raise CheckpointError(f"ranks disagree on (step, has scheduler): {[v[:2] for v in views]}.")
    emit("save_begin", step=step)
    saves.step_done(step)  # a loop that saves without asking should_save still gets its record
    stack, name, held, refusal = ExitStack(), None, None, None
    if ctl.rank == 0:
        try:
            name, held = stack.enter_context(saves.begin(step))
        except (CheckpointError, OSError) as exc:
            stack.close()
            refusal = exc if isinstance(exc, CheckpointError) else CheckpointError(str(exc))
    name, refusal = ctl.broadcast((name, refusal))
    if refusal is not None:
        raise refusal
    writer = CommitWriter(
        saves.target(step, name, held),  # type: ignore[arg-type]
        step=step,
        manifest_fields={  # besides the parts: rank 0's counters, the per-rank keys
            "world_size": ctl.world_size,
            "per_rank_keys": [rank_key(r) for r in range(ctl.world_size)],
            "state": {"step": state.step, "epoch": state.epoch, "batch_in_epoch": state.batch_in_epoch},
            "covers": [
                "model",
                "optimizer",
                *(["scheduler"] if scheduler is not None else []),
                "rng",
                "data",
            ],
            "metadata": metadata,
        },
        algo=algo,
        emit=emit,
        after_publish=saves.after_publish if ctl.rank == 0 else None,
        thread_count=thread_count,
    )
    return SaveJob(step, saves.step_dir(step), writer, state_dict, stack)


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
    job.stack.__exit__(type(exc), exc, exc.__traceback__)  # the attempt sees the error: removed
    if isinstance(exc, CheckpointException):  # DCP's gathered failures; a BaseException
        raise_from_checkpoint_exception(exc, f"save of step {job.step}")
    if isinstance(exc, Exception) and not isinstance(exc, CheckpointError):
        # Typically a collective that failed because another rank died: say what it means.
        raise CheckpointError(
            f"save of step {job.step} failed on rank {rank} ({type(exc).__name__}: {exc}); "
            "nothing was published, the previous save stays the latest."
        ) from exc
    raise exc


class FolderTarget:
    """The commit of a save in a POSIX folder, by rename (default) or by a marker written last.

    Args:
        staging: Where the files are written (created and locked by rank 0 beforehand).
        final: Where the save is published, e.g. ``RUN_DIR/step-00000040``.
        publish: ``"rename"``: ``staging`` is renamed to ``final``; ``"marker"``: ``staging``
            *is* ``final`` and a commit marker written last publishes it
            (see :mod:`ckpt_lesson.runs.commit`).

    Example:
        >>> target = FolderTarget(run / ".staging-step-00000040-x", run / "step-00000040")  # doctest: +SKIP
    """

    sync_files = True  # fsync each file through DCP

    def __init__(self, staging: Path, final: Path, publish: str = "rename") -> None:
        self.staging, self.final, self.publish = Path(staging), Path(final), publish
        self.save_id, self.where, self.checkpoint_id = uuid.uuid4().hex, self.staging.name, str(self.final)

    def file_system(self, algo: str, emit: Emit) -> tuple[HashingFileSystem, Path]:
        return HashingFileSystem(algo, emit), self.staging

    def remove(self, names: list[str]) -> None:
        for name in names:
            (self.staging / name).unlink(missing_ok=True)

    def commit(self, step: int, manifest: dict[str, Any], raw: bytes, written: Callable[[], None]) -> str:
        """Write the manifest, call ``written``, publish; returns where the save now lives."""
        atomic_write_bytes(raw, self.staging / MANIFEST_NAME)  # fsyncs file and folder
        written()
        if self.publish == "marker":  # no rename: the marker, written last, is the commit
            write_commit_marker(self.final, manifest, raw)
        else:
            if self.final.exists():
                raise CheckpointError(
                    f"{self.final}: appeared while this save was written (another writer?); not replacing it."
                )
            publish(self.staging, self.final)  # one rename, then fsync of the run directory
        return str(self.final)


class FolderSaves(Saves):
    """The saves of a run in a shared folder: staging, known-good saves, and the purge after each publish.

    The staging folder holds its ``flock`` as in the single-process manager, and the purge is
    that manager's: the same rule (:func:`~ckpt_lesson.runs.reverify.retention_pass`: cheap
    checks of every save kept instead, one full re-hash per pass, round robin) on the same
    background thread (:class:`~ckpt_lesson.runs.retention.BackgroundRetention`), started by
    rank 0 inside ``CommitWriter.finish`` (DCP's background thread for an asynchronous save).

    Args:
        run_dir: The run directory.
        policy: ``to_delete(steps, verified)``, e.g. ``KeepLastK(3)``.
        emit: Event hook (``retention_delete`` before each delete, ``quarantined``).
        publish: ``"rename"`` (a staging folder renamed) or ``"marker"`` (see :mod:`.writer`).

    Example:
        >>> saves = FolderSaves(run, KeepLastK(2), emit=lambda name, **info: None)  # doctest: +SKIP
        >>> saves.published()  # doctest: +SKIP
        [2, 4]
    """

    def __init__(
        self, run_dir: Path, policy: RetentionPolicy, emit: Emit, *, publish: str = "rename"
    ) -> None:
        self.run_dir, self.policy, self.emit, self.publish = run_dir, policy, emit, publish
        self.where = str(run_dir)
        self.worker = BackgroundRetention(run_dir, policy, emit=emit)

    def open_run(self) -> None:  # rank 0, once
        if self.run_dir.exists() and not self.run_dir.is_dir():
            raise CheckpointError(f"{self.run_dir}: exists and is not a directory; pass a run directory.")
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.clean()  # staging or unmarked folders of writers killed earlier (their flock is gone)

    def clean(self) -> list[str]:
        """Rank 0: remove the staging and unmarked folders of dead writers; returns their names."""
        return clean_stale(self.run_dir) + clean_unmarked(self.run_dir)

    clean_uploads = clean

    def step_dir(self, step: int) -> Path:
        return self.run_dir / step_dir_name(step)

    @contextmanager
    def begin(self, step: int) -> Iterator[tuple[str, None]]:
        """Rank 0: refuse over a good save, then hold the folder ``step`` is written in; yields its name."""
        final = self.step_dir(step)
        clear_target(self.run_dir, final, self.emit)
        folder = open_marker_folder(final) if self.publish == "marker" else open_staging(self.run_dir, step)
        with folder as path:
            yield path.name, None

    def target(self, step: int, staging: str, lease: None) -> FolderTarget:
        """Where every rank's writer writes: the folder rank 0 opened, published as ``step``."""
        return FolderTarget(self.run_dir / staging, self.step_dir(step), self.publish)

    def mark_good(self, step: int) -> None:
        self.worker.wait()
        self.worker.known.mark_hashed(step)

    def wait(self) -> None:
        self.worker.wait()

    def published(self) -> list[int]:
        """Published steps, ascending (folder names only; nothing is read)."""
        return published_steps(self.run_dir)

    def after_publish(self, final: str, manifest: dict[str, Any]) -> None:
        """Count the new save as good and start the purge behind it; errors are logged, not raised."""
        try:
            # Every part was hashed as it was written and finish() checked every item was: the
            # write-time check of the single-process manager's "writer" mode.
            self.worker.submit(manifest["step"], checked=True)
        except Exception:  # the save is durable; a failed purge must not turn it into a failure
            log.exception("retention after %s failed; the save itself is published", final)
