"""PASS, INCONCLUSIVE or FAIL: a PASS must mean that a resume was really tested.

Matching the baseline is not enough. A script that never loads its
checkpoint, killed before its first save, restarts from scratch and, being
deterministic, reproduces the baseline exactly: the trajectories match and
nothing was resumed. So a PASS needs evidence that resume was exercised:

* at least one kill landed after a save was published (there was something
  to resume from);
* at least one restart really resumed: its first step is past step 1 and past
  the baseline's first step;
* steps increase strictly within every process (a step counter that restarts
  each epoch makes "step 23" mean many different moments, and every
  comparison above meaningless).

When the runs match but one of these is missing, the verdict is
INCONCLUSIVE (exit 3), with what to change. A difference is still a FAIL.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ckpt_lesson.errors import CheckpointError
from ckpt_lesson.resume_test.diagnose import TrialVerdict
from ckpt_lesson.resume_test.runner import Attempt, TrialRun
from ckpt_lesson.resume_test.watch import NONE
from ckpt_lesson.runs.steplog import CKPT_DIR_ENV

__all__ = [
    "EXIT_CODES", "Outcome", "check_baseline", "check_baseline_steps", "decide", "first_non_increasing",
]  # fmt: skip

#: The exit status of each verdict (2 is a usage error, raised as CheckpointError).
EXIT_CODES = {"PASS": 0, "FAIL": 1, "INCONCLUSIVE": 3}


@dataclass
class Outcome:
    """The overall verdict and, for INCONCLUSIVE, why (each reason says what to change)."""

    verdict: str
    reasons: list[str] = field(default_factory=list)

    @property
    def exit_code(self) -> int:
        return EXIT_CODES[self.verdict]


def first_non_increasing(attempt: Attempt) -> tuple[int, int] | None:
    """The first pair of consecutive reports (previous step, step) where the step did not go up."""
    steps = [r.step for r in attempt.records]
    for before, after in zip(steps, steps[1:], strict=False):
        if after <= before:
            return before, after
    return None


def check_baseline(baseline: Attempt, *, timeout: float, step_pattern: str | None) -> None:
    """The baseline must finish on its own, in time, and report strictly increasing steps.

    Args:
        baseline: The uninterrupted run.
        timeout: ``--timeout`` (for the message).
        step_pattern: ``--step-pattern``, if given (for the message).

    Raises:
        CheckpointError: A usage error saying what to fix.

    Example:
        >>> check_baseline(baseline, timeout=600, step_pattern=None)  # doctest: +SKIP
    """
    if baseline.timed_out:
        raise CheckpointError(
            f"the baseline run (no kills) did not finish within --timeout {timeout:g} s; "
            f"raise --timeout or shorten the run (logs: {baseline.folder})."
        )
    if baseline.exit_code != 0:
        last = baseline.last_stderr_line()
        raise CheckpointError(
            f"the baseline run (no kills) exited with code {baseline.exit_code}"
            + (f" ({last})" if last else "")
            + f"; the command must finish on its own first (stderr: {baseline.stderr})."
        )
    if not baseline.records:
        if step_pattern:
            how = f"no line of its stdout matched --step-pattern (stdout: {baseline.stdout})"
        elif baseline.bad_lines:
            how = f"its {baseline.bad_lines} log_step line(s) did not parse"
        else:
            how = "call ckpt_lesson.log_step(step, loss) after each step, or pass --step-pattern"
        raise CheckpointError(f"the baseline run logged no steps: {how}.")
    check_baseline_steps(baseline)


def check_baseline_steps(baseline: Attempt) -> None:
    """A baseline whose steps do not strictly increase cannot be compared: a usage error.

    Raises:
        CheckpointError: The step counter went back (e.g. it is the batch index within the epoch).

    Example:
        >>> check_baseline_steps(baseline)  # doctest: +SKIP
    """
    pair = first_non_increasing(baseline)
    if pair is not None:
        raise CheckpointError(
            f"the baseline run's steps do not increase (step {pair[1]} came after step {pair[0]}): "
            "report a global step that never restarts (not the batch index within an epoch) to "
            "log_step or in the --step-pattern line."
        )


def decide(
    baseline: Attempt,
    trials: list[TrialRun],
    verdicts: list[TrialVerdict],
    layout: str,
    *,
    store_resumed: bool = False,
) -> Outcome:
    """The overall verdict of a run: FAIL if any trial failed, else PASS or INCONCLUSIVE.

    Args:
        baseline: The uninterrupted run.
        trials: Every trial, in order.
        verdicts: Their verdicts (same order).
        layout: What the baseline's checkpoint folder was.
        store_resumed: ``--lose-machine`` found a restart that resumed from a save committed in an
            object store. Those saves never appear in the local folder this tool watches, so the
            store's evidence stands in for "a kill landed after a published save".

    Returns:
        The :class:`Outcome`; ``reasons`` is empty unless it is INCONCLUSIVE.

    Example:
        >>> decide(baseline, trials, verdicts, "manager").verdict  # doctest: +SKIP
        'PASS'
    """
    if any(not v.ok for v in verdicts):
        return Outcome("FAIL")
    reasons = []
    steps = [r.step for r in baseline.records]
    last, first = max(steps), min(steps)
    kills = [a.kill for t in trials for a in t.attempts if a.kill is not None]
    if store_resumed:
        pass  # the failure-domain check saw a committed save and a restart that resumed from it
    elif layout == NONE:
        reasons.append(
            "no save at all: the baseline wrote nothing into its checkpoint folder; save under "
            f"${CKPT_DIR_ENV} or the {{ckpt_dir}} argument"
        )
    elif not [s for s in baseline.save_steps if s < last]:
        reasons.append(
            f"the baseline saved only at its end (step {last}): no kill can land after a save; "
            "save more often or run longer"
        )
    elif not kills:
        reasons.append(
            "no kill happened: the command finished before its planned kill points (a kill aimed at a "
            "save a few fast steps before the end races the exit); run longer, pass another --seed, "
            "or lower --kills"
        )
    elif not any(k.held_save for k in kills):
        reasons.append(
            "no kill landed after a save was published (every kill came before the first save): save "
            "more often, run longer, or pass --kill-at after-save"
        )
    restarts = [r for v in verdicts for r in v.restarts]
    resumed = [r for r in restarts if r.first_step is not None and r.first_step > max(1, first)]
    if kills and not resumed and not reasons:
        reasons.append(
            f"every restart began at the first step ({first}): nothing was resumed; save more often, "
            "run longer, or pass --kill-at after-save"
        )
    for trial in trials:
        for attempt in trial.attempts:
            pair = first_non_increasing(attempt)
            if pair is not None:
                reasons.append(
                    f"trial {trial.plan.index}, run {attempt.index}: step {pair[1]} came after step "
                    f"{pair[0]}; report a global step that never restarts"
                )
                break
    return Outcome("INCONCLUSIVE" if reasons else "PASS", reasons)
