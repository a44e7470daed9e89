"""One graded exercise: the grader, graduated hints, and a reference solution.

The notebooks are committed *unsolved*. Each exercise is an :class:`Exercise`
object the notebook imports (``from ckpt_lesson.course.exercises import keep_k``)
and uses the way Kaggle Learn's exercises work:

* ``keep_k.check(keep_last_k)`` grades the learner's function and prints a
  green PASS line, a short red FAIL block (the function, the first failing
  case, what went wrong, where to get help), or NOT ATTEMPTED while the
  scaffold still raises ``NotImplementedError`` (that line never changes, so a
  notebook stored unsolved passes nbval);
* ``keep_k.hint()`` prints one more hint per call, most general first;
  ``keep_k.hint(2)`` prints a chosen one;
* ``keep_k.solution()`` prints the source of the reference solution, which
  lives in :mod:`ckpt_lesson.course.solutions` and is graded by the tests;
* ``rng_capture.compare()`` prints the package's own version of the piece, but
  only once it is earned: after a ``check`` that passed, or after
  ``solution()``. Before that it prints :data:`SOLVE_FIRST`'s stable line, so
  Run All on an unsolved notebook never shows an answer above the exercise.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import textwrap
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ckpt_lesson.course.grading import GradeResult, kept_failure_line, verdict_line
from ckpt_lesson.course.keeping import keep

__all__ = ["SOLVE_FIRST", "Exercise", "show_source"]

#: The start of the line :meth:`Exercise.compare` prints while the answer is not earned yet.
SOLVE_FIRST = "Solve the exercise first"


@dataclass(frozen=True)
class Exercise:
    """A graded exercise with hints and a reference solution.

    Attributes:
        name: The exercise's name, also the variable a notebook imports (``"keep_k"``).
        grader: A ``check_*`` function: takes the learner's function(s) and ``verbose=``,
            returns a :class:`GradeResult`.
        hints: Graduated hints, most general first.
        reference: The reference solution: one function, or a tuple of functions when the
            exercise asks for several (``capture_rng_state`` and ``restore_rng_state``).
        package: The package's own functions for the same piece, as ``"module:name"``
            strings that :meth:`compare` imports when it prints them (private helpers
            included, so a notebook never has to import one).

    Example:
        >>> from ckpt_lesson.course.exercises import keep_k
        >>> def keep_last_k(steps, verified, k):
        ...     raise NotImplementedError
        >>> keep_k.check(keep_last_k).attempted  # doctest: +ELLIPSIS
        NOT ATTEMPTED keep_k: ...
        False
    """

    name: str
    grader: Callable[..., GradeResult]
    hints: tuple[str, ...]
    reference: Callable[..., Any] | tuple[Callable[..., Any], ...]
    package: tuple[str, ...] = ()
    # How many hints hint() has shown; a list so the frozen object can count.
    _shown: list[int] = field(default_factory=lambda: [0], init=False, repr=False, compare=False)
    # Whether the package's version may be shown: a check passed, or solution() was asked for.
    _earned: list[bool] = field(default_factory=lambda: [False], init=False, repr=False, compare=False)

    @property
    def references(self) -> tuple[Callable[..., Any], ...]:
        """The reference function(s), always as a tuple (pass them to :meth:`check` with ``*``)."""
        return self.reference if isinstance(self.reference, tuple) else (self.reference,)

    @property
    def function_names(self) -> str:
        """The names the learner's functions must have, e.g. ``"capture_rng_state or restore_rng_state"``."""
        return " or ".join(f.__name__ for f in self.references)

    def check(self, *fns: Callable[..., Any], **kwargs: Any) -> GradeResult:
        """Grade the learner's function(s) and print the verdict (see :func:`verdict_line`).

        Args:
            *fns: The learner's functions, in the order of :attr:`function_names`.
            **kwargs: Passed on to the grader.

        When the check passes, the learner's functions (those defined in ``__main__``)
        are kept for later lessons (see :mod:`ckpt_lesson.course.keeping`): each is loaded
        on its own, as the next notebook loads it, and checked again; when that copy
        fails (a constant it reads was not kept, say) the verdict is FAIL, naming why.

        Returns:
            The grader's :class:`GradeResult`.
        """
        result = self.grader(*fns, verbose=False, **kwargs)
        kept = None
        if result.passed:  # the learner's functions are kept for later lessons (course/keeping.py)

            def recheck(copies: Sequence[Callable[..., Any]]) -> str | None:
                again = self.grader(*copies, verbose=False, **kwargs)
                return None if again.passed else again.first_failure or "raised NotImplementedError"

            functions = {ref.__name__: fn for ref, fn in zip(self.references, fns, strict=False)}
            kept = keep(functions, exercise=self.name, recheck=recheck)
            if kept.broken is not None:  # a PASS the next notebook would crash on is not a PASS
                result = GradeResult(False, True, result.cases, kept.broken)
        if result.passed:
            self._earned[0] = True
        nudge = f" {self.name}.hint() gives a hint, {self.name}.solution() shows one answer."
        if kept is not None and kept.broken is not None:
            print(kept_failure_line(self.name, self.function_names, kept.broken))
        else:
            print(verdict_line(self.name, self.function_names, result, nudge))
        if kept is not None and kept.line:
            print(kept.line)
        return result

    def hint(self, n: int | None = None) -> None:
        """Print hint ``n`` (1-based); without ``n``, the next hint not shown yet.

        Args:
            n: Which hint to print; ``None`` prints one more per call.
        """
        total = len(self.hints)
        if n is None:
            if self._shown[0] >= total:
                print(f"No more hints for {self.name} (all {total} shown). {self.name}.solution() shows one.")
                return
            self._shown[0] += 1
            n = self._shown[0]
        elif not 1 <= n <= total:
            print(f"{self.name} has hints 1 to {total}; hint({n}) does not exist.")
            return
        else:
            self._shown[0] = max(self._shown[0], n)
        print(f"Hint {n} of {total} ({self.name}): {self.hints[n - 1]}")

    def solution(self) -> None:
        """Print the reference solution's source (any function that passes the grader is right too)."""
        self._earned[0] = True  # the answer is out: comparing with the package's hides nothing more
        sources = [inspect.getsource(f).rstrip() for f in self.references]
        print(f"# One answer for {self.name}; yours may differ and still pass.\n")
        print("\n\n\n".join(sources))

    def compare(self) -> None:
        """Print the package's version of this piece, once the learner has earned it.

        A lesson's "compare with the package" cell calls this. Run All on an
        unsolved notebook must not print the answer above the exercise, so until
        a :meth:`check` has passed (or :meth:`solution` was called) it prints one
        stable line instead, the same on every run.

        Example:
            >>> from ckpt_lesson.course.exercises import atomic
            >>> atomic.compare()  # doctest: +ELLIPSIS
            Solve the exercise first: ...
        """
        if not self._earned[0]:
            print(
                f"{SOLVE_FIRST}: the package's version appears here once {self.name}.check(...) prints PASS "
                f"(or after {self.name}.solution()). Then run this cell again and compare it with yours."
            )
            return
        show_source(*(_resolve(spec) for spec in self.package))


