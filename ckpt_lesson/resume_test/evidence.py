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

from ckpt_lesson.resume_test.compare import Difference, close, epoch_starts, find_repeat
from ckpt_lesson.resume_test.runner import Attempt
from ckpt_lesson.resume_test.steps import StepRecord

__all__ = [
    "RngEvidence", "data_diagnosis", "first_step_diagnosis", "ids_one_batch_ahead", "reset_metric",
    "rng_evidence",
]  # fmt: skip


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


LOADER_AFTER_RESTORE = (
    "sample ids and the {gens} RNG stream differ at the first step after resume, although the save it "
    "resumed from ({save}) holds the RNG state: the generator was restored, then drawn from before the "
    "first step. The usual consumer: a DataLoader(shuffle=True) whose iterator is created after the "
    "restore draws its permutation seed from the restored global generator (the uninterrupted run drew "
    "it at the epoch's start), so the order and every later random draw shift; save the loader's "
    "position: cl.resumable(loader) in the state (each epoch's order from (seed, epoch), the batches "
    "already trained on skipped), or torchdata's StatefulDataLoader. Other consumers: a prefetch (or "
    "an RNG saved after the next batch was already drawn: capture it before the prefetch and pass it "
    "to save as rng=), a model or module built after the restore; sample_ids in log_step tell them "
    "apart (here they differ: the data order)"
)
DRAWN_AFTER_RESTORE = (
    "; the save it resumed from ({save}) holds the RNG state, so after the restore something reseeded "
    "the generator (a manual_seed after restore_latest) or drew from it before the first step: a model "
    "or module built after the restore, a prefetch, a DataLoader iterator created after the restore; "
    "seed and build before restoring (same sample_ids rule out the data order)"
)


def first_step_diagnosis(
    diff: Difference,
    got: StepRecord,
    first_run: Attempt,
    baseline: dict[int, StepRecord],
    *,
    rng_saved_in: str | None = None,
) -> str:
    """The first step after resume differs: tell RNG not restored, RNG drawn in another order,
    data position lost and other state missing apart (see :mod:`evidence`)."""
    rng = rng_evidence(diff.step, got, first_run, baseline)
    if rng.status == "one step ahead" or ids_one_batch_ahead(diff.step, got, baseline):
        what = (
            f"the {'/'.join(rng.generators)} RNG stream after it equals the baseline's one step later"
            if rng.status == "one step ahead"
            else "its sample ids are the baseline's next batch"
        )
        return (
            f"diverges at the first step after resume: {what}: the RNG was restored but consumed in "
            "another order, e.g. a batch prefetched (and its random draws taken) before the save is "
            "drawn again after the restore; save the RNG state before prefetching, or save the "
            "prefetched batch with it"
        )
    # The save held the generators and the stream still differs: restored, then drawn from (or reseeded).
    drawn = rng_saved_in is not None and rng.status == "differs"
    if diff.what == "sample_ids" and drawn:
        return LOADER_AFTER_RESTORE.format(save=rng_saved_in, gens="/".join(rng.generators))
    if diff.what == "sample_ids":
        return data_diagnosis(diff, 0, baseline)
    same_samples = got.sample_ids is not None and baseline[diff.step].sample_ids is not None
    if rng.status == "differs":
        if same_samples:
            return (
                "diverges at the first step after resume, on the same samples: RNG state not restored "
                "(dropout or augmentation draw differently than in the uninterrupted run)"
            ) + (DRAWN_AFTER_RESTORE.format(save=rng_saved_in) if drawn else "")
        return (
            "diverges at the first step after resume: RNG state not restored (the "
            f"{'/'.join(rng.generators)} RNG stream differs from that step on); report sample_ids "
            "to log_step to check the data position too"
        )
    if rng.status == "same":
        if same_samples:
            return (
                "diverges at the first step after resume, on the same samples and the same RNG stream: "
                "state other than model/optimizer/RNG is missing from the save, e.g. a recurrent "
                "hidden state, a running statistic or a buffer kept outside the state_dict"
            )
        return (
            "diverges at the first step after resume with the same RNG stream: the data position or "
            "state other than model/optimizer/RNG (e.g. a recurrent hidden state) was not restored; "
            "report sample_ids to log_step to tell the two apart"
        )
    if same_samples:
        return (
            "diverges at the first step after resume, on the same samples: cannot tell whether the RNG "
            "state was not restored or other carried state (e.g. a recurrent hidden state) is missing: "
            "no seeded global RNG was seen (log_step records torch's, NumPy's and random's)"
        )
    return (
        "diverges at the first step after resume: cannot tell whether the RNG state, the data "
        "position or other carried state was not restored; report sample_ids to log_step (and "
        "seed the global RNGs) to tell them apart"
    )


