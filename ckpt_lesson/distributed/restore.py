"""Restore one verified distributed save into the live objects of every rank.

:meth:`~.manager.DistributedCheckpointManager.restore_latest` walks the saves
newest first and calls :func:`restore_save` on each until one works; when one
turns out damaged or vanishes (retention in another job), it lists the run
again and goes on with the newest save not yet tried, newer ones included.
The order inside one try is the lesson of the single-process restore, spread
over ranks:

1. every rank verifies its share of the files and all agree (:func:`~.verify.verify_save`);
2. the manifest alone decides whether this world size can resume the save
   (nothing is loaded yet);
3. DCP loads, weights-only, into this run's own sharded tensors: resharding
   from any saved world size is DCP's job and is exact;
4. every rank decodes its per-rank blob and the ranks agree it was fine;
5. only then are model, optimizer, scheduler and generators touched.

Why a changed world size is refused by default: model and optimizer can be
resharded, but rank 3's generator state and sampler position have no
counterpart in a run of two ranks, and a resume that quietly invents them
continues *plausibly* but not *identically*. The explicit
``on_world_size_change="reseed"`` keeps the weights, optimizer, scheduler and
counters, gives every rank a fresh reproducible stream, and says so in the log.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from ckpt_lesson.errors import StateMismatchError, UnsafeCheckpointError
from ckpt_lesson.files.checkpoint import TrainState
from ckpt_lesson.files.rng import restore_rng_state
from ckpt_lesson.runs.layout import step_dir_name
from ckpt_lesson.runs.restore import Candidates, load_newest_good
from ckpt_lesson.short_repr import short_repr

from .comm import Comm, quiet_single_process, raise_from_checkpoint_exception
from .reader import VerifyingReader, WeightsOnlyLoadPlanner
from .state import (
    apply_shared_state,
    dcp_state_dict,
    decode_rank_state,
    has_rank_parts,
    rank_key,
    reseed_generators,
)
from .verify import verify_save

__all__ = ["WORLD_SIZE_POLICIES", "DistributedRestore", "Saves", "restore_newest", "restore_save"]

log = logging.getLogger("ckpt_lesson.distributed")

WORLD_SIZE_POLICIES = ("refuse", "reseed")


class Saves:
    """A run's storage backend as the manager and the restore use it: one subclass per storage.

    :class:`~.saving.FolderSaves` keeps a run in a folder every rank shares,
    :class:`~.store_saves.StoreSaves` in an object store. Verification and reading are one
    path for both (:mod:`.reader`); the hooks only a store needs do nothing here.
    """

    where: str = ""  # the run, for messages
    hint: str = Candidates._field_defaults["hint"]  # the last line of "none is usable"
    storage_options: dict[str, Any] | None = None

    def published(self) -> list[int]:
        """Published steps, ascending (rank 0 lists, see :meth:`~.comm.Comm.on_rank0`)."""
        raise NotImplementedError

    def step_dir(self, step: int) -> Any:
        """Where the save of ``step`` lives: a folder, or a URL."""
        raise NotImplementedError

    def source(self, step: int) -> Any:
        """What :func:`~.verify.verify_save` reads for ``step``: its folder, or a store's ``StoreSave``."""
        return self.step_dir(step)

    def mark_good(self, step: int) -> None:
        """``step`` was verified in full just now (a restore read and hashed it)."""

    def wait(self) -> None:
        """Wait for the retention pass in flight, if any."""

    def restored(self, restored: DistributedRestore) -> None:
        """Rank 0: note a restore (a store records it in ``recovery.jsonl`` after the next step)."""

    def step_done(self, step: int) -> None:
        """The first step after a restore (or a save) is done: see :meth:`restored`."""

    def close(self) -> None:
        """Drop what a restore left pending."""


