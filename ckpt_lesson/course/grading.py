"""The grading loop the exercise graders share: cases in, one verdict out.

A grader (``ckpt_lesson.course.graders_*``) only builds cases. Each :class:`_Case`
says in words what it calls (no temp paths, so notebook output stays the same
on every machine), how to call the learner's function, and how to judge the
answer: a complaint in words, or ``None`` when the answer is right.
:func:`_grade` runs them in order and stops at the first complaint, turning
``NotImplementedError`` into "not attempted" and any other exception into a
shown failure, never a crash.

The helpers below keep failure messages short enough to read in a notebook:
long values are clipped, sets print sorted, and :func:`_first_difference`
walks two payloads and names the first key whose values differ (tensors
compared bitwise, because a migration must not change a single bit).
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["GradeResult", "kept_failure_line", "verdict_line"]


@dataclass(frozen=True)
class GradeResult:
    """The outcome of one grader.

    Attributes:
        passed: Every case agreed with the reference and kept the invariants.
        attempted: False when the function still raises ``NotImplementedError``.
        cases: How many cases were run (grading stops at the first failure;
            0 when not attempted).
        first_failure: The first failing case in words, or ``None``.
    """

    passed: bool
    attempted: bool
    cases: int
    first_failure: str | None


@dataclass(frozen=True)
class _Case:
    """One call: ``describe`` names it in words (no temp paths), ``judge`` returns a complaint or None."""

    describe: str
    call: Callable[[Callable[..., Any]], Any]
    judge: Callable[[Any], str | None]
    expect_raise: tuple[type[BaseException], ...] = ()


def _grade(
    name: str,
    fn_name: str,
    fn: Callable[..., Any],
    cases: Iterable[_Case],
    verbose: bool,
    scrub: Callable[[str], str] = str,
) -> GradeResult:
    """Run ``cases`` until the first failure; ``scrub`` cleans the failure text (e.g. temp paths)."""
    count = 0
    for case in cases:
        count += 1
        try:
            got = case.call(fn)
        except NotImplementedError:
            result = GradeResult(False, False, 0, None)
            break
        except Exception as exc:  # the learner's bug is the finding, never a crash of the grader
            if case.expect_raise and isinstance(exc, case.expect_raise):
                continue
            message = f"{case.describe}: raised {type(exc).__name__}: {_clip(str(exc), 200)}"
            result = GradeResult(False, True, count, scrub(message))
            break
        if case.expect_raise:
            wanted = " or ".join(e.__name__ for e in case.expect_raise)
            problem: str | None = f"expected {wanted} to be raised, got {_short(got)}"
        else:
            problem = case.judge(got)
        if problem is not None:
            result = GradeResult(False, True, count, scrub(f"{case.describe}: {problem}"))
            break
    else:
        result = GradeResult(True, True, count, None)
    if verbose:
        print(verdict_line(name, fn_name, result))
    return result


class _Watch:
    """Record fsync (of a file or a directory) and rename calls, in order, while a save runs."""

    def __enter__(self) -> _Watch:
        self.events: list[tuple[str, str, str]] = []
        self.real = (os.fsync, os.replace, os.rename)
        real_fsync, real_replace, real_rename = self.real

        def fsync(fd: Any) -> None:
            number = fd if isinstance(fd, int) else fd.fileno()
            kind = "dir" if stat.S_ISDIR(os.fstat(number).st_mode) else "file"
            self.events.append(("fsync", kind, ""))
            real_fsync(fd)

        def replace(src: Any, dst: Any, **kw: Any) -> None:
            self.events.append(("rename", os.fspath(src), os.fspath(dst)))
            real_replace(src, dst, **kw)

        def rename(src: Any, dst: Any, **kw: Any) -> None:
            self.events.append(("rename", os.fspath(src), os.fspath(dst)))
            real_rename(src, dst, **kw)

        os.fsync, os.replace, os.rename = fsync, replace, rename
        return self

    def __exit__(self, *exc: object) -> None:
        os.fsync, os.replace, os.rename = self.real


def verdict_line(name: str, fn_name: str, result: GradeResult, nudge: str = "") -> str:
    """The one line a grader prints: PASS, FAIL with the first failing case, or NOT ATTEMPTED.

    The NOT ATTEMPTED line names no count, path or time, so a notebook committed with an
    untouched scaffold stores the same output on every machine (nbval compares it).
    """
    if not result.attempted:
        return (
            f"NOT ATTEMPTED {name}: {fn_name} still raises NotImplementedError. Write your version in "
            f"the scaffold cell, then run this cell again.{nudge}"
        )
    if result.passed:
        return f"PASS {name}: all {result.cases} cases agree with the reference and keep the invariants."
    return f"FAIL {name} (case {result.cases}): {result.first_failure}"


def kept_failure_line(name: str, fn_name: str, broken: str) -> str:
    """The verdict when the learner's function passed but its kept copy, loaded on its own, does not."""
    return (
        f"FAIL {name}: {fn_name} passed in this notebook, but not on its own as the next notebook loads "
        f"it: {broken}. Define what it uses in a cell (or inside the function), then run this cell again."
    )


def _clip(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _short(value: Any, limit: int = 120) -> str:
    return _clip(repr(value), limit)


def _setrepr(values: Iterable[int]) -> str:
    items = sorted(values)
    return "{" + ", ".join(map(str, items)) + "}" if items else "set()"


def _first_difference(expected: Any, got: Any, where: str) -> str | None:
    """The first place where ``got`` differs from ``expected``, in words; tensors compared bitwise."""
    if isinstance(expected, torch.Tensor):
        same = isinstance(got, torch.Tensor) and got.dtype == expected.dtype and torch.equal(got, expected)
        return None if same else f"{where}: tensors differ"
    if isinstance(expected, dict):
        if not isinstance(got, dict):
            return f"{where}: expected a dict, got {_short(got)}"
        for key in expected:
            if key not in got:
                return f"{where}[{key!r}] is missing (expected {_short(expected[key], 60)})"
            problem = _first_difference(expected[key], got[key], f"{where}[{key!r}]")
            if problem is not None:
                return problem
        extra = [k for k in got if k not in expected]
        return f"{where} has unexpected key(s) {extra}" if extra else None
    if isinstance(expected, (list, tuple)):
        if type(got) is not type(expected) or len(got) != len(expected):
            return f"{where}: expected {_short(expected, 60)}, got {_short(got, 60)}"
        for i, (e, g) in enumerate(zip(expected, got, strict=True)):
            problem = _first_difference(e, g, f"{where}[{i}]")
            if problem is not None:
                return problem
        return None
    if type(got) is not type(expected) or got != expected:
        return f"{where}: expected {_short(expected, 60)}, got {_short(got, 60)}"
    return None
