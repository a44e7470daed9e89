"""Sleeping until a folder changes: inotify where the platform has it, bounded polling elsewhere.

``resume-test`` must react to a save within milliseconds (a small checkpoint
is written in a few), yet cost next to nothing while the script trains. A
loop that re-walks the checkpoint folder every few milliseconds does the
first and fails the second: at a few thousand files it keeps a core busy.
inotify turns it around: the kernel tells us *which* entry changed, the
watcher updates only that entry, and while nothing changes the tool sleeps.

This module is the kernel side (through the maintained ``inotify_simple``
package, a thin ctypes wrapper): a :class:`Waker` that sleeps until a watched
folder changes and remembers what changed. Without inotify (macOS, Windows,
or the package missing) it sleeps in short ticks, and the watcher falls back
to walking the folder, no more often than a fixed share of the time.

A watch costs kernel memory and each user has a limit
(``/proc/sys/fs/inotify/max_user_watches``), so at most :data:`MAX_WATCHES`
folders are watched; beyond that the waker says so (:attr:`Waker.capped`)
and the watcher falls back to polling, with a warning in the report.
"""

from __future__ import annotations

import os
import time

__all__ = ["MAX_WATCHES", "POLL_SECONDS", "Waker"]

#: Folders watched at most (one inotify watch each).
MAX_WATCHES = 1024
#: The sleep of one polling tick where there is no inotify.
POLL_SECONDS = 0.002

try:  # Linux only; the package is in requirements.txt, but the tool must work without it
    from inotify_simple import INotify
    from inotify_simple import flags as _flags

    _MASK = (
        _flags.MODIFY | _flags.ATTRIB | _flags.CLOSE_WRITE | _flags.MOVED_FROM | _flags.MOVED_TO
        | _flags.CREATE | _flags.DELETE | _flags.DELETE_SELF | _flags.MOVE_SELF
    )  # fmt: skip
except (ImportError, OSError, AttributeError):  # pragma: no cover - depends on the platform
    INotify = None  # type: ignore[assignment,misc]


class Waker:
    """Sleep until a watched folder changes or a timeout passes; remember what changed.

    Example:
        >>> waker = Waker()
        >>> waker.watch(".")
        True
        >>> waker.wait(0.001)
        >>> waker.close()
    """

    def __init__(self) -> None:
        self._inotify = None
        self._watched: dict[int, str] = {}  # watch descriptor -> folder
        self._moved_in: set[str] = set()
        self._changed: set[str] = set()
        #: The kernel's event queue overflowed since the last :meth:`take_changed`: changes were lost.
        self.overflowed = False
        #: More folders than :data:`MAX_WATCHES` (or the user's limit) were asked for: some go unwatched.
        self.capped = False
        if INotify is not None:
            try:
                self._inotify = INotify(nonblocking=True)
            except OSError:  # out of inotify instances: poll instead
                self._inotify = None

    @property
    def uses_inotify(self) -> bool:
        return self._inotify is not None

    def watch(self, folder: str | os.PathLike[str]) -> bool:
        """Also wake when an entry of ``folder`` (not its subfolders) changes; ``False`` if not watched."""
        key = os.fspath(folder)
        if self._inotify is None:
            return False
        if key in self._watched.values():
            return True
        if len(self._watched) >= MAX_WATCHES:
            self.capped = True
            return False
        try:
            wd = self._inotify.add_watch(key, _MASK)
        except OSError:  # gone already, or the user's watch limit (ENOSPC): the caller polls
            self.capped = self.capped or os.path.isdir(key)
            return False
        self._watched[wd] = key
        return True

    def wait(self, timeout: float) -> None:
        """Return after ``timeout`` seconds, or as soon as a watched folder changes."""
        timeout = max(0.0, timeout)
        if self._inotify is None:
            time.sleep(min(timeout, POLL_SECONDS))
            return
        # Milliseconds, rounded up: a wait of 0.4 ms must still wait, not spin.
        ms = 0 if timeout <= 0 else max(1, round(timeout * 1000))
        try:
            events = self._inotify.read(timeout=ms)
        except BlockingIOError:  # nothing queued (non-blocking read raced with the poll)
            return
        for event in events:
            if event.mask & _flags.Q_OVERFLOW:
                self.overflowed = True
                continue
            folder = self._watched.get(event.wd)
            if folder is None:
                continue
            path = os.path.join(folder, event.name) if event.name else folder
            self._changed.add(path)
            if event.mask & _flags.MOVED_TO and event.name:
                self._moved_in.add(path)
            if event.mask & _flags.IGNORED:  # the folder is gone: its watch with it
                del self._watched[event.wd]

    def take_changed(self, root: str) -> set[str] | None:
        """Paths under ``root`` (or ``root``) changed since the last call; ``None`` if events were lost."""
        if self.overflowed:
            self.overflowed = False
            self._changed = {p for p in self._changed if not _under(p, root)}
            return None
        mine = {p for p in self._changed if _under(p, root)}
        self._changed -= mine
        return mine

    def take_moved_in(self) -> set[str]:
        """Paths that were renamed into place since the last call (inotify only; else empty).

        A file that arrives by rename arrives whole: it is how an atomic save publishes.
        """
        moved, self._moved_in = self._moved_in, set()
        return moved

    def close(self) -> None:
        if self._inotify is not None:
            self._inotify.close()
            self._inotify = None


def _under(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip(os.sep) + os.sep)
