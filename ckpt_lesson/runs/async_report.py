"""No silent async failures: what the writer thread could not report, the interpreter's exit does.

An :class:`~ckpt_lesson.runs.async_save.AsyncCheckpointer` keeps a background
save's error and re-raises it at the next ``save_async``, ``wait`` or
``close``. A script that never makes one of those calls after its last save
(it simply ends) would exit 0 with no message and no save. So each failure
is also noted here, and forgotten once it has been raised on the training
thread; whatever is still noted when the interpreter exits is printed on
stderr, one line per save, naming the step and the cause.

Python joins non-daemon threads (the writer is one) before it runs ``atexit``
handlers, so by then every save in flight has finished or failed.

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

__all__ = ["forget_failure", "lower_writer_priority", "note_failure", "unreported_failures"]

log = logging.getLogger("ckpt_lesson.runs.async_save")

# Keyed by the writer thread (one per save): unique while it is referenced, and held only here.
_unreported: dict[threading.Thread, str] = {}
_guard = threading.Lock()


def note_failure(step: int | None, error: BaseException) -> None:
    """Remember that the save of ``step`` failed on this (writer) thread, until it is reported.

    Example:
        >>> note_failure(240, OSError(28, "No space left on device"))  # doctest: +SKIP
    """
    line = f"asynchronous save of step {step} failed: {type(error).__name__}: {error}"
    with _guard:
        _unreported[threading.current_thread()] = line


def forget_failure(thread: threading.Thread | None) -> None:
    """The failure of ``thread``'s save was raised on the training thread: nothing left to report.

    Example:
        >>> forget_failure(writer_thread)  # doctest: +SKIP
    """
    with _guard:
        _unreported.pop(thread, None)  # type: ignore[arg-type]


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
