"""Where ``resume-test`` kills a run: the plan for each trial, and the trigger that carries it out.

Three kinds of kill points, because each catches different mistakes:

``after-save``
    right after a save becomes visible. The restart then resumes from exactly
    that save, so everything it forgot to save or restore shows up on the
    very next steps. This is the sharpest test and the one the broken examples
    fail deterministically.
``mid-save``
    while a save is being written. A save that is not atomic is left
    truncated, and a restart that loads it crashes (or resumes from garbage);
    a managed save is left as a staging folder that nobody mistakes for a save.
``random``
    at a random moment between two steps (which may fall inside a save):
    what a preemption or an out-of-memory kill actually looks like.

Targets are chosen from what the uninterrupted baseline run showed (the
steps at which it saved), with a seeded generator, so the same ``--seed``
gives the same plan.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from ckpt_lesson.resume_test.steps import StepRecord
from ckpt_lesson.resume_test.watch import MANAGER, FolderEvent

__all__ = ["KINDS", "KillPoint", "KillTarget", "KillTrigger", "TrialPlan", "plan_trials"]

KINDS = ("after-save", "mid-save", "random")


@dataclass(frozen=True)
class KillTarget:
    """One planned kill.

    Attributes:
        kind: One of :data:`KINDS`.
        step: The step it is anchored to: the save of this step (or the first
            later one), or for ``random`` the step after which the clock starts.
        delay: ``random`` only: seconds after that step's report.
    """

    kind: str
    step: int
    delay: float = 0.0


@dataclass
class TrialPlan:
    """The kills of one trial, in order. ``kind`` names the kinds used (``"after-save+mid-save"``);
    ``requested`` differs from it when the baseline made no save to aim at, so random kills stood in."""

    index: int
    kind: str
    requested: str
    targets: list[KillTarget] = field(default_factory=list)


def plan_trials(
    *,
    steps: list[int],
    save_steps: list[int],
    trials: int,
    kinds: tuple[str, ...],
    kills: int,
    seed: int,
    step_seconds: float,
) -> list[TrialPlan]:
    """Plan every trial: the kill kinds cycle from kill to kill, across trials.

    With the default three kinds, three trials of two kills each make every
    kind of kill twice, and every trial restarts after two different kinds.

    Args:
        steps: The steps the baseline reported, in order.
        save_steps: The steps at which the baseline saved.
        trials: How many trials.
        kinds: Kill kinds to cycle through.
        kills: Kills per trial (fewer when the baseline has fewer candidates).
        seed: Seeds the choice; the same seed and baseline give the same plan.
        step_seconds: A typical step's duration (the range of random delays).

    Returns:
        One :class:`TrialPlan` per trial, its targets in step order; its
        ``kind`` names the kinds it uses (``"after-save+random"``). A save at the
        baseline's last step is never a target: killing a finished run tests nothing.

    Example:
        >>> plans = plan_trials(steps=list(range(1, 41)), save_steps=[10, 20, 30, 40], trials=2,
        ...                     kinds=("after-save",), kills=2, seed=0, step_seconds=0.01)
        >>> [len(p.targets) for p in plans]
        [2, 2]
    """
    last = max(steps)
    saves = sorted({s for s in save_steps if s < last})
    candidates = sorted({s for s in steps if s < last}) or [last]
    plans = []
    for i in range(trials):
        rng = random.Random(f"resume-test:{seed}:{i}")
        wanted = [kinds[(i * kills + j) % len(kinds)] for j in range(kills)]
        # Kills aimed at saves take distinct saves; with no save to aim at they become random kills,
        # and beyond the number of saves they are dropped.
        aimed = rng.sample(saves, min(len(saves), sum(k != "random" for k in wanted)))
        targets = []
        for kind in wanted:
            if kind != "random" and aimed:
                targets.append(KillTarget(kind, aimed.pop()))
            elif kind == "random" or not saves:
                delay = rng.uniform(0.0, max(step_seconds, 0.001))
                targets.append(KillTarget("random", rng.choice(candidates), delay))
        targets.sort(key=lambda t: t.step)  # one process after another: kills go forward in the run
        label = "+".join(dict.fromkeys(t.kind for t in targets))
        plans.append(TrialPlan(i + 1, label, "+".join(dict.fromkeys(wanted)), targets))
    return plans


@dataclass(frozen=True)
class KillPoint:
    """Where a kill actually landed: ``point`` in words, ``mid_save`` when a save was in progress."""

    point: str
    mid_save: bool


class KillTrigger:
    """Decide, poll by poll, when to kill a run for one :class:`KillTarget`.

    Args:
        target: The planned kill.
        layout: What the checkpoint folder is (:data:`~watch.MANAGER` or not).
        clock: Monotonic clock (tests pass a fake one).

    Example:
        >>> trigger = KillTrigger(KillTarget("after-save", 10), "manager")
        >>> trigger.check([FolderEvent("published", "step-00000010", 10)], [], 10, saving=False).point
        'right after step-00000010 was published'
    """

    def __init__(self, target: KillTarget, layout: str, clock: Callable[[], float] = time.monotonic) -> None:
        self.target = target
        self.layout = layout
        self._clock = clock
        self._armed_after: int | None = None  # files, after-save: the save began after this step
        self._due: float | None = None  # random: when to kill
        self._due_step: int | None = None

    def check(
        self, events: list[FolderEvent], records: list[StepRecord], step: int | None, *, saving: bool
    ) -> KillPoint | None:
        """The kill point if it is time to kill now, else ``None``.

        Args:
            events: Folder changes since the last poll.
            records: Steps reported since the last poll.
            step: The last step reported so far, ``records`` included (a script reports
                a step, then saves, so a save seen in the same poll follows them).
            saving: Whether a save is in progress right now (for the record only).
        """
        t = self.target
        before = -1 if step is None else step
        if t.kind == "random":
            return self._check_random(records, saving)
        manager = self.layout == MANAGER or any(e.kind != "activity" for e in events)
        if manager:
            for e in events:
                if e.step is None or e.step < t.step:
                    continue
                if e.kind == "published":
                    if t.kind == "after-save":
                        return KillPoint(f"right after step-{e.step:08d} was published", False)
                    return KillPoint(
                        f"right after step-{e.step:08d} was published (the save finished before "
                        "the kill could interrupt it)",
                        False,
                    )
                if e.kind == "staging" and t.kind == "mid-save":
                    return KillPoint(f"during the save of step {e.step} (staging folder present)", True)
            return None
        active = any(e.kind == "activity" for e in events)
        if t.kind == "mid-save":
            if active and before >= t.step:
                written = next(e.name for e in events if e.kind == "activity")
                return KillPoint(f"while files were being written after step {before} ({written})", True)
            return None
        # after-save in a generic folder: the save is over once the script reports its next step.
        if self._armed_after is None and active and before >= t.step:
            self._armed_after = before
        if self._armed_after is not None:
            later = [r.step for r in records if r.step > self._armed_after]
            if later:
                return KillPoint(
                    f"right after the save at step {self._armed_after} (at step {later[0]})", saving
                )
        return None

    def _check_random(self, records: list[StepRecord], saving: bool) -> KillPoint | None:
        if self._due is None:
            reached = [r.step for r in records if r.step >= self.target.step]
            if not reached:
                return None
            self._due = self._clock() + self.target.delay
            self._due_step = reached[0]
        if self._clock() >= self._due:
            where = " (a save was in progress)" if saving else ""
            return KillPoint(
                f"at a random moment, {self.target.delay:.3f} s after step {self._due_step}{where}", saving
            )
        return None

    def seconds_until_due(self) -> float | None:
        """For a random kill already scheduled: how long until it is due (to wake in time)."""
        if self._due is None:
            return None
        return max(0.0, self._due - self._clock())
