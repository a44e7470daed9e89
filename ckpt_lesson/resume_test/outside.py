"""Files a command writes outside the simulated machine, which a real lost machine would not keep.

``--lose-machine`` gives each restart a fresh working folder, ``HOME``,
``TMPDIR`` and caches, all under the tool's workdir, and wipes the local
checkpoint folder. It cannot take away a file written anywhere else (an
absolute path such as ``/data/me/ckpt``): the tool never deletes or moves a
file it did not create. A restart could then resume from that file and look
as if it resumed from the store. So such writes are found and reported, and
the lose-machine verdict cannot be PASS while they exist. Two ways to see them:

* absolute paths among the command's arguments (``/abs``, ``--out=/abs``)
  whose file, or a file under whose folder, changed during the session
  (:func:`written_paths`);
* files held open for writing by the command's processes on a new machine,
  sampled from ``/proc/PID/fd`` (:class:`OpenWrites`); a write that opens and
  closes between two samples is missed, which is why the arguments are read too.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from ckpt_lesson.resume_test.proc_tree import descendants

__all__ = ["OpenWrites", "path_arguments", "written_paths"]

#: Not files a machine image holds: devices, kernel views, sockets' and pipes' pseudo-paths.
_SYSTEM = ("/dev/", "/proc/", "/sys/", "/run/")
#: Most files looked at under one folder argument (a folder like / is not walked whole).
_WALK_LIMIT = 20_000


def _ours(path: str, inside: Path) -> bool:
    """Paths that never count: the tool's workdir (the simulated machine), the system, byte code."""
    return (
        not path.startswith("/")
        or path.startswith(_SYSTEM)
        or "/__pycache__/" in path
        or path == str(inside)
        or path.startswith(str(inside) + os.sep)
    )


def path_arguments(command: tuple[str, ...] | list[str]) -> list[str]:
    """The absolute paths in the arguments, alone or as ``--flag=/path``; the program itself left out.

    Example:
        >>> path_arguments(["python", "train.py", "--out=/data/ckpt", "/tmp/x", "--lr", "1"])
        ['/data/ckpt', '/tmp/x']
    """
    out = []
    for arg in list(command)[1:]:
        value = arg.split("=", 1)[1] if arg.startswith("-") and "=" in arg else arg
        if value.startswith("/"):
            out.append(value)
    return out


def _changed(path: Path, since: float) -> bool:
    try:
        return path.lstat().st_mtime >= since
    except OSError:
        return False


def written_paths(command: tuple[str, ...] | list[str], *, since: float, inside: Path) -> list[str]:
    """Absolute path arguments outside ``inside`` that were written at or after ``since``.

    A file argument counts when its modification time is ``since`` or later; a
    folder when anything under it is (at most 20000 entries looked at; the
    workdir and byte-code folders left out).

    Args:
        command: The command as run (``{run_id}`` filled in, ``{ckpt_dir}`` not).
        since: When the session began (``time.time()`` before the baseline).
        inside: The tool's workdir, where every simulated machine lives.

    Returns:
        The written paths, as given in the arguments, sorted.

    Example:
        >>> written_paths(["python", "t.py", "--out=/data/ckpt"], since=t0, inside=workdir)  # doctest: +SKIP
        ['/data/ckpt']
    """
    found = set()
    inside = inside.resolve()
    for arg in path_arguments(command):
        if "{ckpt_dir}" in arg or _ours(os.path.abspath(arg), inside):
            continue
        path = Path(arg)
        if not path.is_dir() or path.is_symlink():
            if _changed(path, since):
                found.add(arg)
            continue
        # A folder: what is in it (its own time changes whenever anything, even our workdir, is added).
        seen = 0
        for folder, dirs, names in os.walk(path):
            dirs[:] = [d for d in dirs if not _ours(os.path.join(folder, d), inside)]
            entries = [n for n in [*dirs, *names] if not _ours(os.path.join(folder, n), inside)]
            seen += len(entries)
            if any(_changed(Path(folder, n), since) for n in entries):
                found.add(arg)
                break
            if seen > _WALK_LIMIT:
                break
    return sorted(found)


class OpenWrites:
    """Files outside ``inside`` that a process tree holds open for writing, sampled from ``/proc``.

    Args:
        pid: The command's process (its descendants are sampled too).
        inside: The tool's workdir (files there are the simulated machine's own).
        every: Sample at most this often, in seconds.

    Example:
        >>> writes = OpenWrites(proc.pid, workdir)  # doctest: +SKIP
        >>> writes.poll()  # each watch-loop turn; cheap between samples  # doctest: +SKIP
        >>> sorted(writes.found)  # doctest: +SKIP
        ['/data/me/ckpt/last.pt']
    """

    def __init__(self, pid: int, inside: Path, *, every: float = 0.2) -> None:
        self.pid, self.inside, self.every = pid, inside.resolve(), every
        self._next = float("-inf")
        self.found: set[str] = set()

    def poll(self) -> None:
        now = time.monotonic()
        if now < self._next or not Path("/proc").is_dir():
            return
        self._next = now + self.every
        for pid in [self.pid, *descendants(self.pid)]:
            fd_dir = Path("/proc", str(pid), "fd")
            try:
                fds = os.listdir(fd_dir)
            except OSError:  # gone, or not ours to read
                continue
            for fd in fds:
                try:
                    target = os.readlink(fd_dir / fd)
                    if _ours(target, self.inside):
                        continue
                    info = Path("/proc", str(pid), "fdinfo", fd).read_text()
                except OSError:
                    continue
                flags = next((ln.split()[1] for ln in info.splitlines() if ln.startswith("flags:")), "0")
                deleted = target.endswith(" (deleted)")  # a temporary file: nothing to resume from
                if (int(flags, 8) & os.O_ACCMODE) in (os.O_WRONLY, os.O_RDWR) and not deleted:
                    self.found.add(target)
