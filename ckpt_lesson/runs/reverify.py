"""The one retention rule every manager uses: delete only what re-checked saves make safe.

:mod:`ckpt_lesson.runs.retention` decides *which* steps may go, from the set
of steps known to be good. That set is a memory, and memories go stale: a save
verified an hour ago can have a flipped bit now, with its size unchanged. The
first version of this code hashed every kept save again before each deletion,
which is exact but costs ``keep_last`` times the checkpoint size per save (20-30
GB of reading per save at 10 GB and ``keep_last=3``). The multi-rank manager
went the other way and checked sizes only, so a same-size flip could leave it
with one good save where it promised two. This module is the middle road, and
both managers call it (``CheckpointManager`` and ``DistributedCheckpointManager``):

* **The new save** counts as good only once it passed its own check at write
  time (``verify_on_save``); when it was not checked, the pass hashes it first.
  Nothing is deleted before that.
* **Every save kept instead** of a deleted one gets the cheap checks: its
  manifest is read and its seal checked, every part is present at its recorded
  size. These cost a ``stat`` per part, so they are done for all of them.
* **One older kept save per pass** is hashed in full: the one hashed least
  recently (round robin; in steady state that is the oldest kept save, the one
  about to become the fallback). A failure of any check drops the save from the
  good set and the decision is made again without it, so a deletion never leans
  on a save that just failed.

The bit-rot guarantee this gives (docs/performance.md states it, and
``tests/test_reverify.py`` tests it): with ``keep_last=K``, a save that rots in
place after it was verified is found within ``K - 1`` passes, and until it is
found retention still keeps at least ``K - 1`` saves that verify.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from ckpt_lesson.runs.commit import delete_save
from ckpt_lesson.runs.layout import inspect_save, published_steps, step_dir_name

__all__ = ["KnownGood", "RetentionPolicy", "check_save", "retention_pass"]

# The manager's messages, under the manager's logger name (see ckpt_lesson.runs.commit for why).
log = logging.getLogger("ckpt_lesson.runs.manager")

#: ``emit(name, **info)``: the manager's event hook.
Emit = Callable[..., None]


class RetentionPolicy(Protocol):
    """Anything with ``to_delete(steps, verified) -> list[int]`` (ascending), e.g. ``KeepLastK(3)``."""

    def to_delete(self, steps: Sequence[int], verified: Collection[int]) -> list[int]: ...


@dataclass
class KnownGood:
    """What retention remembers between passes: which saves verified, and when each was last hashed.

    Attributes:
        verified: Steps known to verify (written and checked by this process,
            restored, or re-checked by a pass).
        hashed_at: step -> number of the pass that last hashed it in full (the
            write-time check counts); the round robin picks the smallest.
        passes: How many passes ran.

    Example:
        >>> known = KnownGood()
        >>> known.mark_hashed(40)
        >>> sorted(known.verified), known.hashed_at
        ([40], {40: 0})
    """

    verified: set[int] = field(default_factory=set)
    hashed_at: dict[int, int] = field(default_factory=dict)
    passes: int = 0

    def mark_hashed(self, step: int) -> None:
        """``step`` verified in full just now."""
        self.verified.add(step)
        self.hashed_at[step] = self.passes

    def forget(self, steps: Collection[int]) -> None:
        """``steps`` are gone or failed a check: they no longer count as good."""
        for step in steps:
            self.verified.discard(step)
            self.hashed_at.pop(step, None)


def check_save(folder: Path, *, full: bool) -> str | None:
    """Check one published save (any layout); ``None`` when it is good, else the reason.

    Args:
        folder: A ``step-XXXXXXXX`` folder.
        full: Hash every part (``True``), or only read the manifest and ``stat``
            the parts (``False``: the cheap check, no tensor bytes read).

    Example:
        >>> check_save(run_dir / "step-00000040", full=False)  # doctest: +SKIP
    """
    try:
        result, _ = inspect_save(folder, hash_parts=full)
    except Exception as exc:  # an unknown schema or a vanished folder: not something to rely on
        return f"{folder.name}: {exc}"
    return None if result.ok else f"{folder.name}: {result.reason}"


def _why_not(run_dir: Path, step: int, *, full: bool, known: KnownGood) -> str | None:
    problem = check_save(run_dir / step_dir_name(step), full=full)
    if problem is None and full:
        known.hashed_at[step] = known.passes
    return problem


def retention_pass(
    run_dir: Path,
    policy: RetentionPolicy,
    known: KnownGood,
    *,
    emit: Emit,
    fresh: Collection[int] = (),
    unchecked: Collection[int] = (),
    full_checks: int = 1,
    on_renamed: Callable[[int, Path], None] | None = None,
) -> list[int]:
    """One retention pass: re-check what the decision leans on, then delete what ``policy`` allows.

    Args:
        run_dir: The run directory.
        policy: ``to_delete(steps, verified)``, e.g. ``KeepLastK(3)``.
        known: The manager's memory; updated in place.
        fresh: New saves that passed their write-time check (count as just hashed).
        unchecked: New saves published without a check: hashed here before
            they count (this does not use up ``full_checks``).
        full_checks: How many older kept saves to hash in full (the budget; 1).
        emit: Event hook: ``retention_delete`` (info ``step``) before each deletion.
        on_renamed: Called with ``(step, aside)`` once a doomed save is renamed
            aside, before its files are removed (tests kill the process there).

    Returns:
        Ascending list of the deleted steps.

    Example:
        >>> known = KnownGood()
        >>> retention_pass(run_dir, KeepLastK(2), known, emit=no_events, fresh=[30])  # doctest: +SKIP
        [10]
    """
    known.passes += 1
    steps = published_steps(run_dir)
    present = set(steps)
    known.forget([s for s in known.verified if s not in present])
    for step in fresh:
        if step in present:
            known.mark_hashed(step)
    for step in unchecked:
        problem = _why_not(run_dir, step, full=True, known=known) if step in present else "gone"
        if problem is None:
            known.verified.add(step)
        else:
            log.warning("%s did not verify after publishing; not counting it as good", problem)
    # The new saves get the cheap checks too: a stat per part, and a save damaged between its
    # write-time check and this pass must not be the one everything else is deleted for.
    cheap_ok: set[int] = set(unchecked)
    budget = full_checks
    while True:
        doomed = policy.to_delete(steps, set(known.verified))
        if not doomed:
            return []
        relied_on = sorted(s for s in known.verified if s not in doomed)
        failed = []
        for step in relied_on:
            if step in cheap_ok:
                continue
            problem = _why_not(run_dir, step, full=False, known=known)
            cheap_ok.add(step)
            if problem:
                failed.append((step, problem))
        new_saves = set(fresh) | set(unchecked)
        # Older kept saves not hashed in this pass yet (the new ones were, at write time or above).
        older = [s for s in relied_on if s not in new_saves and known.hashed_at.get(s, -1) < known.passes]
        if not failed and budget > 0 and older:
            # Round robin: the save hashed longest ago (ties: the older step) is the one to read.
            step = min(older, key=lambda s: (known.hashed_at.get(s, -1), s))
            budget -= 1
            problem = _why_not(run_dir, step, full=True, known=known)
            if problem:
                failed.append((step, problem))
        if not failed:
            break
        for step, problem in failed:
            log.warning("%s no longer verifies (%s); not counting it as good", step_dir_name(step), problem)
        known.forget([s for s, _ in failed])  # decide again without them: maybe nothing may go now
    deleted = []
    for step in doomed:
        emit("retention_delete", step=step)
        renamed = None if on_renamed is None else (lambda aside, s=step: on_renamed(s, aside))
        if delete_save(run_dir / step_dir_name(step), on_renamed=renamed):
            known.forget([step])
            deleted.append(step)
    return deleted
