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
kill. Cost matters too: the tool must not take a core from the run it is
testing. On Linux the watcher sleeps on ``inotify`` (see :mod:`inotify`),
wakes the moment an entry changes, and updates only the entries the kernel
named, so a quiet folder of 10,000 files costs nothing between saves.
Elsewhere it walks the folder, but never for more than a fixed share of the
time. A folder beyond :data:`MAX_ENTRIES` entries or the watch limit is
watched in part, and the report says so (:attr:`FolderWatcher.warning`).

In a plain folder, only files that are the checkpoint count as a save (see
:mod:`names`: ``--ckpt-glob``, or names that look like checkpoints).
"""

from __future__ import annotations

import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ckpt_lesson.resume_test.inotify import POLL_SECONDS, Waker
from ckpt_lesson.resume_test.names import NameFilter

__all__ = ["FILES", "MANAGER", "NONE", "FolderEvent", "FolderWatcher", "SaveBurst", "Snapshot", "Waker"]

#: What a checkpoint folder turned out to be.
MANAGER, FILES, NONE = "manager", "files", "none"

# The manager's on-disk names (see ckpt_lesson.runs.commit): published saves and saves in progress.
_STEP_DIR = re.compile(r"^step-(\d{8,})$")
_STAGING_DIR = re.compile(r"^\.staging-step-(\d{8,})-")
#: A generic folder's entries kept at most (files and folders); beyond, a warning.
MAX_ENTRIES = 50_000
#: Without inotify, a walk of the folder may take at most this share of the time.
POLL_SHARE = 0.2


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


class FolderWatcher:
    """Report saves starting, being published, and files changing in one checkpoint folder.

    Args:
        root: The checkpoint folder (it may not exist yet).
        layout: What an earlier run showed the folder to be (:data:`MANAGER`,
            :data:`FILES` or :data:`NONE`); with ``MANAGER`` only the
            manager's folders count, so a log file the script keeps beside
            them is not mistaken for a save.
        waker: Told to watch the folders seen; with inotify, it also says what changed, and
            only that is looked at again.
        names: Which files of a plain folder are the checkpoint (``--ckpt-glob``, or by name).

    Example:
        >>> watcher = FolderWatcher(Path("ckpt"))  # doctest: +SKIP
        >>> watcher.poll()  # doctest: +SKIP
        [FolderEvent(kind='staging', name='.staging-step-00000010-4242-0f3a9c1e', step=10)]
    """

    def __init__(
        self, root: Path, *, layout: str = NONE, waker: Waker | None = None, names: NameFilter | None = None
    ) -> None:
        self.root = Path(root)
        self.waker = waker
        self.layout = layout
        self.names = names if names is not None else NameFilter()
        #: Why part of the folder may go unwatched (too many entries or folders), else ``None``.
        self.warning: str | None = None
        self._names: set[str] = set()
        self._files: Snapshot = {}
        #: The snapshot before the last poll's (what a save that just began changed from).
        self.previous: Snapshot = {}
        self._next_walk = 0.0
        self._root_watched = False
        # What is there already (a restart finds the saves of the processes before it) is the
        # starting point, not news.
        self._names, self._files = self._take()
        self.names.see(list(self._files))
        if any(_is_manager_name(n) for n in self._names):
            self.layout = MANAGER
        elif self._files and self.layout == NONE:
            self.layout = FILES

    def _incremental(self) -> bool:
        # Only inotify that watches every folder, the root included, can say "nothing else changed".
        w = self.waker
        return w is not None and w.uses_inotify and not w.capped and self._root_watched

    def _take(self) -> tuple[set[str], Snapshot]:
        names: set[str] = set()
        files: Snapshot = {}
        if self.waker is not None and self.root.is_dir():
            # Before the listing: a change after it is not missed.
            self._root_watched = self.waker.watch(self.root)
        try:
            top = list(os.scandir(self.root))
        except (FileNotFoundError, NotADirectoryError):
            return names, files
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
                self._warn(f"more than {MAX_ENTRIES} entries")
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

    def _warn(self, what: str) -> None:
        if self.warning is None:
            self.warning = (
                f"the checkpoint folder {self.root} holds {what}: the watcher saw only part of it, so "
                "kills may miss saves; name the checkpoint with --ckpt-glob and keep other files elsewhere"
            )

    def _update(self, changed: set[str]) -> tuple[set[str], Snapshot, set[str]]:
        """The snapshot after the changes inotify named, and the entries that may differ.

        Each named path is looked at again, nothing else: the cost follows the changes, not the
        folder's size (a dict copy aside, which is memcpy-fast).
        """
        names, files = set(self._names), dict(self._files)
        touched: set[str] = set()
        root = str(self.root)
        for path in sorted(changed):
            rel = os.path.relpath(path, root).replace(os.sep, "/")
            if rel == ".":
                continue
            touched |= {rel, rel + "/"}
            try:
                st = os.lstat(path)
            except OSError:  # gone (deleted, or renamed away): it and everything under it
                names.discard(rel)
                files.pop(rel, None)
                if rel + "/" in files:
                    under = [k for k in files if k.startswith(rel + "/")]
                    touched.update(under)
                    for key in under:
                        del files[key]
                continue
            if "/" not in rel:
                names.add(rel)
            if self.layout == MANAGER or any(_is_manager_name(n) for n in names):
                continue
            if os.path.isdir(path) and not os.path.islink(path):
                if rel + "/" not in files:  # a new folder: watch it, and take what is already in it
                    files[rel + "/"] = (0, 0, 0)
                    if self.waker is not None:
                        self.waker.watch(path)
                    inside: Snapshot = {}
                    self._walk(Path(path), rel + "/", inside)
                    files.update(inside)
                    touched.update(inside)
            elif rel in files or len(files) < MAX_ENTRIES:
                files[rel] = (st.st_size, st.st_mtime_ns, st.st_ino)
            else:
                self._warn(f"more than {MAX_ENTRIES} entries")
        return names, files, touched

    def _snapshot(self) -> tuple[set[str], Snapshot, set[str] | None] | None:
        """The folder now and the entries that may differ (``None``: any), or ``None`` if nothing can have."""
        waker = self.waker
        if waker is not None and self._incremental():
            # Read what the kernel has queued up to now: a snapshot that lagged behind would let a
            # step report read just after it overtake the end of a save (a save dated one step late).
            waker.wait(0.0)
            changed = waker.take_changed(str(self.root))
            if changed is None:  # the kernel dropped events: look at everything once
                return (*self._take(), None)
            if not changed:
                return None
            return self._update(changed)
        if waker is not None and waker.capped:
            self._warn("more folders than can be watched")
        # Polling: walk, but keep the walks to a share of the time (a big folder is walked less often).
        # Without a waker the caller sets the pace: every poll walks.
        now = time.monotonic()
        if waker is not None and now < self._next_walk:
            return None
        taken = self._take()
        spent = time.monotonic() - now
        self._next_walk = now + max(POLL_SECONDS, spent / POLL_SHARE)
        return (*taken, None)

    def poll(self) -> list[FolderEvent]:
        """Changes since the last call (or since the watcher was made)."""
        taken = self._snapshot()
        if taken is None:
            self.previous = self._files
            return []
        names, files, touched = taken
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
            keys = files.keys() | self._files.keys() if touched is None else touched
            changed = {k for k in keys if files.get(k) != self._files.get(k)}
            events = [FolderEvent("activity", name) for name in sorted(self.names.select(changed))]
            if files and self.layout == NONE:
                self.layout = FILES
        self.previous = self._files
        self._names, self._files = names, files
        return events

    def files(self) -> Snapshot:
        """The last snapshot of a generic folder: path -> (size, mtime_ns, inode); folders end in ``/``."""
        return dict(self._files)

    def checkpoint_files(self) -> list[str]:
        """Files of the last snapshot that count as the checkpoint (all files while no name filter is on)."""
        return [
            n
            for n in self._files
            if not n.endswith("/") and (not self.names.active or self.names.is_checkpoint(n))
        ]

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
