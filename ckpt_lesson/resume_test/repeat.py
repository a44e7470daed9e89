"""Does the command repeat itself? A trial that differs is judged only against a baseline that repeats.

A resumed run is compared with an uninterrupted one, exactly by default. If
two *uninterrupted* runs already differ (a compiled model on several threads
can differ by one float32 ulp at some late step; an unseeded source of noise
differs everywhere), the trial's difference says nothing about the save, and
blaming it ("state carried across steps was lost at the save") misleads.

So when some trial differs, the command runs once more without interruption
(the *control*) and the control is compared with the baseline, under the
same ``--atol``/``--rtol``. If they differ, the verdict is INCONCLUSIVE, never
a FAIL about state, and never a PASS under a tolerance the user did not set
(a criterion is fixed before the result is seen): the report names the step
and the size of the difference, the usual causes, and a ``--atol``/``--rtol``
sized from what was measured, for the user to pass next time if that much
noise is acceptable.

The cost: one more uninterrupted run, and only when a trial differs (a
passing script pays nothing). ``--no-repeat-check`` skips it.
"""

from __future__ import annotations

import math
from typing import Any

from ckpt_lesson.resume_test.compare import compare, trajectory
from ckpt_lesson.resume_test.runner import Attempt
from ckpt_lesson.resume_test.steps import StepRecord

__all__ = ["CAUSES", "check_repeat", "format_repeat", "suggest_tolerance"]

CAUSES = (
    "thread counts (set torch.set_num_threads and OMP_NUM_THREADS), torch.compile (inductor picks "
    "kernels per run), cuDNN/cuBLAS autotuning and atomics (torch.backends.cudnn.benchmark=False, "
    "torch.use_deterministic_algorithms(True)), unseeded sources (time, os.urandom, a data loader's "
    "workers, an unseeded generator)"
)


def _ceil_1sig(x: float) -> float:
    """``x`` rounded up to one significant digit (3.2e-08 -> 4e-08)."""
    if x <= 0 or not math.isfinite(x):
        return x
    exp = math.floor(math.log10(x))
    return math.ceil(x / 10**exp) * 10**exp


def suggest_tolerance(baseline: dict[int, StepRecord], control: dict[int, StepRecord]) -> dict[str, float]:
    """The largest absolute and relative differences of losses and metrics, and tolerances above them.

    Returns:
        ``{"max_abs", "max_rel", "atol", "rtol"}``: ``atol``/``rtol`` are twice the largest difference,
        rounded up to one significant digit (each alone would have accepted the two runs).

    Example:
        >>> suggest_tolerance(base, control)  # doctest: +SKIP
        {'max_abs': 5.96e-08, 'max_rel': 1.2e-07, 'atol': 2e-07, 'rtol': 3e-07}
    """
    max_abs = max_rel = 0.0
    for step in baseline.keys() & control.keys():
        a, b = baseline[step], control[step]
        pairs = [(a.loss, b.loss)] + [
            (a.metrics[k], b.metrics[k]) for k in a.metrics.keys() & b.metrics.keys()
        ]
        for x, y in pairs:
            if not (math.isfinite(x) and math.isfinite(y)):
                continue
            max_abs = max(max_abs, abs(x - y))
            if x != 0:
                max_rel = max(max_rel, abs(x - y) / abs(x))
    return {
        "max_abs": max_abs,
        "max_rel": max_rel,
        "atol": _ceil_1sig(2 * max_abs),
        "rtol": _ceil_1sig(2 * max_rel),
    }


def check_repeat(baseline: Attempt, control: Attempt, *, atol: float, rtol: float) -> dict[str, Any]:
    """Compare a second uninterrupted run with the baseline.

    Args:
        baseline: The first uninterrupted run.
        control: The second one, started the same way.
        atol, rtol: The user's tolerances (the same as for the trials).

    Returns:
        The report's ``repeatability`` section: ``checked`` (True), ``repeats``, ``control``
        (its folder), and when it does not repeat: ``first_difference`` (step, what, both values),
        ``differences`` (how many steps), the measured sizes and suggested tolerances, and
        ``explanation`` (one line for the report).

    Example:
        >>> check_repeat(baseline, control, atol=0.0, rtol=0.0)["repeats"]  # doctest: +SKIP
        False
    """
    base = trajectory(baseline.records)
    section: dict[str, Any] = {"checked": True, "control": str(control.folder)}
    if control.exit_code != 0 or control.timed_out or not control.records:
        how = "did not finish in time" if control.timed_out else f"exited with code {control.exit_code}"
        last = control.last_stderr_line()
        section.update(repeats=False, explanation=(
            f"the run is not reproducible: a second uninterrupted run {how}"
            + (f" ({last})" if last else "") + f" where the first finished; its logs: {control.folder}"
        ))  # fmt: skip
        return section
    diffs = compare(base, {r.step: (r, 1) for r in control.records}, atol=atol, rtol=rtol)
    section["repeats"] = not diffs
    if not diffs:
        return section
    first = diffs[0]
    sizes = suggest_tolerance(base, trajectory(control.records))
    section.update(first_difference=first.to_dict(), differences=len(diffs), **sizes)
    if first.what in ("loss",) or first.what.startswith("metric "):
        gap = abs(first.baseline - first.resumed)
        size = f"{first.what} {first.baseline!r} vs {first.resumed!r} (by {gap:.3g})"
        hint = (
            f"; if that much noise is acceptable, pass --atol {sizes['atol']:g} or --rtol {sizes['rtol']:g} "
            f"next time (the largest difference was {sizes['max_abs']:.3g}, relative {sizes['max_rel']:.3g})"
        )
    else:
        size, hint = f"{first.what}: {first.baseline!r} vs {first.resumed!r}", ""
    section["explanation"] = (
        f"the run is not reproducible: two uninterrupted runs differ from step {first.step} on "
        f"({len(diffs)} step(s)), first in {size}; a difference after a kill cannot be blamed on the "
        f"save. Usual causes: {CAUSES}{hint}"
    )
    return section


def format_repeat(section: dict[str, Any] | None) -> str | None:
    """One line for the text report, or ``None`` when the check did not run."""
    if not section or not section.get("checked"):
        return None
    if section["repeats"]:
        return (
            "repeatable   a second uninterrupted run matched the baseline (the differences are the resume's)"
        )
    return f"repeatable   NO: {section['explanation']}"
