"""Watching a checkpoint folder to know when a save starts and when it is published.

``resume-test`` kills a training process at the moments that matter: right
after a save becomes visible, and in the middle of one. It learns those
moments from the checkpoint folder alone, without any help from the script:

* a :class:`~ckpt_lesson.CheckpointManager` run directory is understood
  exactly: a ``.staging-step-XXXXXXXX-...`` folder appearing means a save of
  that step has begun; a ``step-XXXXXXXX`` folder appearing means it was
  published (one atomic rename, so it is complete the instant it exists);
* any other folder is compared snapshot to snapshot: a file that appears,
  grows, changes or disappears is a save at work (``"activity"``).

Reaction time matters: a small checkpoint is written in a few milliseconds,
and a kill meant for "the middle of a save" that lands after it is just a
kill. On Linux the watcher sleeps on ``inotify`` and wakes the moment a file
in the folder changes; elsewhere it polls every two milliseconds.
"""

from __future__ import annotations

import ctypes
import os
import re
import select
import struct
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["FILES", "MANAGER", "NONE", "FolderEvent", "FolderWatcher", "SaveBurst", "Snapshot", "Waker"]

#: What a checkpoint folder turned out to be.
MANAGER, FILES, NONE = "manager", "files", "none"

# The manager's on-disk names (see ckpt_lesson.runs.commit): published saves and saves in progress.
_STEP_DIR = re.compile(r"^step-(\d{8,})$")
_STAGING_DIR = re.compile(r"^\.staging-step-(\d{8,})-")
#: A generic folder is walked at most this deep and this wide per snapshot (it is taken every few ms).
MAX_ENTRIES = 5000
POLL_SECONDS = 0.002

# inotify(7) event bits: anything that creates, writes, renames or removes an entry.
_IN_MODIFY, _IN_ATTRIB, _IN_CLOSE_WRITE = 0x2, 0x4, 0x8
_IN_MOVED_FROM, _IN_MOVED_TO, _IN_CREATE, _IN_DELETE = 0x40, 0x80, 0x100, 0x200
_EVENT = struct.Struct("iIII")
_MASK = _IN_MODIFY | _IN_ATTRIB | _IN_CLOSE_WRITE | _IN_MOVED_FROM | _IN_MOVED_TO | _IN_CREATE | _IN_DELETE


#: A generic folder's state: relative path -> (size, mtime_ns, inode). The inode tells a file
#: rewritten in place (same inode: a kill can cut it short) from one replaced by a rename (new inode).
Snapshot = dict[str, tuple[int, int, int]]


@dataclass(frozen=True)
class FolderEvent:
    """One change seen in a checkpoint folder.

    Attributes:
        kind: ``"staging"`` (a manager save began), ``"published"`` (a manager
            save's ``step-`` folder appeared) or ``"activity"`` (a file in a
            generic folder appeared, changed or vanished).
        name: The entry's path relative to the folder.
        step: The step in the manager folder's name; ``None`` for activity.
    """

    kind: str
    name: str
    step: int | None = None


class Waker:
    """Sleep until a watched folder changes or a timeout passes (inotify on Linux, else polling).

    Example:
        >>> waker = Waker()
        >>> waker.watch(".")
        >>> waker.wait(0.001)
        >>> waker.close()
    """

    def __init__(self) -> None:
        self._fd: int | None = None
        self._watched: dict[int, str] = {}  # watch descriptor -> folder
        self._moved_in: set[str] = set()
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            fd = libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
            self._add = libc.inotify_add_watch
            self._add.argtypes = (ctypes.c_int, ctypes.c_char_p, ctypes.c_uint32)
        except (OSError, AttributeError):  # not Linux, or no inotify: fall back to polling
            return
        if fd >= 0:
            self._fd = fd

    @property
    def uses_inotify(self) -> bool:
        return self._fd is not None

    def watch(self, folder: str | os.PathLike[str]) -> None:
        """Also wake when an entry of ``folder`` (not its subfolders) changes."""
        key = os.fspath(folder)
        if self._fd is None or key in self._watched.values() or len(self._watched) >= 256:
            return
        wd = self._add(self._fd, os.fsencode(key), _MASK)
        if wd >= 0:
            self._watched[wd] = key

    def wait(self, timeout: float) -> None:
        """Return after ``timeout`` seconds, or as soon as a watched folder changes."""
        timeout = max(0.0, timeout)
        if self._fd is None:
            time.sleep(min(timeout, POLL_SECONDS))
            return
        ready, _, _ = select.select([self._fd], [], [], timeout)
        if ready:
            try:
                while data := os.read(self._fd, 65536):
                    self._read_events(data)
            except BlockingIOError:  # drained
                pass

    def _read_events(self, data: bytes) -> None:
        # struct inotify_event: int wd; uint32 mask, cookie, len; char name[len] (NUL-padded).
        offset = 0
        while offset + _EVENT.size <= len(data):
            wd, mask, _, length = _EVENT.unpack_from(data, offset)
            name = data[offset + _EVENT.size : offset + _EVENT.size + length].rstrip(b"\0")
            offset += _EVENT.size + length
            if mask & _IN_MOVED_TO and wd in self._watched and name:
                self._moved_in.add(os.path.join(self._watched[wd], os.fsdecode(name)))

    def take_moved_in(self) -> set[str]:
        """Paths that were renamed into place since the last call (inotify only; else empty).

        A file that arrives by rename arrives whole: it is how an atomic save publishes.
        """
        moved, self._moved_in = self._moved_in, set()
        return moved

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


