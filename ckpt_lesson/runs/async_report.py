"""No silent async failures: what the writer thread could not report, the interpreter's exit does.

An :class:`~ckpt_lesson.runs.async_save.AsyncCheckpointer` keeps a background
save's error and re-raises it at the next ``save_async``, ``wait`` or
``close``. A script that never makes one of those calls after its last save
(it simply ends) would exit 0 with no message and no save. So each failure
is also noted here, and forgotten once it has been raised on the training
thread; whatever is still noted when the interpreter exits is printed on
stderr, one line per save, naming the step and the cause.

Python joins non-daemon threads (the writer is one) before it runs ``atexit``
handlers, so by then every save in flight has finished or failed. The
multi-rank manager's ``save_async`` runs in DCP's executor thread, which
Python joins at the same point; its failures are noted from the future's
done-callback, keyed by the future instead of a thread.

This module also holds the writer's priority change: a ``writer_nice`` that
cannot be applied (a sandbox that forbids ``setpriority``, a platform without
per-thread nice values) is a warning, and the save runs at normal priority.
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
import threading
import weakref
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

__all__ = [
    "forget_failure",
    "lower_writer_priority",
    "note_failure",
    "note_failure_of",
    "unreported_failures",
]

log = logging.getLogger("ckpt_lesson.runs.async_save")

# Keyed by what stands for one save (its writer thread, or DCP's future): unique while it is
# referenced, and held only here.
_unreported: dict[object, str] = {}
# Saves whose failure the training thread already raised. A future's done-callbacks run after its
# result() has returned to a waiter, so a failure can be noted *after* it was raised: not again.
_raised: weakref.WeakSet[object] = weakref.WeakSet()
_guard = threading.Lock()


def note_failure(
    step: int | None,
    error: BaseException,
    *,
    key: object | None = None,
    explain: Callable[[BaseException], str] | None = None,
) -> None:
    """Remember that the save of ``step`` failed, until it is reported.

    Args:
        step: The save's step.
        error: Why it failed.
        key: What stands for this save in :func:`forget_failure`; by default the
            calling (writer) thread.
        explain: Says ``error`` in one line (default ``Type: message``).

    Example:
        >>> note_failure(240, OSError(28, "No space left on device"))  # doctest: +SKIP
    """
    why = explain(error) if explain is not None else f"{type(error).__name__}: {error}"
    line = f"asynchronous save of step {step} failed: {why}"
    key = threading.current_thread() if key is None else key
    with _guard:
        if key not in _raised:
            _unreported[key] = line


def forget_failure(key: object) -> None:
    """The failure of ``key``'s save was raised on the training thread: nothing left to report.

    Args:
        key: The writer thread, or the key given to :func:`note_failure`.

    Example:
        >>> forget_failure(writer_thread)  # doctest: +SKIP
    """
    with _guard:
        _unreported.pop(key, None)
        _raised.add(key)


def note_failure_of(
    future: Future[Any], step: int | None, *, explain: Callable[[BaseException], str] | None = None
) -> None:
    """Note the failure of the background save that ``future`` carries, when it ends (keyed by it).

    Args:
        future: The save's future (DCP's ``async_save`` returns one).
        step: The save's step.
        explain: As for :func:`note_failure`.

    Example:
        >>> done = Future()
        >>> note_failure_of(done, 40)
        >>> done.set_exception(OSError(5, "Input/output error"))
        >>> unreported_failures()
        ['asynchronous save of step 40 failed: OSError: [Errno 5] Input/output error']
        >>> forget_failure(done)
    """

    def noted(finished: Future[Any]) -> None:
        error = None if finished.cancelled() else finished.exception()
        if error is not None:
            note_failure(step, error, key=finished, explain=explain)

    future.add_done_callback(noted)


def unreported_failures() -> list[str]:
    """One line per failed background save never raised on the training thread.

    Example:
        >>> isinstance(unreported_failures(), list)
        True
    """
    with _guard:
        return list(_unreported.values())


@atexit.register
def _report_at_exit() -> None:
    for line in unreported_failures():
        print(
            f"ckpt_lesson: {line}. It was never reported (no save_async/wait/close after it), so "
            "nothing was published for that step; older saves are intact. Call wait() or close() "
            "(or use `with AsyncCheckpointer(...)`) before the script ends.",
            file=sys.stderr,
            flush=True,
        )


def lower_writer_priority(nice: int) -> None:
    """Make the calling thread ``nice`` steps nicer; log a warning instead of failing.

    Linux keeps the nice value per thread (setpriority(2), NOTES), so this
    lowers only the writer. It is relative to the value the thread inherited:
    raising nice needs no privilege, lowering it would.

    Example:
        >>> lower_writer_priority(0)
    """
    if not nice:
        return
    if not hasattr(os, "setpriority"):
        log.warning("writer_nice=%d ignored: this platform has no setpriority; the save runs as usual", nice)
        return
    me = threading.get_native_id()
    try:
        os.setpriority(os.PRIO_PROCESS, me, min(19, os.getpriority(os.PRIO_PROCESS, me) + nice))
    except OSError as exc:
        log.warning(
            "writer_nice=%d could not be applied (%s); the save runs at the training thread's priority",
            nice, exc,
        )  # fmt: skip
