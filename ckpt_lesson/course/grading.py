"""The grading loop the exercise graders share: cases in, one verdict out.

A grader (``ckpt_lesson.course.graders_*``) only builds cases. Each :class:`_Case`
says in words what it calls (no temp paths, so notebook output stays the same
on every machine), how to call the learner's function, and how to judge the
answer: a complaint in words, or ``None`` when the answer is right.
:func:`_grade` runs them in order and stops at the first complaint, turning
``NotImplementedError`` into "not attempted" and any other exception into a
shown failure, never a crash.

The helpers below keep failure messages short enough to read in a notebook:
:func:`verdict_line` prints a coloured PASS line or a FAIL block wrapped between
words, :func:`exception_text` trims an exception to one plain line (torch's
weights-only refusal to its reason, ANSI bold removed), long values are
clipped, sets print sorted, and :func:`_first_difference`
walks two payloads and names the first key whose values differ (tensors
compared bitwise, because a migration must not change a single bit).
"""

from __future__ import annotations

import os
import re
import stat
import textwrap
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["FAIL_MARK", "PASS_MARK", "GradeResult", "exception_text", "kept_failure_line", "verdict_line"]

#: The verdict words as printed: bold green and bold red (ANSI; Jupyter renders them, nbval compares the
#: text, escapes included, which is the same on every run).
PASS_MARK = "\x1b[1;32mPASS\x1b[0m"
FAIL_MARK = "\x1b[1;31mFAIL\x1b[0m"
_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
_WIDTH = 100  # a verdict's lines, so a notebook never wraps them mid-word
_CASE_WIDTH = 120  # the case stays on one line, clipped: its inputs are there to be read


@dataclass(frozen=True)
class GradeResult:
    """The outcome of one grader.

    Attributes:
        passed: Every case agreed with the reference and kept the invariants.
        attempted: False when the function still raises ``NotImplementedError``.
        cases: How many cases were run (grading stops at the first failure;
            0 when not attempted).
        first_failure: The first failing case in words (``"<case>: <what went wrong>"``), or ``None``.
        case: The first failing case's description alone, when it came from a case.
    """

    passed: bool
    attempted: bool
    cases: int
    first_failure: str | None
    case: str | None = None


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
            message = f"{case.describe}: raised {exception_text(exc)}"
            result = GradeResult(False, True, count, scrub(message), scrub(case.describe))
            break
        if case.expect_raise:
            wanted = " or ".join(e.__name__ for e in case.expect_raise)
            problem: str | None = f"expected {wanted} to be raised, got {_short(got)}"
        else:
            problem = case.judge(got)
        if problem is not None:
            result = GradeResult(
                False, True, count, scrub(f"{case.describe}: {problem}"), scrub(case.describe)
            )
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
    """What a grader prints: a PASS line, a short FAIL block, or the NOT ATTEMPTED line.

    The FAIL block names the learner's function first, then the failing case on one line, what
    went wrong (wrapped between words) and, with ``nudge``, where to get help. The NOT ATTEMPTED
    line names no count, path or time, so a notebook committed with an untouched scaffold stores
    the same output on every machine (nbval compares it).

    Args:
        name: The exercise (``"keep_k"``) or grader (``"check_keep_k"``) name.
        fn_name: The function(s) graded, ``"capture_rng_state or restore_rng_state"``.
        result: The grader's result.
        nudge: A sentence on hints and the solution, printed last.

    Returns:
        The text to print (one line, or a few for a FAIL).

    Example:
        >>> line = verdict_line("keep_k", "keep_last_k", GradeResult(True, True, 12, None))
        >>> line.startswith(PASS_MARK + " keep_last_k (keep_k): all 12 cases agree")
        True
    """
    if not result.attempted:
        return (
            f"NOT ATTEMPTED {name}: {fn_name} still raises NotImplementedError. Write your version in "
            f"the scaffold cell, then run this cell again.{nudge}"
        )
    names = fn_name.replace(" or ", ", ").replace("/", ", ")
    if result.passed:
        agree = f"all {result.cases} cases agree with the reference and keep the invariants."
        return f"{PASS_MARK} {names} ({name}): {agree}"
    failure = result.first_failure or ""
    case = result.case
    if case and failure.startswith(case + ": "):
        lines = [f"{FAIL_MARK} {names} ({name}, case {result.cases})", f"  case:  {_clip(case, _CASE_WIDTH)}"]
        lines += _wrapped("wrong:", failure[len(case) + 2 :])
    else:
        lines = [f"{FAIL_MARK} {names} ({name}, case {result.cases})", *_wrapped("wrong:", failure)]
    return "\n".join(lines + (_wrapped("next:", nudge.strip()) if nudge else []))


def kept_failure_line(name: str, fn_name: str, broken: str) -> str:
    """The verdict when the learner's function passed but its kept copy, loaded on its own, does not."""
    names = fn_name.replace(" or ", ", ").replace("/", ", ")
    lines = [
        f"{FAIL_MARK} {names} ({name}): passed here, but not loaded on its own as the next notebook loads it"
    ]
    lines += _wrapped("wrong:", broken)
    lines += _wrapped(
        "fix:",
        "define every name it uses in a notebook cell (or inside the function), then run this cell again.",
    )
    return "\n".join(lines)


def exception_text(exc: BaseException) -> str:
    """``"TypeName: message"`` for a verdict: ANSI escapes removed, the first line, clipped.

    torch's weights-only refusal is a paragraph of advice in bold; its one useful line is the
    unpickler's reason, which is kept instead.

    Args:
        exc: The exception the learner's code raised.

    Returns:
        One short line.

    Example:
        >>> exception_text(KeyError("model"))
        "KeyError: 'model'"
    """
    text = _ANSI.sub("", str(exc))
    marker = "WeightsUnpickler error: "
    first = next((line.strip() for line in text.split(marker)[-1].splitlines() if line.strip()), "")
    if marker in text:  # "Unsupported global: GLOBAL numpy...reconstruct was not allowed. Please use ..."
        first = re.split(r"(?<=\.)\s+(?=[A-Z])", first, maxsplit=1)[0]
    return f"{type(exc).__name__}: {_clip(first, 200)}" if first else type(exc).__name__


def _wrapped(label: str, text: str) -> list[str]:
    """``text`` under a label, wrapped between words at :data:`_WIDTH` (never inside a word)."""
    head = f"  {label:<6} "
    return textwrap.wrap(
        _ANSI.sub("", text),
        _WIDTH,
        initial_indent=head,
        subsequent_indent=" " * len(head),
        break_long_words=False,
        break_on_hyphens=False,
    ) or [head.rstrip()]


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
