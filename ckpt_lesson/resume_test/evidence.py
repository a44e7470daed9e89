"""What the first resumed step's RNG digests and sample ids say about a divergence there.

A restart that differs from the baseline at its very first step, on the same
samples, has the same weights and data: something else that the step used is
not what it was. Three mistakes look alike in the loss and differ in the
evidence ``log_step`` records (see :func:`~ckpt_lesson.runs.steplog.rng_fingerprint`):

* the RNG stream was **not restored**: its digest after the step is not the
  baseline's;
* the RNG was restored but **drawn in another order**: its digest equals the
  baseline's one step *later* (a batch prefetched before the save had already
  drawn from it, and the resumed run draws for it again), or the sample ids
  are the baseline's next batch;
* the RNG checks out and the samples match: **other state** is missing (a
  recurrent hidden state, a running statistic, a counter kept outside the save).

A digest counts only for a generator that is worth reading: one whose digests
in the trial's first run (from scratch, before any kill) equal the baseline's,
so it is seeded, and that changed during the step in question, so the step
drew from it. With no such generator the answer is "cannot tell".
"""

from __future__ import annotations

from dataclasses import dataclass

from ckpt_lesson.resume_test.runner import Attempt
from ckpt_lesson.resume_test.steps import StepRecord

__all__ = ["RngEvidence", "ids_one_batch_ahead", "rng_evidence"]


@dataclass(frozen=True)
class RngEvidence:
    """The verdict of the digests at one step.

    Attributes:
        status: ``"same"``, ``"differs"``, ``"one step ahead"`` or ``"unknown"`` (no generator
            worth reading).
        generators: The generators it rests on (``["torch"]``).
    """

    status: str
    generators: tuple[str, ...] = ()


def _trusted(step: int, first_run: Attempt, baseline: dict[int, StepRecord]) -> list[str]:
    here, before = baseline.get(step), baseline.get(step - 1)
    if here is None or here.rng is None:
        return []
    names = []
    for name, digest in here.rng.items():
        if before is not None and before.rng is not None and before.rng.get(name) == digest:
            continue  # not drawn in this step: equal digests would prove nothing
        compared = [
            r for r in first_run.records if r.step in baseline and baseline[r.step].rng is not None and r.rng
        ]
        if compared and all(r.rng.get(name) == baseline[r.step].rng.get(name) for r in compared):
            names.append(name)
    return sorted(names)


def rng_evidence(
    step: int, got: StepRecord, first_run: Attempt, baseline: dict[int, StepRecord]
) -> RngEvidence:
    """Compare the resumed run's digests at ``step`` with the baseline's at ``step`` and ``step + 1``.

    Args:
        step: The first step after the resume (where the runs differ).
        got: The resumed run's record of that step.
        first_run: The trial's first process (it ran from scratch: shows which generators are seeded).
        baseline: The baseline trajectory.

    Returns:
        The :class:`RngEvidence`.

    Example:
        >>> rng_evidence(31, got, trial.attempts[0], base).status  # doctest: +SKIP
        'differs'
    """
    names = _trusted(step, first_run, baseline)
    if not names or got.rng is None:
        return RngEvidence("unknown")
    here, after = baseline[step].rng or {}, (baseline.get(step + 1) or StepRecord(0, 0.0)).rng or {}
    if all(got.rng.get(n) == here.get(n) for n in names):
        return RngEvidence("same", tuple(names))
    ahead = [n for n in names if after.get(n) is not None and got.rng.get(n) == after.get(n)]
    if ahead:
        return RngEvidence("one step ahead", tuple(ahead))
    return RngEvidence("differs", tuple(names))


def ids_one_batch_ahead(step: int, got: StepRecord, baseline: dict[int, StepRecord]) -> bool:
    """Whether the resumed step trained on the samples the baseline took one step later."""
    nxt, here = baseline.get(step + 1), baseline.get(step)
    return (
        got.sample_ids is not None
        and nxt is not None
        and nxt.sample_ids == got.sample_ids
        and (here is None or here.sample_ids != got.sample_ids)
    )