@dataclass(frozen=True)
class DistributedRestore:
    """What a restore brought back, on this rank.

    Attributes:
        step: The restored step.
        state: This rank's counters (rank 0's when the world size changed).
        data_state: This rank's saved data position; ``None`` when resharded.
        resharded: True when the saved world size differs from this one.
        saved_world_size: Ranks that wrote the save.
        world_size: Ranks that restored it.
        path: The save folder (its URL for a save in an object store).
        save_id: The manifest's save id.
        reseed: The seed each generator got when resharded, else ``None``.
        skipped: Newer saves skipped as damaged: ``{"step", "status", "reason", "relisted"}``.
        rng: This rank's restored generator state; ``None`` when resharded (re-seeded instead).
    """

    __repr__ = short_repr  # one short line: see ckpt_lesson/short_repr.py

    step: int
    state: TrainState
    data_state: Any
    resharded: bool
    saved_world_size: int
    world_size: int
    path: Path | str
    save_id: str
    reseed: int | None = None
    skipped: list[dict[str, Any]] = field(default_factory=list)
    rng: dict[str, Any] | None = None


def world_size_message(name: str, saved: int, now: int) -> str:
    """The refusal for a changed world size: what differs, why it matters, both ways out."""
    return (
        f"{name} was saved by {saved} rank(s) and this run has {now}. Model and optimizer can be "
        f"resharded, but each rank's RNG state and data position belong to one of the {saved} saved ranks "
        f"and cannot be mapped onto {now}. Resume with {saved} ranks for an exact continuation, or pass "
        "on_world_size_change='reseed' to restore weights, optimizer, scheduler and counters and "
        "re-seed every rank (data positions are then not restored)."
    )


def restore_save(
    step: int,
    *,
    saves: Saves,
    ctl: Comm,
    io_group: dist.ProcessGroup | None,
    model: Any,
    optimizer: Any,
    scheduler: Any,
    on_world_size_change: str,
    reseed_base: int,
    check: Callable[..., Any] | None = None,
) -> DistributedRestore:
    """Verify, load and apply one save on every rank; collective over ``ctl``.

    Args:
        step: The step to restore.
        saves: The run's backend: where the save is read from (its ``source``).
        ctl: The control group (training thread).
        io_group: The group DCP's own collectives use.
        model, optimizer, scheduler: Restored in place; ``scheduler`` may be ``None``.
        on_world_size_change: ``"refuse"`` or ``"reseed"`` (see the module doc).
        reseed_base: Base seed for ``"reseed"``.
        check: ``check(data, source=..., step=...)`` refuses this rank's saved data (a
            ``StateMismatchError``) before anything is loaded into the live objects, e.g. the
            state API's part names.

    Returns:
        The restore's record on this rank.

    Raises:
        CorruptCheckpointError, IncompleteCheckpointError: Damage; the caller tries an older save.
        UnsafeCheckpointError: A crafted file; nothing was executed.
        StateMismatchError: World size (under ``"refuse"``), scheduler or per-rank state do not fit.

    Example:
        >>> restored = restore_save(40, saves=mgr.saves, ctl=Comm(), io_group=None,  # doctest: +SKIP
        ...     model=m, optimizer=opt, scheduler=None, on_world_size_change="refuse", reseed_base=0)
    """
    verified = verify_save(saves.source(step), ctl)
    name = step_dir_name(step)
    manifest = verified.manifest
    saved_world, now = manifest["world_size"], ctl.world_size
    resharded = saved_world != now
    if resharded and on_world_size_change != "reseed":
        raise StateMismatchError(world_size_message(name, saved_world, now))
    if manifest["per_rank_keys"] != [rank_key(r) for r in range(saved_world)]:
        raise StateMismatchError(f"{name}: unexpected per-rank keys {manifest['per_rank_keys'][:4]}.")
    saved_scheduler = "scheduler" in manifest.get("covers", [])
    if saved_scheduler != (scheduler is not None):
        raise StateMismatchError(
            f"{name}: saved {'with' if saved_scheduler else 'without'} a scheduler, but "
            f"restore_latest got {'none' if scheduler is None else 'one'}; pass the same kind of "
            "scheduler the run saved."
        )
    # Same world: each rank reads its own blob. Changed world: everyone reads rank 0's counters.
    blob_key = rank_key(0 if resharded else ctl.rank)
    where = f"{name}/{blob_key}"

    def load(template: dict[str, Any]) -> dict[str, Any]:  # dcp.load from the verified save, in place
        try:
            with quiet_single_process(not ctl.enabled):
                dcp.load(
                    template,
                    storage_reader=VerifyingReader(verified, saves.storage_options),
                    planner=WeightsOnlyLoadPlanner(),
                    process_group=io_group,
                    no_dist=not ctl.enabled,
                )
        except CheckpointException as exc:  # a BaseException: `except Exception` would miss it
            raise_from_checkpoint_exception(exc, f"loading {name}", reading=True)
        return template

    if check is not None:  # first the blob alone: the template below already touches the live objects
        blob = load({blob_key: b""})[blob_key]
        source = str(saves.step_dir(step))
        _agreed(ctl, lambda: check(decode_rank_state(blob, where=where)["data"], source=source, step=step))
    template = load(dcp_state_dict(model, optimizer, scheduler, {blob_key: b""}))
    rank_state = _agreed(ctl, lambda: decode_rank_state(template[blob_key], where=where))
    apply_shared_state(model, optimizer, scheduler, template)
    seed = None
    if resharded:
        seed = reseed_generators(reseed_base, manifest["step"], ctl.rank)
        if ctl.rank == 0:
            log.warning(
                "%s: saved by %d rank(s), restored on %d: weights, optimizer, scheduler and counters "
                "restored; RNG re-seeded from (reseed_base=%d, step, rank); data positions NOT restored "
                "(resume your sampler from the counters: epoch %d, batch %d).",
                name,
                saved_world,
                now,
                reseed_base,
                rank_state["train"].epoch,
                rank_state["train"].batch_in_epoch,
            )
    else:
        restore_rng_state(rank_state["rng"])  # last: nothing after this may draw a random number
    return DistributedRestore(
        step=manifest["step"],
        state=rank_state["train"],
        # State-API saves keep their other parts in the blob: after a world-size change they come
        # from rank 0's copy (schedulers, scalers and values agree across ranks; loader positions do not).
        data_state=None if resharded and not has_rank_parts(rank_state["data"]) else rank_state["data"],
        rng=None if resharded else rank_state["rng"],
        resharded=resharded,
        saved_world_size=saved_world,
        world_size=now,
        path=saves.step_dir(step),
        save_id=manifest["save_id"],
        reseed=seed,
    )