class FolderWatcher:
    """Report saves starting, being published, and files changing in one checkpoint folder.

    Args:
        root: The checkpoint folder (it may not exist yet).
        layout: What an earlier run showed the folder to be (:data:`MANAGER`,
            :data:`FILES` or :data:`NONE`); with ``MANAGER`` only the
            manager's folders count, so a log file the script keeps beside
            them is not mistaken for a save.
        waker: Told to watch the folders seen, so that a wait ends on a change.

    Example:
        >>> watcher = FolderWatcher(Path("ckpt"))  # doctest: +SKIP
        >>> watcher.poll()  # doctest: +SKIP
        [FolderEvent(kind='staging', name='.staging-step-00000010-4242-0f3a9c1e', step=10)]
    """

    def __init__(self, root: Path, *, layout: str = NONE, waker: Waker | None = None) -> None:
        self.root = Path(root)
        self.waker = waker
        self.layout = layout
        self._names: set[str] = set()
        self._files: Snapshot = {}
        #: The snapshot before the last poll's (what a save that just began changed from).
        self.previous: Snapshot = {}
        # What is there already (a restart finds the saves of the processes before it) is the
        # starting point, not news.
        self._names, self._files = self._take()
        if any(_is_manager_name(n) for n in self._names):
            self.layout = MANAGER
        elif self._files and self.layout == NONE:
            self.layout = FILES

    def _take(self) -> tuple[set[str], Snapshot]:
        names: set[str] = set()
        files: Snapshot = {}
        try:
            top = list(os.scandir(self.root))
        except (FileNotFoundError, NotADirectoryError):
            return names, files
        if self.waker is not None:
            self.waker.watch(self.root)
        for entry in top:
            names.add(entry.name)
        if self.layout != MANAGER and not any(_is_manager_name(n) for n in names):
            # Walk the very listing the names came from: a second listing of the top folder could
            # already hold a staging folder the first did not, and its files would then look like a
            # generic save starting (seen in CI as the step-4 save reported twice).
            self._walk(self.root, "", files, top)
        return names, files

    def _walk(self, folder: Path, prefix: str, files: Snapshot, entries: list[Any] | None = None) -> None:
        if entries is None:
            try:
                entries = list(os.scandir(folder))
            except OSError:  # vanished between listing and reading: the next snapshot sees why
                return
        for entry in entries:
            if len(files) >= MAX_ENTRIES:
                return
            rel = prefix + entry.name
            try:
                if entry.is_dir(follow_symlinks=False):
                    files[rel + "/"] = (0, 0, 0)
                    if self.waker is not None:
                        self.waker.watch(entry.path)
                    self._walk(Path(entry.path), rel + "/", files)
                else:
                    st = entry.stat(follow_symlinks=False)
                    files[rel] = (st.st_size, st.st_mtime_ns, st.st_ino)
            except OSError:
                continue

    def poll(self) -> list[FolderEvent]:
        """Changes since the last call (or since the watcher was made)."""
        names, files = self._take()
        events: list[FolderEvent] = []
        for name in sorted(names - self._names):
            staged, published = _STAGING_DIR.match(name), _STEP_DIR.match(name)
            if staged:
                events.append(FolderEvent("staging", name, int(staged.group(1))))
            elif published:
                events.append(FolderEvent("published", name, int(published.group(1))))
        if events:
            self.layout = MANAGER
        elif self.layout != MANAGER:
            changed = {k for k in files.keys() | self._files.keys() if files.get(k) != self._files.get(k)}
            events = [FolderEvent("activity", name) for name in sorted(changed)]
            if files and self.layout == NONE:
                self.layout = FILES
        self.previous = self._files
        self._names, self._files = names, files
        return events

    def files(self) -> Snapshot:
        """The last snapshot of a generic folder: path -> (size, mtime_ns, inode); folders end in ``/``."""
        return dict(self._files)

    def published_steps(self) -> list[int]:
        """Steps of the ``step-`` folders in the last snapshot (manager layout)."""
        return sorted(int(m.group(1)) for n in self._names if (m := _STEP_DIR.match(n)))

    def staging_present(self) -> bool:
        """Whether the last snapshot holds a manager staging folder (a save in progress or abandoned)."""
        return any(_STAGING_DIR.match(n) for n in self._names)


@dataclass
class SaveBurst:
    """A save at work in a generic folder: the files it touched, and what they were before it.

    It begins with the first change after a step report and ends with the next step report.
    """

    names: set[str] = field(default_factory=set)
    before: Snapshot = field(default_factory=dict)
    renamed: set[str] = field(default_factory=set)  # renamed into place (inotify saw it): whole
    first_name: dict[int, str] = field(default_factory=dict)  # inode -> the name it was first seen under

    def add(self, names: set[str], watcher: FolderWatcher) -> None:
        if not self.names:
            self.before = watcher.previous
        self.names |= names
        for name, (_, _, inode) in watcher.files().items():
            if name in self.names:
                self.first_name.setdefault(inode, name)

    def cut_short(self, now: Snapshot) -> list[tuple[str, int]]:
        """Files this save may have left half-written: (name, size) of each.

        A file that got a new inode at its name was renamed into place (whole, old or new); one
        first seen under another name (``ckpt.pt.tmp``) and renamed is whole too. What is left
        was written in place, and a kill can cut that short.
        """
        out = []
        for name in sorted(self.names):
            if name.endswith("/") or name not in now:
                continue
            size, _, inode = now[name]
            old = self.before.get(name)
            if old is not None and (old == now[name] or old[2] != inode):
                continue
            if name in self.renamed or (old is None and self.first_name.get(inode, name) != name):
                continue
            out.append((name, size))
        return out


def _is_manager_name(name: str) -> bool:
    return bool(_STEP_DIR.match(name) or _STAGING_DIR.match(name))
