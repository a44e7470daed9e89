"""Finding every process a command started, including those that left its process group.

``resume-test`` starts the command in a session of its own and kills that
session's process group, which is how a crash takes a whole job down. Some
launchers move their children out of it: torchrun starts each worker with
``start_new_session=True``, so a group kill stops torchrun and leaves the
workers training (and saving) as orphans, while the next attempt starts.
A machine that dies takes those too; so the tool finds the command's
descendants by walking ``/proc`` (before the signal orphans them) and
signals the ones outside the group directly.

Timing matters (a kill aimed at the middle of a save has milliseconds), so
:class:`ProcessTree` walks ``/proc`` in the quiet moments between polls, at
most every quarter second, and at the kill only signals the processes it
already knows: those are torchrun's workers, started once, at launch.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path

__all__ = ["ProcessTree", "descendants"]


def _stat_fields(proc_root: Path, pid: int) -> list[str] | None:
    try:
        stat = (proc_root / str(pid) / "stat").read_text()
    except OSError:  # it exited while we looked
        return None
    # "pid (comm) state ppid ...": comm may hold spaces and parentheses, so split after the last ')'.
    # fields[0] is field 3 of proc(5) (state), fields[1] the ppid, fields[19] the start time.
    return stat.rsplit(")", 1)[-1].split()


def _parents(proc_root: Path) -> dict[int, int]:
    out = {}
    for entry in proc_root.iterdir():
        if not entry.name.isdigit():
            continue
        fields = _stat_fields(proc_root, int(entry.name))
        if fields and len(fields) > 1 and fields[1].isdigit():
            out[int(entry.name)] = int(fields[1])
    return out


def descendants(pid: int, *, proc_root: Path = Path("/proc")) -> list[int]:
    """Every live descendant of ``pid`` (children, grandchildren, ...); ``[]`` where /proc is absent.

    Args:
        pid: The ancestor.
        proc_root: The proc file system (a parameter for tests).

    Returns:
        The descendants' pids, parents before their children.

    Example:
        >>> descendants(os.getpid()) == [] or True
        True
    """
    if not proc_root.is_dir():
        return []
    children: dict[int, list[int]] = {}
    for child, parent in _parents(proc_root).items():
        children.setdefault(parent, []).append(child)
    out, todo = [], list(children.get(pid, []))
    while todo:
        p = todo.pop(0)
        out.append(p)
        todo.extend(children.get(p, []))
    return out


class ProcessTree:
    """A command's descendants outside its process group, known ahead of the moment to signal them.

    Args:
        pid: The command's pid, also its process group (it leads its own session).
        every: Walk ``/proc`` at most this often, in seconds.
        clock: The time source (a parameter for tests).
        proc_root: The proc file system.

    Example:
        >>> tree = ProcessTree(proc.pid)  # doctest: +SKIP
        >>> tree.refresh()  # each poll; cheap between walks  # doctest: +SKIP
        >>> os.killpg(proc.pid, signal.SIGKILL); tree.signal(signal.SIGKILL)  # doctest: +SKIP
    """

    def __init__(
        self,
        pid: int,
        *,
        every: float = 0.25,
        clock: Callable[[], float] = time.monotonic,
        proc_root: Path = Path("/proc"),
    ) -> None:
        self.pid, self.every, self.clock, self.proc_root = pid, every, clock, proc_root
        self._next = float("-inf")
        #: pid -> its start time; the start time tells a known process from a later one given its pid.
        self.known: dict[int, str] = {}

    def _start(self, pid: int) -> str | None:
        fields = _stat_fields(self.proc_root, pid)
        return fields[19] if fields and len(fields) > 19 else None

    def refresh(self, *, now: bool = False) -> None:
        """Walk ``/proc`` again if ``every`` seconds have passed since the last walk (or ``now``)."""
        clock = self.clock()
        if clock < self._next and not now:
            return
        self._next = clock + self.every
        known = {}
        for p in descendants(self.pid, proc_root=self.proc_root):
            try:
                outside = os.getpgid(p) != self.pid
            except (ProcessLookupError, PermissionError):
                continue
            start = self._start(p)
            if outside and start is not None:
                known[p] = start
        self.known = known

    def signal(self, sig: int) -> list[int]:
        """Send ``sig`` to the known processes that are still the same processes; returns their pids."""
        sent = []
        for p, start in self.known.items():
            if self._start(p) != start:
                continue
            try:
                os.kill(p, sig)
            except (ProcessLookupError, PermissionError):
                continue
            sent.append(p)
        return sent
