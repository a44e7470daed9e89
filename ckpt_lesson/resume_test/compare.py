"""Comparing a killed-and-restarted run with the uninterrupted one, step by step.

A trial is several processes: each ran from where the previous one's last
save left off, and some steps were run twice (the ones after the last save,
before the kill). The *stitched* trajectory keeps, for each step, the value
from the last process that ran it: that is the run the user would have
ended up with. It must equal the baseline's, within ``--atol``/``--rtol``
(exact by default: on CPU a correct resume is bit-for-bit), and sample ids
must match exactly wherever both runs reported them.

Where the first difference appears says what was lost, which is why the
report can name a cause (see :mod:`diagnose`):

* on the first step after resume, on the same samples: the forward pass saw
  the same weights and data, so the *randomness* differs (RNG not restored);
* the sample ids differ there: the *data position* was lost;
* the first step matches, the second does not: the weights were right but
  the *update* was not (a fresh optimizer, a scheduler not restored);
* several steps match, then a difference: something carried across steps
  (gradients accumulated across micro-batches) was not in the save.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from ckpt_lesson.resume_test.runner import Attempt
from ckpt_lesson.resume_test.steps import StepRecord

__all__ = [
    "Difference",
    "RestartStat",
    "close",
    "compare",
    "epoch_starts",
    "restart_stats",
    "stitch",
    "trajectory",
]


@dataclass(frozen=True)
class Difference:
    """One step where the trial does not match the baseline.

    Attributes:
        step: The step.
        what: ``"loss"``, ``"sample_ids"``, ``"metric NAME"``, ``"missing"`` (the
            trial never reported it) or ``"extra"`` (the baseline never did).
        baseline, resumed: The two values (``None`` for a missing side).
        attempt: Which process of the trial reported the value (1 = the first).
    """

    step: int
    what: str
    baseline: Any
    resumed: Any
    attempt: int | None

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass(frozen=True)
class RestartStat:
    """What one restart (process 2, 3, ... of a trial) did.

    Attributes:
        attempt: The process's number in its trial (2 for the first restart).
        resumed_from: The step it continued from (0: it started over).
        first_step: The first step it reported (``None``: it reported none).
        steps_redone: Steps it ran that an earlier process of the trial had already run.
        recovery_seconds: From its start to its first step beyond what had been
            done before (``None`` when it never got there).
        from_scratch: It began at the baseline's first step.
    """

    attempt: int
    resumed_from: int | None
    first_step: int | None
    steps_redone: int
    recovery_seconds: float | None
    from_scratch: bool

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def trajectory(records: Iterable[StepRecord]) -> dict[int, StepRecord]:
    """step -> record; a step reported twice keeps its last report."""
    return {r.step: r for r in records}


def stitch(attempts: list[Attempt]) -> dict[int, tuple[StepRecord, int]]:
    """step -> (record, attempt number) from the last process of a trial that ran that step.

    Example:
        >>> stitched = stitch(trial.attempts)  # doctest: +SKIP
        >>> stitched[21][1]  # step 21 came from the first restart  # doctest: +SKIP
        2
    """
    out: dict[int, tuple[StepRecord, int]] = {}
    for attempt in attempts:
        for record in attempt.records:
            out[record.step] = (record, attempt.index)
    return out


def close(a: float, b: float, *, atol: float = 0.0, rtol: float = 0.0) -> bool:
    """``|a - b| <= atol + rtol * |b|``; two NaNs, or equal infinities, count as equal.

    Example:
        >>> close(1.0, 1.0), close(1.0, 1.0 + 1e-12), close(1.0, 1.001, rtol=1e-2)
        (True, False, True)
    """
    if math.isnan(a) or math.isnan(b):
        return math.isnan(a) and math.isnan(b)
    if math.isinf(a) or math.isinf(b):
        return a == b
    return abs(a - b) <= atol + rtol * abs(b)


def _record_difference(
    base: StepRecord, got: StepRecord, atol: float, rtol: float
) -> tuple[str, Any, Any] | None:
    if base.sample_ids is not None and got.sample_ids is not None and base.sample_ids != got.sample_ids:
        return "sample_ids", list(base.sample_ids), list(got.sample_ids)
    if not close(got.loss, base.loss, atol=atol, rtol=rtol):
        return "loss", base.loss, got.loss
    for name in sorted(base.metrics.keys() & got.metrics.keys()):
        if not close(got.metrics[name], base.metrics[name], atol=atol, rtol=rtol):
            return f"metric {name}", base.metrics[name], got.metrics[name]
    return None


def compare(
    baseline: dict[int, StepRecord],
    stitched: dict[int, tuple[StepRecord, int]],
    *,
    atol: float = 0.0,
    rtol: float = 0.0,
) -> list[Difference]:
    """Every step where the stitched trial differs from the baseline, in step order.

    Example:
        >>> diffs = compare(trajectory(baseline.records), stitch(trial.attempts))  # doctest: +SKIP
        >>> diffs[0].step, diffs[0].what  # doctest: +SKIP
        (21, 'loss')
    """
    out = []
    for step in sorted(baseline.keys() | stitched.keys()):
        base = baseline.get(step)
        if step not in stitched:
            out.append(Difference(step, "missing", base.loss if base else None, None, None))
            continue
        got, attempt = stitched[step]
        if base is None:
            out.append(Difference(step, "extra", None, got.loss, attempt))
            continue
        found = _record_difference(base, got, atol, rtol)
        if found is not None:
            out.append(Difference(step, found[0], found[1], found[2], attempt))
    return out


def matches_baseline(attempt: Attempt, baseline: dict[int, StepRecord], *, atol: float, rtol: float) -> bool:
    """Whether every step this one process reported equals the baseline's."""
    for record in attempt.records:
        base = baseline.get(record.step)
        if base is None or _record_difference(base, record, atol, rtol) is not None:
            return False
    return True


