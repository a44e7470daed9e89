"""Leaving nothing running: every process a command starts is found, ended and counted.

``resume-test`` starts each run of the command in a new session, so a kill
reaches its whole process group. That is not every process: a helper started
with ``setsid`` (a data server, a monitoring agent, a detached logger) leaves
the group and would outlive the run, holding the GPU, the port or the file
lock the next run needs. On Linux two things close that gap:

* the tool makes itself a *child subreaper* (``prctl(PR_SET_CHILD_SUBREAPER)``):
  a process whose parent dies is handed to the tool instead of to init, so
  orphans stay in its tree and are reaped by it;
* each run's environment carries a token, ``$CKPT_LESSON_ATTEMPT``, which every
  descendant inherits (a process that left the group keeps its environment):
  scanning ``/proc/*/environ`` for it finds them all, whichever session they
  are in, and only them (two tests running side by side in one process have
  different tokens).

Elsewhere (no ``/proc``) only the process group is reached.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

__all__ = [
    "ATTEMPT_ENV", "Stopped", "become_subreaper", "end_tagged", "new_token", "stop_later", "tagged_processes",
]  # fmt: skip

#: The environment variable that marks every process of one run of the command.
ATTEMPT_ENV = "CKPT_LESSON_ATTEMPT"
_PR_SET_CHILD_SUBREAPER = 36


def new_token() -> str:
    """A fresh token for one run of the command."""
    return uuid.uuid4().hex


def become_subreaper() -> bool:
    """Make this process the reaper of its orphaned descendants (Linux); ``False`` where it cannot.

    Example:
        >>> become_subreaper() in (True, False)
        True
    """
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _stat(pid: int) -> tuple[str, int] | None:
    """(state letter, process group) of ``pid``, or ``None`` when it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            text = f.read().decode("ascii", errors="replace")
    except OSError:
        return None
    # The command name (field 2) may hold spaces and parentheses: fields resume after the last ')'.
    fields = text[text.rfind(")") + 2 :].split()
    try:
        return fields[0], int(fields[2])
    except (IndexError, ValueError):
        return None


def tagged_processes(token: str) -> dict[int, int]:
    """Live processes whose environment holds ``$CKPT_LESSON_ATTEMPT=token``: pid -> process group.

    Zombies (dead, not yet reaped) are left out: they run nothing. Returns ``{}`` without ``/proc``.

    Example:
        >>> tagged_processes(new_token())
        {}
    """
    marker = f"{ATTEMPT_ENV}={token}".encode()
    found: dict[int, int] = {}
    try:
        names = os.listdir("/proc")
    except OSError:
        return found
    me = os.getpid()
    for name in names:
        if not name.isdigit() or int(name) == me:
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as f:
                env = f.read()
        except OSError:  # gone, or not ours to read: not one of the command's processes
            continue
        if marker not in env.split(b"\0"):
            continue
        stat = _stat(int(name))
        if stat is not None and stat[0] not in "ZX":
            found[int(name)] = stat[1]
    return found


def _reap(pids: set[int]) -> None:
    # Children of this process (directly, or handed over as orphans to the subreaper) stay zombies
    # until waited for; others are their own parents' business.
    for pid in pids:
        try:
            os.waitpid(pid, os.WNOHANG)
        except (ChildProcessError, OSError):
            pass


def end_tagged(token: str, *, spare_group: int | None = None, rounds: int = 20) -> list[int]:
    """SIGKILL every live process of one run; returns the pids that were still running.

    Args:
        token: The run's ``$CKPT_LESSON_ATTEMPT``.
        spare_group: A process group that was already sent SIGKILL (the run's own, after a
            planned kill): its members are dying, not "left running", so they are not counted
            (they are still killed again and reaped).
        rounds: Scans at most; a process that forks while being killed is caught by the next one.

    Example:
        >>> end_tagged(new_token())
        []
    """
    left: set[int] = set()
    seen: set[int] = set()
    for _ in range(rounds):
        found = tagged_processes(token)
        if not found:
            break
        for pid, group in found.items():
            if pid not in seen and group != spare_group:
                left.add(pid)
            seen.add(pid)
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        time.sleep(0.01)
        _reap(seen)
    _reap(seen)
    return sorted(left)


class Stopped(BaseException):
    """The tool itself got SIGTERM, SIGHUP or SIGINT: unwind, ending the run in progress.

    A ``BaseException`` like ``KeyboardInterrupt``: no ``except Exception`` on the way may swallow it.

    Attributes:
        signum: The signal.
        attempt: The run of the command that was in progress (set on the way out), if any.
    """

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum
        self.attempt: object | None = None


#: Signals that arrived while cleanup must not be cut short (see :func:`stop_later`).
_deferred: dict[str, Any] = {"depth": 0, "signum": None}


def stop_now_or_later(signum: int) -> None:
    """Raise :class:`Stopped` now, or when the :func:`stop_later` block around us ends (signal handlers)."""
    if _deferred["depth"]:
        _deferred["signum"] = signum
        return
    raise Stopped(signum)


@contextmanager
def stop_later() -> Iterator[None]:
    """A block a stop signal does not interrupt: a run's cleanup (killing what it left) finishes first.

    Example:
        >>> with stop_later():
        ...     pass
    """
    _deferred["depth"] += 1
    try:
        yield
    finally:
        _deferred["depth"] -= 1
        signum = _deferred["signum"]
        if not _deferred["depth"] and signum is not None:
            _deferred["signum"] = None
            raise Stopped(signum)
