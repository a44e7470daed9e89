"""Continuity: what the learner writes in one lesson is used in the lessons after it.

When a lesson's exercise check passes, the learner's functions are kept, one file
each under ``ckpt_work/yours/`` (:func:`ckpt_lesson.course.keeping.keep`, only
after the copy, loaded on its own, passes the same check). Later cells, and later
notebooks in a fresh kernel, call :func:`yours`::

    from ckpt_lesson.course.carry import yours
    capture, restore = yours("capture_rng_state", "restore_rng_state")
    # using your capture_rng_state, restore_rng_state from 01

:func:`yours` returns the learner's functions when they were kept and load,
otherwise the package's own version of the same piece, and prints one line
saying whose version is used. The committed notebooks are unsolved, so their
stored output is always the package's line.

The kept files are the learner's own code, run again in this process: they are
read only if they are regular files (never through a symlink) and size-capped;
a file that does not load is reported and the package's version is used instead.
This module needs the list of exercises (to find the package's version), so it
sits above ``exercises.py``; keeping sits below ``exercise.py``.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from ckpt_lesson.course.exercise import _resolve
from ckpt_lesson.course.exercises import EXERCISES
from ckpt_lesson.course.keeping import MAX_SOURCE_BYTES, YOURS_DIR, load_kept
from ckpt_lesson.errors import CheckpointError
from ckpt_lesson.files.safe_read import read_regular_file

__all__ = ["LESSONS", "yours"]

#: The lesson whose exercise asks for each function, for the line :func:`yours` prints.
LESSONS: dict[str, str] = {
    "capture_rng_state": "01",
    "restore_rng_state": "01",
    "atomic_save": "02",
    "save_checkpoint": "03",
    "load_checkpoint": "03",
    "plan_param_group": "04",
    "write_shards": "04",
    "next_batch_ids": "05",
}


def yours(*names: str, folder: Path = YOURS_DIR) -> Any:
    """The learner's kept functions when they load, else the package's; prints whose are used.

    Several names are loaded together (all the learner's, or all the package's),
    so a pair such as ``capture_rng_state`` / ``restore_rng_state`` never mixes
    two implementations.

    Args:
        *names: The functions' names, as the exercise asks for them.
        folder: Where :func:`keep` put them; :data:`YOURS_DIR` under the working directory.

    Returns:
        One function for one name, else a tuple in the order of ``names``.

    Raises:
        CheckpointError: No name given, or no exercise asks for a function of that name.

    Example:
        >>> from ckpt_lesson.course.carry import yours
        >>> next_batch_ids = yours("next_batch_ids")  # doctest: +SKIP
        using the package's next_batch_ids: exercise 05 not solved yet
    """
    if not names:
        raise CheckpointError("yours() needs at least one function name, e.g. yours('capture_rng_state').")
    found = [_package_version(name) for name in names]
    package = [fn for fn, _ in found]
    lessons = " and ".join(
        sorted({LESSONS.get(name, exercise) for name, (_, exercise) in zip(names, found, strict=True)})
    )
    chosen: list[Callable[..., Any]] = []
    problem = None
    for name in names:
        path = folder / f"{name}.py"
        try:
            data = read_regular_file(path, limit=MAX_SOURCE_BYTES, what="kept function")
        except FileNotFoundError:
            problem = f"exercise {lessons} not solved yet"
            break
        except CheckpointError:  # a symlink, a FIFO, a huge file: not something keep() wrote
            problem = f"{path.as_posix()} is not a plain file keep() wrote; delete it, "
            problem += f"solve exercise {lessons} again"
            break
        try:
            chosen.append(load_kept(data.decode("utf-8"), name, path.as_posix()))
        except Exception as exc:  # the learner's code: any failure means "use the package's"
            reason = f"{type(exc).__name__}: {exc}".splitlines()[0]
            problem = f"your kept {path.as_posix()} does not load ({reason}); solve exercise {lessons} again"
            break
    listed = ", ".join(names)
    if problem is None:
        print(f"using your {listed} from {lessons}")
    else:
        chosen = package
        print(f"using the package's {listed}: {problem}")
    return chosen[0] if len(names) == 1 else tuple(chosen)


def _package_version(name: str) -> tuple[Callable[..., Any], str]:
    """The package's own function for ``name`` (else the reference solution) and its exercise's name."""
    for exercise in EXERCISES.values():
        for reference in exercise.references:
            if reference.__name__ != name:
                continue
            for spec in exercise.package:
                if spec.partition(":")[2] == name:
                    return _resolve(spec), exercise.name
            return reference, exercise.name
    asked = sorted(f.__name__ for e in EXERCISES.values() for f in e.references)
    raise CheckpointError(f"yours({name!r}): no exercise asks for a function named {name}; known: {asked}.")
