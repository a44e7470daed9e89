"""Keeping the learner's functions: one file each, written only if the copy passes the check again.

When a lesson's exercise check passes, :meth:`Exercise.check` calls :func:`keep`:
each function the learner wrote (in a notebook cell, so in ``__main__``) is
written to ``ckpt_work/yours/<function>.py``, relative to the working directory
(a notebook's kernel runs in the notebook's folder), as source with every global
it reads (:mod:`ckpt_lesson.course.kept_source`), but only after that copy,
loaded on its own, passes the same check: otherwise the verdict is FAIL and
names what went missing. :func:`load_kept` loads such a file again; later cells
and notebooks reach it through :func:`ckpt_lesson.course.carry.yours`.

This module sits below the exercises (``exercise.py`` imports it); ``carry.py``,
which needs the list of exercises to find the package's version of a function,
sits above them, so imports run one way.

The kept files are the learner's own code, run again in this process: they are
written atomically, and each copy is loaded in a fresh namespace.
"""

from __future__ import annotations

import builtins
import linecache
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ckpt_lesson.course.grading import exception_text
from ckpt_lesson.course.kept_source import kept_source
from ckpt_lesson.errors import CheckpointError
from ckpt_lesson.files.atomic import atomic_write_bytes

__all__ = ["MAX_SOURCE_BYTES", "YOURS_DIR", "Kept", "keep", "load_kept"]

#: Where kept functions live, relative to the working directory (the notebook's folder).
YOURS_DIR = Path("ckpt_work") / "yours"

# A kept function is a page or two of code; anything far larger was not written by the course.
MAX_SOURCE_BYTES = 256 * 1024


@dataclass(frozen=True)
class Kept:
    """What :func:`keep` did.

    Attributes:
        line: The line to print after the verdict (kept, or why not), or ``None``.
        broken: Why the kept copy fails where the learner's function passed (a name
            that was not kept, an error on loading, a failed case), or ``None``: the
            PASS stands only when this is ``None``.
    """

    line: str | None
    broken: str | None = None


def keep(
    functions: Mapping[str, Callable[..., Any]],
    *,
    exercise: str,
    folder: Path = YOURS_DIR,
    recheck: Callable[[Sequence[Callable[..., Any]]], str | None] | None = None,
) -> Kept:
    """Keep the learner's functions that just passed ``exercise``'s check, one file each.

    Only functions defined in ``__main__`` (a notebook cell or a script) are the
    learner's; the package's reference solutions passed to a check are not kept.
    Each file is first loaded in a fresh namespace, as :func:`yours` will load it in
    the next notebook, and ``recheck`` runs the exercise's check on those copies:
    a copy that misses a name, fails to load or fails a case is not written, and
    :attr:`Kept.broken` says why.

    Args:
        functions: The expected function name (``"capture_rng_state"``) mapped to the
            function that passed, whatever the learner called it.
        exercise: The exercise's name, written into each file's header.
        folder: Where to keep them; :data:`YOURS_DIR` under the working directory.
        recheck: Runs the check on the reloaded functions (in ``functions``' order) and
            returns the first failure in words, or ``None``.

    Returns:
        A :class:`Kept`.

    Example:
        >>> from ckpt_lesson.course import solutions
        >>> keep({"keep_last_k": solutions.keep_last_k}, exercise="keep_k").line is None  # not the learner's
        True
    """
    learner = {name: fn for name, fn in functions.items() if getattr(fn, "__module__", None) == "__main__"}
    if not learner:
        return Kept(None)
    listed = ", ".join(learner)
    try:
        _check_folder(folder)
        texts = {name: _kept_text(name, fn, exercise) for name, fn in learner.items()}
    except Exception as exc:  # keeping is a convenience: an unreadable source never turns a PASS into a crash
        return _not_kept(listed, exc)
    copies = dict(functions)
    for name, (text, missing) in texts.items():
        if missing:
            unkept = ", ".join(missing)
            return Kept(None, f"your {name} reads {unkept}, which cannot be written out as source")
        try:
            copies[name] = load_kept(text, name, (folder / f"{name}.py").as_posix())  # as yours() will
        except Exception as exc:  # the learner's code, run again on its own
            return Kept(None, f"your {name}, loaded on its own, raised {exception_text(exc)}")
    failure = recheck(list(copies.values())) if recheck is not None else None
    if failure is not None:
        return Kept(None, f"loaded on its own, as the next notebook loads it: {failure}")
    try:
        for name, (text, _) in texts.items():
            atomic_write_bytes(text.encode("utf-8"), folder / f"{name}.py")
    except Exception as exc:  # a full disk or a read-only folder: the PASS still stands
        return _not_kept(listed, exc)
    them = "them" if len(learner) > 1 else "it"
    where = folder.as_posix()
    return Kept(f"Kept your {listed} in {where}/: later cells and notebooks use {them} (yours(...)).")


def _not_kept(listed: str, exc: Exception) -> Kept:
    reason = f"{type(exc).__name__}: {exc}".splitlines()[0]
    return Kept(f"Could not keep your {listed} for later notebooks ({reason}); they will use the package's.")


def _check_folder(folder: Path) -> None:
    """Refuse a kept-functions folder, or its parent ``ckpt_work``, that is a symlink; else create it."""
    for part in (folder.parent, folder):
        if part.is_symlink():
            raise CheckpointError(f"{part.as_posix()} is a symbolic link; remove it so kept files stay here.")
    folder.mkdir(parents=True, exist_ok=True)


def _kept_text(name: str, fn: Callable[..., Any], exercise: str) -> tuple[str, tuple[str, ...]]:
    """The file for one kept function (a header, the source with what it uses, an alias if renamed)
    and the globals it reads that could not be written out."""
    source = kept_source(fn)
    lines = [
        f"# Your {name}, kept when {exercise}.check(...) passed.",
        f'# yours("{name}") loads it in later cells and notebooks; delete this file to use the package\'s.',
        source.text,
    ]
    if fn.__name__ != name:
        lines.append(f"{name} = {fn.__name__}")
    return "\n".join(lines) + "\n", source.missing


def load_kept(text: str, name: str, filename: str) -> Callable[..., Any]:
    """Run a kept file's source in a fresh namespace and return its function ``name``.

    The namespace is named ``__main__``, as the notebook cell was, so a function kept
    later that calls this one (03's ``save_checkpoint`` calling 01's
    ``capture_rng_state``) carries its source along; the source is registered with
    :mod:`linecache` so ``inspect.getsource`` finds it.

    Args:
        text: The kept file's source.
        name: The function to return.
        filename: The file's name, for tracebacks and ``inspect.getsource``.

    Returns:
        The function ``name`` the source defines.

    Raises:
        NameError: The source defines no callable ``name``. Anything else the learner's
            code raises while it runs propagates: callers treat any failure as "does not load".

    Example:
        >>> load_kept("def twice(x): return 2 * x", "twice", "twice.py")(4)
        8
    """
    code = compile(text, filename, "exec")
    linecache.cache[filename] = (len(text), None, text.splitlines(keepends=True), filename)
    namespace: dict[str, Any] = {"__name__": "__main__", "__builtins__": builtins}
    exec(code, namespace)  # the learner's own code, kept when their check passed
    fn = namespace.get(name)
    if not callable(fn):
        raise NameError(f"the file defines no function {name}")
    return fn