def _agreed(ctl: Comm, fn: Callable[[], Any]) -> Any:
    """``fn()`` on every rank; a refusal on any rank is raised on all of them (they decide together)."""
    problem = result = None
    try:
        result = fn()
    except (StateMismatchError, UnsafeCheckpointError) as exc:
        problem = (isinstance(exc, UnsafeCheckpointError), str(exc))
    problems = [p for p in ctl.all_gather(problem) if p]
    if problems:
        unsafe, message = problems[0]
        raise (UnsafeCheckpointError if unsafe else StateMismatchError)(message)
    return result


def restore_newest(*, saves: Saves, ctl: Comm, **options: Any) -> DistributedRestore | None:
    """Restore the newest good save, following the run as it changes; collective over ``ctl``.

    The single-process manager's walk (:func:`~ckpt_lesson.runs.restore.load_newest_good`,
    see the module doc) with :func:`restore_save` as the load. Every rank takes the same
    turns: the listings are rank 0's, and each verdict on a save is agreed by all ranks.

    Args:
        saves: The run's backend (listing, and where each save is read from).
        ctl: The control group.
        options: The other keyword arguments of :func:`restore_save`.

    Returns:
        The first save that restored, its ``skipped`` listing why each one tried
        before was passed over; ``None`` when the run has no saves.

    Raises:
        CheckpointError: Saves exist but none is usable (each reason listed), or
            what :func:`restore_save` raises for anything but damage.

    Example:
        >>> restore_newest(saves=mgr.saves, ctl=Comm(), io_group=None,  # doctest: +SKIP
        ...     model=m, optimizer=opt, scheduler=None, on_world_size_change="refuse", reseed_base=0)
    """
    relist = partial(ctl.on_rank0, saves.published)  # rank 0's listings, on every rank
    steps = relist()
    if not steps:
        return None
    candidates = Candidates(saves.where, steps, lambda step: step, hint=saves.hint, relist=relist)
    skipped: list[dict[str, Any]] = []
    load = lambda _, step: ({}, restore_save(step, saves=saves, ctl=ctl, **options))  # noqa: E731
    restored = load_newest_good(candidates, load, skipped=skipped)[3]
    return replace(restored, skipped=skipped)