def restart_stats(attempts: list[Attempt], baseline_steps: list[int]) -> list[RestartStat]:
    """One :class:`RestartStat` per restart of a trial (every attempt after the first).

    Example:
        >>> [s.steps_redone for s in restart_stats(trial.attempts, sorted(baseline))]  # doctest: +SKIP
        [3]
    """
    out = []
    done_max: int | None = None
    first_of_run = baseline_steps[0] if baseline_steps else 0
    for attempt in attempts:
        steps = [r.step for r in attempt.records]
        if attempt.index > 1:
            first = steps[0] if steps else None
            redone = len({s for s in steps if done_max is not None and s <= done_max})
            recovery = None
            for r in attempt.records:
                if done_max is None or r.step > done_max:
                    recovery = max(0.0, r.t - attempt.started)
                    break
            resumed = _resumed_from(first, baseline_steps)
            scratch = first is not None and first <= first_of_run
            out.append(RestartStat(attempt.index, resumed, first, redone, recovery, scratch))
        if steps:
            done_max = max(steps) if done_max is None else max(done_max, *steps)
    return out


def _resumed_from(first: int | None, baseline_steps: list[int]) -> int | None:
    if first is None:
        return None
    i = bisect.bisect_left(baseline_steps, first)
    return baseline_steps[i - 1] if i > 0 else 0


def epoch_starts(baseline: dict[int, StepRecord]) -> list[int]:
    """Steps where the baseline began a new pass over its data (judged from sample ids).

    A step whose ids include one already seen since the last start begins a new epoch.

    Example:
        >>> recs = [StepRecord(s, 0.0, ids) for s, ids in [(1, (0, 1)), (2, (2, 3)), (3, (1, 0))]]
        >>> epoch_starts(trajectory(recs))
        [1, 3]
    """
    starts: list[int] = []
    seen: set[Any] = set()
    for step in sorted(baseline):
        ids = baseline[step].sample_ids
        if ids is None:
            continue
        if not starts or seen & set(ids):
            starts.append(step)
            seen = set()
        seen |= set(ids)
    return starts


def find_repeat(ids: tuple[Any, ...], before: int, baseline: dict[int, StepRecord]) -> int | None:
    """The latest baseline step before ``before`` that trained on exactly ``ids``, if any."""
    for step in sorted((s for s in baseline if s < before), reverse=True):
        if baseline[step].sample_ids == ids:
            return step
    return None
