"""Graders for the run-directory policies: keep-K retention (notebook 06) and save cadence (07).

Each ``check_*`` function takes the learner's function, runs it on fixed
hand-picked edge cases and on fixed-seed random cases (``random.Random(0)``:
the same cases on every machine), compares every answer with the package's
reference implementation and with the invariants the answer must keep, and
prints one line: PASS, FAIL with the first failing case (inputs, expected,
got), or NOT ATTEMPTED (the scaffold still raises ``NotImplementedError``).
Grading stops at the first failure: one clear counterexample teaches more than
a wall of them. The loop that runs the cases and prints the verdict is shared,
in :mod:`ckpt_lesson.course.grading`; the registry with hints and solutions is
in :mod:`ckpt_lesson.course.exercises`.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable
from typing import Any

from ckpt_lesson.course.grading import GradeResult, _Case, _grade, _setrepr, _short

__all__ = ["check_cadence", "check_keep_k"]

_RANDOM_CASES = 300


# ---------------------------------------------------------------- keep-K retention (notebook 06)


def check_keep_k(fn: Callable[..., Any], *, verbose: bool = True) -> GradeResult:
    """Grade a ``keep_last_k(steps, verified, k) -> list[int]`` (steps to delete, ascending).

    Invariants checked besides agreement with :func:`ckpt_lesson.runs.retention.keep_last_k`:
    only existing steps are deleted, the newest verified step is never deleted,
    a run that had a verified save still has one, and the inputs are not modified.

    Example:
        >>> from ckpt_lesson.runs.retention import keep_last_k
        >>> check_keep_k(keep_last_k, verbose=False).passed
        True
    """
    from ckpt_lesson.runs.retention import keep_last_k as reference

    fixed = [
        ("k=1, every step verified", [100, 200, 300], {100, 200, 300}, 1),
        ("no verified step at all", [100, 200, 300], set(), 2),
        ("newest step corrupt", [100, 200, 300, 400], {100, 200, 300}, 2),
        ("fewer verified steps than k", [100, 200, 300], {300}, 2),
        ("empty run directory", [], set(), 3),
        ("exactly k verified, oldest is one of them", [100, 200, 300], {100, 300}, 2),
        ("an unverified step between kept ones", [100, 200, 300, 400], {100, 200, 400}, 2),
        ("steps with different digit counts", [9, 10, 100, 1000], {9, 10, 100, 1000}, 2),
        ("steps listed out of order", [300, 100, 400, 200], {100, 200, 300, 400}, 2),
        ("k larger than the number of steps", [1, 2], {1, 2}, 5),
        ("k=1, only the oldest step verified", [100, 200, 300], {100}, 1),
    ]
    rng = random.Random(0)
    randoms = []
    for i in range(_RANDOM_CASES):
        steps = rng.sample(range(1, 5000), rng.randint(0, 10))
        p_good = rng.random()
        verified = {s for s in steps if rng.random() < p_good}
        if rng.random() < 0.5:
            steps.sort()
        randoms.append((f"random case {i}", steps, verified, rng.randint(1, 5)))

    def make(label: str, steps: list[int], verified: set[int], k: int) -> _Case:
        expected = reference(list(steps), set(verified), k)
        shown = f"[{label}] keep_last_k(steps={steps}, verified={_setrepr(verified)}, k={k})"
        seen: dict[str, Any] = {}

        def call(f: Callable[..., Any]) -> Any:
            seen["steps"], seen["verified"] = list(steps), set(verified)
            return f(seen["steps"], seen["verified"], k)

        def judge(got: Any) -> str | None:
            if seen["steps"] != steps or seen["verified"] != verified:
                return "modified its inputs; build a new list instead"
            if got is None or isinstance(got, (str, bytes)) or not isinstance(got, Iterable):
                return f"returned {_short(got)}; return a list of steps to delete ([] for none)"
            got = list(got)
            good = [s for s in steps if s in verified]
            if any(s not in steps for s in got):
                return f"got {got}, which deletes a step that does not exist"
            if good and max(good) in got:
                return f"got {got}, which deletes {max(good)}, the newest verified save"
            if good and not set(good) - set(got):
                return f"got {got}, which leaves no verified save at all"
            if got != expected:
                hint = " (right steps, but not in ascending order)" if sorted(got) == expected else ""
                return f"expected {expected}, got {got}{hint}"
            return None

        return _Case(shown, call, judge)

    cases = (make(*c) for c in [*fixed, *randoms])
    return _grade("check_keep_k", "keep_last_k", fn, cases, verbose)


# ---------------------------------------------------------------- save cadence (notebook 07)


def check_cadence(fn: Callable[..., Any], *, verbose: bool = True) -> GradeResult:
    """Grade a ``should_save(step, now, *, last_step, last_time, every_steps, every_seconds) -> bool``.

    Single calls are compared with :func:`ckpt_lesson.runs.cost.should_save`;
    then whole simulated runs (a fake clock, saving whenever the function
    says so) must save at exactly the same steps as the reference.

    Example:
        >>> from ckpt_lesson.runs.cost import should_save
        >>> check_cadence(should_save, verbose=False).passed
        True
    """
    from ckpt_lesson.runs.cost import should_save as reference

    def kw(last_step: Any, last_time: Any, every_steps: Any, every_seconds: Any) -> dict[str, Any]:
        return dict(
            last_step=last_step, last_time=last_time, every_steps=every_steps, every_seconds=every_seconds
        )

    fixed = [
        ("step 0 is never saved", 0, 100.0, kw(None, 0.0, 10, 60.0)),
        ("step is a multiple of every_steps", 20, 5.0, kw(10, 0.0, 10, None)),
        ("step is not a multiple", 25, 5.0, kw(20, 0.0, 10, None)),
        ("exactly every_seconds have passed", 7, 60.0, kw(5, 0.0, None, 60.0)),
        ("just short of every_seconds", 7, 59.5, kw(5, 0.0, None, 60.0)),
        ("this step was just saved (time due)", 7, 90.0, kw(7, 0.0, None, 60.0)),
        ("this step was just saved (multiple)", 20, 5.0, kw(20, 0.0, 10, None)),
        ("both rules set, only the time rule fires", 13, 75.0, kw(10, 10.0, 10, 60.0)),
        ("both rules set, only the step rule fires", 20, 15.0, kw(10, 10.0, 10, 60.0)),
        ("time counts from the last save, not from 0", 30, 150.0, kw(20, 100.0, None, 60.0)),
        ("no time reference yet (last_time None)", 3, 500.0, kw(None, None, None, 60.0)),
        ("every_steps=1 saves step 1", 1, 0.0, kw(None, 0.0, 1, None)),
        ("neither rule set", 10, 1000.0, kw(None, 0.0, None, None)),
    ]
    rng = random.Random(0)
    randoms = []
    for i in range(_RANDOM_CASES):
        step = rng.randint(0, 60)
        last_step = rng.choice([None, step, max(0, step - rng.randint(1, 20))])
        last_time = rng.choice([None, rng.randint(0, 200) * 0.5])
        now = (last_time or 0.0) + rng.randint(0, 240) * 0.5
        every_steps = rng.choice([None, rng.randint(1, 12)])
        every_seconds = rng.choice([None, float(rng.choice([10, 30, 45.5, 60]))])
        randoms.append((f"random case {i}", step, now, kw(last_step, last_time, every_steps, every_seconds)))

    def single(label: str, step: int, now: float, opts: dict[str, Any]) -> _Case:
        expected = reference(step, now, **opts)
        args = ", ".join(f"{k}={v!r}" for k, v in opts.items())

        def judge(got: Any) -> str | None:
            if not isinstance(got, bool):
                return f"returned {_short(got)}; return True or False"
            return None if got == expected else f"expected {expected}, got {got}"

        return _Case(
            f"[{label}] should_save({step}, now={now!r}, {args})", lambda f: f(step, now, **opts), judge
        )

    def simulation(i: int) -> _Case:
        sim = random.Random(1000 + i)
        every_steps = sim.choice([None, sim.randint(2, 8)])
        every_seconds = sim.choice([10.0, 25.0]) if every_steps is None or sim.random() < 0.5 else None
        durations = [sim.choice([0.5, 1.0, 2.0, 6.0]) for _ in range(40)]
        expected = _simulate(reference, durations, every_steps, every_seconds)

        def judge(got: Any) -> str | None:
            return None if got == expected else f"saved at steps {got}, the reference at {expected}"

        describe = (
            f"[simulated run {i}: 40 steps taking {durations[:6]}... s, every_steps={every_steps}, "
            f"every_seconds={every_seconds}, the timer restarting at each save]"
        )
        return _Case(describe, lambda f: _simulate(f, durations, every_steps, every_seconds), judge)

    cases = [*(single(*c) for c in [*fixed, *randoms]), *(simulation(i) for i in range(30))]
    return _grade("check_cadence", "should_save", fn, cases, verbose)


def _simulate(
    fn: Callable[..., Any], durations: list[float], every_steps: Any, every_seconds: Any
) -> list[int]:
    now, last_step, last_time, saved = 0.0, None, 0.0, []
    for step, seconds in enumerate(durations, start=1):
        now += seconds
        if fn(step, now, last_step=last_step, last_time=last_time, every_steps=every_steps,
              every_seconds=every_seconds):  # fmt: skip
            saved.append(step)
            last_step, last_time = step, now
    return saved