def show_source(*functions: Callable[..., Any], docstrings: bool = False) -> None:
    """Print functions' source, by default without their docstrings, to compare with your own.

    Each lesson calls this after its exercise on the package's version of the piece the
    learner just wrote.

    Args:
        *functions: The functions to print, in order.
        docstrings: Keep the docstrings (long; the code is easier to compare without them).

    Example:
        >>> from ckpt_lesson.files.atomic import fsync_dir
        >>> show_source(fsync_dir)  # doctest: +ELLIPSIS
        # ckpt_lesson/files/atomic.py
        def fsync_dir(directory: str | os.PathLike[str]) -> None:
        ...
    """
    for number, fn in enumerate(functions):
        source = textwrap.dedent(inspect.getsource(fn))
        if not docstrings:
            source = _without_docstring(source)
        module = inspect.getmodule(fn)
        where = module.__name__.replace(".", "/") + ".py" if module else "?"
        print(("\n" if number else "") + f"# {where}\n{source.rstrip()}")


def _resolve(spec: str) -> Callable[..., Any]:
    module, _, name = spec.partition(":")
    return getattr(importlib.import_module(module), name)


def _without_docstring(source: str) -> str:
    node = ast.parse(source).body[0]
    body = getattr(node, "body", [])
    if not (
        body and isinstance(body[0], ast.Expr) and isinstance(getattr(body[0], "value", None), ast.Constant)
    ):
        return source
    first, last = body[0].lineno, body[0].end_lineno or body[0].lineno
    lines = source.splitlines()
    rest = lines[last:]
    while rest and not rest[0].strip():  # the blank line that followed the docstring
        rest.pop(0)
    return "\n".join(lines[: first - 1] + rest)
