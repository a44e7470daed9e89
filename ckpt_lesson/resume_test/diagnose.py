"""The verdict on one trial, and a one-line diagnosis where the evidence points to a cause.

The rules, in the order they are tried (the first that applies wins):

1. a restart crashed: if it began again at the first step although a save
   existed, it never restored one (its crash, e.g. "step 10 is already saved",
   follows from that); if the kill before it landed in a save, the save was
   left damaged and the script loaded it (it is not atomic); otherwise the
   last line of its stderr says why;
2. a restart did not finish in time;
3. a restart began at the first step although a save existed: no checkpoint was found;
4. a metric the script logs is back at its first-step value on the first
   step after resume: the state behind it was rebuilt fresh (a zero hidden
   state, a new GradScaler), and the metric's name says which;
5. the first difference (see :mod:`compare` for how its position
   points to RNG, data position, optimizer or accumulated state).

The wording is deliberately "e.g.": a diagnosis is a strong hint from the
shape of the failure, not proof. The numbers it rests on are in the report.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ckpt_lesson.resume_test.compare import (
    Difference,
    RestartStat,
    compare,
    matches_baseline,
    restart_stats,
    stitch,
)
from ckpt_lesson.resume_test.evidence import data_diagnosis, first_step_diagnosis, reset_metric
from ckpt_lesson.resume_test.runner import TrialRun
from ckpt_lesson.resume_test.steps import StepRecord
from ckpt_lesson.resume_test.watch import NONE

__all__ = ["TrialVerdict", "exact_resumes", "judge_trial"]

#: A restart counts as "exact from step S" only after this many matching steps (a process
#: killed one step after resuming proves little about the optimizer).
MIN_EXACT_STEPS = 3
NOT_REPRODUCIBLE = (
    "the run is not reproducible: {where} differs from the baseline at step {step}; fix seeds, "
    "thread counts and nondeterministic ops (or allow --atol/--rtol)"
)


@dataclass
class TrialVerdict:
    """How one trial went. ``kill_point`` is the kill before the process where it went wrong."""

    index: int
    kind: str
    status: str
    ok: bool
    first_difference: Difference | None = None
    differences: int = 0
    kill_point: str | None = None
    diagnosis: str | None = None
    restarts: list[RestartStat] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        out = dict(self.__dict__)
        out["first_difference"] = self.first_difference.to_dict() if self.first_difference else None
        out["restarts"] = [r.to_dict() for r in self.restarts]
        return out


def exact_resumes(
    trials: list[TrialRun], baseline: dict[int, StepRecord], *, atol: float, rtol: float
) -> list[int]:
    """Steps that some restart resumed from and then matched the baseline on every step it ran."""
    steps = sorted(baseline)
    found = set()
    for trial in trials:
        stats = {s.attempt: s for s in restart_stats(trial.attempts, steps)}
        for attempt in trial.attempts[1:]:
            stat = stats[attempt.index]
            if stat.from_scratch or not stat.resumed_from or len(attempt.records) < MIN_EXACT_STEPS:
                continue
            if matches_baseline(attempt, baseline, atol=atol, rtol=rtol):
                found.add(stat.resumed_from)
    return sorted(found)


def judge_trial(
    trial: TrialRun,
    baseline: dict[int, StepRecord],
    *,
    atol: float,
    rtol: float,
    layout: str,
    exact: list[int],
    timeout: float,
) -> TrialVerdict:
    """Compare one trial with the baseline and explain the first thing that went wrong.

    Args:
        trial: The trial's attempts.
        baseline: The baseline trajectory.
        atol, rtol: Tolerances for losses and metrics.
        layout: What the baseline's checkpoint folder was (manager, files, none).
        exact: Steps from which some restart resumed exactly (see :func:`exact_resumes`).
        timeout: ``--timeout``, for the message.

    Example:
        >>> v = judge_trial(trial, base, atol=0, rtol=0, layout="manager", exact=[],  # doctest: +SKIP
        ...                 timeout=300)
        >>> v.ok, v.diagnosis  # doctest: +SKIP
        (False, 'the first step after resume matches, the second does not: ...')
    """
    steps = sorted(baseline)
    restarts = restart_stats(trial.attempts, steps)
    diffs = compare(baseline, stitch(trial.attempts), atol=atol, rtol=rtol)
    verdict = TrialVerdict(trial.plan.index, trial.plan.kind, trial.status, ok=True, restarts=restarts)
    verdict.differences = len(diffs)
    verdict.first_difference = diffs[0] if diffs else None
    last = trial.attempts[-1]
    before = trial.attempts[-2].kill if len(trial.attempts) > 1 else None
    if trial.status == "crashed":
        verdict.kill_point = before.point if before else None
        verdict.diagnosis = _crash(last.exit_code, last.last_stderr_line(), before)
        stat = next((s for s in restarts if s.attempt == last.index), None)
        if stat is not None and stat.from_scratch and before is not None and before.held_save:
            said = f"exit {last.exit_code}" + (
                f": {last.last_stderr_line()}" if last.last_stderr_line() else ""
            )
            verdict.diagnosis = f"{_never_restored(stat.first_step)}; it then crashed ({said})"
    elif trial.status == "timeout":
        verdict.kill_point = before.point if before else None
        after = f"after the kill {before.point}" if before else "before any kill"
        verdict.diagnosis = (
            f"a run did not finish within --timeout {timeout:g} s ({after}); it may wait on a lock, "
            "on input, or on a save that never completes"
        )
    else:
        scratch = _restart_from_scratch(trial, restarts, layout)
        if scratch is not None:
            verdict.kill_point, verdict.diagnosis = scratch
        elif diffs:
            verdict.kill_point, verdict.diagnosis = _explain(
                diffs[0], diffs, trial, restarts, baseline, exact, atol=atol, rtol=rtol
            )
    verdict.ok = verdict.diagnosis is None and not diffs
    return verdict


def _crash(code: int | None, last_line: str, before: Any) -> str:
    said = f"exit {code}" + (f": {last_line}" if last_line else "")
    if before is None:
        return (
            f"the command failed before any kill ({said}) although the baseline finished: "
            "it is not reproducible"
        )
    # A manager's staging folder is no damage (restores never look at it); anything else is.
    damaged = [d for d in before.damaged if not str(d["name"]).startswith(".staging-")]
    if damaged:
        return (
            f"the restart after a kill during a save crashed ({said}): the interrupted save left a damaged "
            "checkpoint and the script loaded it; the save is not atomic (write a temporary file, fsync, "
            "then rename it into place, or use CheckpointManager)"
        )
    return f"the restart after the kill {before.point} crashed ({said}); its stderr log says more"


def _restart_from_scratch(
    trial: TrialRun, restarts: list[RestartStat], layout: str
) -> tuple[str, str] | None:
    for stat in restarts:
        kill = trial.attempts[stat.attempt - 2].kill
        if not stat.from_scratch or kill is None:
            continue
        if layout == NONE:  # nothing was saved: nothing to resume from, so not a failure (INCONCLUSIVE)
            continue
        if kill.held_save:
            return kill.point, _never_restored(stat.first_step)
    return None


def _never_restored(first: int | None) -> str:
    return (
        f"the restart began again at step {first}; it did not restore a save, although the checkpoint "
        "folder held one when it was killed (does the script load at startup, e.g. "
        "CheckpointManager.restore_latest, and look where it saves; does it hand the save to the "
        "trainer: Lightning's fit(ckpt_path=...), the Hugging Face Trainer's "
        "train(resume_from_checkpoint=...)?)"
    )


def _explain(
    diff: Difference,
    diffs: list[Difference],
    trial: TrialRun,
    restarts: list[RestartStat],
    baseline: dict[int, StepRecord],
    exact: list[int],
    *,
    atol: float = 0.0,
    rtol: float = 0.0,
) -> tuple[str | None, str]:
    if diff.what == "missing":
        gap = [d.step for d in diffs if d.what == "missing"]
        span = (
            f"{gap[0]}"
            if len(gap) == 1
            else f"{gap[0]}..{gap[-1]}"
            if gap[-1] - gap[0] + 1 == len(gap)
            else f"{gap[0]} and others"
        )
        return None, (
            f"step(s) {span} were never reported after a restart: the run skipped work, e.g. it resumed "
            "from a later step than its checkpoint holds (the step counter is saved after being advanced)"
        )
    if diff.what == "extra":
        return None, (
            f"the trial reported step {diff.step}, which the baseline never reached: the resumed run does "
            "more steps than an uninterrupted one (its stop condition depends on state that is not restored)"
        )
    attempt = trial.attempts[(diff.attempt or 1) - 1]
    if attempt.index == 1:
        return None, NOT_REPRODUCIBLE.format(
            where=f"the first run of trial {trial.plan.index}", step=diff.step
        )
    kill = trial.attempts[attempt.index - 2].kill
    point = kill.point if kill else None
    stat = next(s for s in restarts if s.attempt == attempt.index)
    if stat.from_scratch:
        return point, NOT_REPRODUCIBLE.format(where="a restart that began at the first step", step=diff.step)
    offset = len({r.step for r in attempt.records if r.step < diff.step})
    resumed = stat.resumed_from
    got = {r.step: r for r in attempt.records}[diff.step]
    reset = reset_metric(got, baseline, atol=atol, rtol=rtol) if offset == 0 else None
    if reset is not None:
        name, value = reset
        return point, (
            f"metric '{name}' is back at its first-step value ({value:g}) at the first step after resume: "
            f"the state behind '{name}' was reset, not restored; put it in the saved state (e.g. an RNN's "
            "hidden state carried across batches, a GradScaler)"
        )
    if offset == 0:
        newest = kill.newest if kill else None
        # The save this restart resumed from holds the generators: a stream that differs was drawn from.
        rng_saved = newest is not None and "rng" in (newest["covers"] or []) and newest["step"] == resumed
        saved_in = newest["name"] if rng_saved and newest else None
        return point, first_step_diagnosis(diff, got, trial.attempts[0], baseline, rng_saved_in=saved_in)
    if diff.what == "sample_ids":
        return point, data_diagnosis(diff, offset, baseline)
    if offset == 1 and not [s for s in exact if s != resumed]:
        return point, (
            "the first step after resume matches, the second does not: the weights and RNG came back but "
            "the update did not: optimizer (or LR scheduler) state not restored, e.g. a fresh optimizer "
            "on resume"
        )
    others = [s for s in exact if s != resumed]
    also = f" (resumes from step {', '.join(map(str, others))} were exact)" if others else ""
    return point, (
        f"the first {offset} step(s) after resuming from step {resumed} match, then step {diff.step} "
        f"differs{also}: state carried across steps was lost at the save, e.g. a save inside a "
        "gradient-accumulation window (accumulated gradients are not saved; save only after an "
        "optimizer step)"
    )