def reset_metric(
    got: StepRecord, baseline: dict[int, StepRecord], *, atol: float, rtol: float
) -> tuple[str, float] | None:
    """A metric that differs at the first step after resume *and* equals its value at the run's start.

    A value that starts over at a restart is state the script rebuilt fresh instead of restoring
    (a zero hidden state, a new GradScaler's initial scale); a value the RNG moved would not land
    exactly on the first step's number. The script's metric names then say which state it was.
    """
    base, first = baseline[got.step], baseline[min(baseline)]
    for name in sorted(got.metrics.keys() & base.metrics.keys() & first.metrics.keys()):
        value = got.metrics[name]
        if not close(value, base.metrics[name], atol=atol, rtol=rtol) and value == first.metrics[name]:
            return name, value
    return None


ORDER_REPLAYED = (
    "sample ids {where} are those of step {repeat}, the same place in the epoch begun at step {there}: "
    "the data position is restored, but the epoch's shuffled order replays that earlier epoch's. The "
    "generator the shuffle draws each epoch's order from was not restored (seeded again at start): a "
    "DataLoader(shuffle=True) draws its permutation from the global generator when its iterator is "
    "created; save and restore that generator with the checkpoint, or take each epoch's order from "
    "(seed, epoch): cl.resumable(loader) in the state"
)


def data_diagnosis(diff: Difference, offset: int, baseline: dict[int, StepRecord]) -> str:
    ids = tuple(diff.resumed)
    repeat = find_repeat(ids, diff.step, baseline)
    where = "at the first step after resume" if offset == 0 else f"{offset + 1} steps after resume"
    starts = epoch_starts(baseline)
    # The epochs the differing step and the repeated one belong to in the uninterrupted run.
    here = max((s for s in starts if s <= diff.step), default=None)
    there = max((s for s in starts if repeat is not None and s <= repeat), default=None)
    if here is not None and there is not None and here != there and diff.step - here == repeat - there:
        # The right place in the epoch, an earlier epoch's batch there: the order, not the position.
        return ORDER_REPLAYED.format(where=where, repeat=repeat, there=there)
    if repeat is not None and repeat in starts:
        also = (
            f", and the order is that of the epoch begun at step {repeat}, not of the interrupted one "
            f"begun at step {here}: the generator the shuffle draws from was not restored either"
            if here is not None and here != repeat
            else ""
        )
        return (
            f"sample ids repeat from the epoch start (step {repeat}) {where}: the data position is not "
            f"restored; the loader restarts the epoch instead of skipping the batches already seen{also}"
        )
    if repeat is not None:
        return (
            f"sample ids {where} repeat those of step {repeat}: the data position is not restored "
            "(the run trains again on data it has already seen)"
        )
    return (
        f"sample ids differ {where}: the data order is not restored (e.g. a shuffle whose generator "
        "is not seeded per epoch or not saved, or an RNG saved after the next batch was already drawn: "
        "capture it before the prefetch and pass it to save as rng=); a shuffled DataLoader draws each "
        "epoch's order when the epoch starts: save the loader's position, cl.resumable(loader) in the state"
    )
