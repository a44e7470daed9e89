"""Grader for lesson 04's exercise: shard files, then a hashed ``index.json``, last and atomically.

``check_write_shards(write_shards)`` runs the learner's function on real files
with ``os.fsync``, ``os.replace`` and ``os.rename`` watched (as lesson 02's
grader does), and judges what a reader would find:

* a save reads back bit for bit through :func:`~ckpt_lesson.course.shard_files.read_shards`,
  which checks every file's size and sha256 against the index;
* at the instant ``index.json`` is renamed into place, every shard is already
  complete and fsynced, and so is the index's temp file (in the same
  directory); the directory is fsynced after the rename;
* a real fault: with a directory standing where the last shard should go, the
  save must fail and leave no ``index.json``, so the directory reads as an
  unfinished save instead of a finished one with a file missing;
* a byte flipped in a shard after the save makes the checkpoint unloadable.
"""

from __future__ import annotations

import copy
import hashlib
import os
import stat
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ckpt_lesson.course.grading import GradeResult, _Case, _clip, _grade
from ckpt_lesson.course.shard_files import INDEX_NAME, read_shards
from ckpt_lesson.errors import CheckpointError, CorruptCheckpointError, IncompleteCheckpointError

__all__ = ["check_write_shards"]


def _shards(sizes: list[int]) -> dict[str, dict[str, torch.Tensor]]:
    out = {}
    for i, n in enumerate(sizes):
        out[f"model.shard-{i:03d}.pt"] = {
            f"{2 * i}.weight": torch.arange(n, dtype=torch.float32).reshape(-1, 1) / (i + 1),
            f"{2 * i}.bias": torch.full((3,), float(i), dtype=torch.float64),
        }
    return out


def _file_state(path: Path) -> tuple[int, int, str] | None:
    """``(inode, size, sha256)`` of a regular file, or None when there is none."""
    try:
        st = os.lstat(path)
        if not stat.S_ISREG(st.st_mode):
            return None
        return st.st_ino, st.st_size, hashlib.sha256(path.read_bytes()).hexdigest()
    except OSError:
        return None


class _Watch:
    """Record fsyncs (by inode) and, at the rename onto ``index.json``, what the shards looked like."""

    def __init__(self, directory: Path, names: list[str]) -> None:
        self.directory, self.names = directory, names
        self.fsynced: list[tuple[str, int]] = []  # ("file" | "dir", inode), in order
        self.commit: dict[str, Any] | None = None
        self.index_writes: list[str] = []

    def __enter__(self) -> _Watch:
        self.real = (os.fsync, os.fdatasync, os.replace, os.rename)
        real_fsync, real_fdatasync, real_replace, real_rename = self.real

        def watched_sync(real: Callable[[Any], None]) -> Callable[[Any], None]:
            def sync(fd: Any) -> None:
                st = os.fstat(fd if isinstance(fd, int) else fd.fileno())
                self.fsynced.append(("dir" if stat.S_ISDIR(st.st_mode) else "file", st.st_ino))
                real(fd)

            return sync

        def watched_move(real: Callable[..., None]) -> Callable[..., None]:
            def move(src: Any, dst: Any, *args: Any, **kwargs: Any) -> None:
                if os.path.abspath(os.fspath(dst)) == os.path.abspath(self.directory / INDEX_NAME):
                    self._at_commit(Path(os.path.abspath(os.fspath(src))))
                real(src, dst, *args, **kwargs)

            return move

        os.fsync, os.fdatasync = watched_sync(real_fsync), watched_sync(real_fdatasync)
        os.replace, os.rename = watched_move(real_replace), watched_move(real_rename)
        return self

    def __exit__(self, *exc: object) -> None:
        os.fsync, os.fdatasync, os.replace, os.rename = self.real

    def _at_commit(self, src: Path) -> None:
        if self.commit is None:
            self.commit = {
                "src": src,
                "src_inode": (_file_state(src) or (None,))[0],
                "shards": {name: _file_state(self.directory / name) for name in self.names},
                "synced_before": list(self.fsynced),
            }


def check_write_shards(fn: Callable[..., Any], *, verbose: bool = True) -> GradeResult:
    """Grade a ``write_shards(shards, directory)`` (see the module docstring for the cases).

    Args:
        fn: The learner's function: ``shards`` maps file names to dicts of tensors.
        verbose: Print the verdict line.

    Returns:
        The :class:`GradeResult`.

    Example:
        >>> from ckpt_lesson.course.solutions import write_shards
        >>> check_write_shards(write_shards, verbose=False).passed
        True
    """
    with tempfile.TemporaryDirectory(prefix="ckpt-lesson-grader-") as tmp:
        root = Path(tmp)
        cases = [
            _save_case(root / "three", _shards([8, 40, 2]), "three shards into a new directory"),
            _save_case(root / "one", _shards([5]), "one shard"),
            _fault_case(root / "fault", _shards([6, 7, 9])),
            _tamper_case(root / "tamper", _shards([64, 4])),
        ]
        scrub = lambda text: text.replace(tmp + os.sep, "").replace(tmp, "<tmp>")  # noqa: E731
        return _grade("check_write_shards", "write_shards", fn, cases, verbose, scrub)


def _same(got: dict[str, Any], want: dict[str, dict[str, torch.Tensor]]) -> str | None:
    if sorted(got) != sorted(want):
        return f"index.json lists {sorted(got)}, expected {sorted(want)}"
    for name, tensors in want.items():
        have = got[name]
        if sorted(have) != sorted(tensors):
            return f"{name} holds keys {sorted(have)}, expected {sorted(tensors)}"
        for key, t in tensors.items():
            if have[key].dtype != t.dtype or not torch.equal(have[key], t):
                return f"{name}[{key!r}] does not load back bit for bit"
    return None


def _save_case(directory: Path, shards: dict[str, dict[str, torch.Tensor]], label: str) -> _Case:
    original = copy.deepcopy(shards)
    names = list(shards)

    def call(f: Callable[..., Any]) -> Any:
        with _Watch(directory, names) as watch:
            f(shards, directory)
        return watch

    def judge(watch: _Watch) -> str | None:
        if _same(shards, original) is not None:
            return "changed the shards it was given"
        if not (directory / INDEX_NAME).is_file():
            return f"no {INDEX_NAME} in the directory after write_shards returned"
        try:
            problem = _same(read_shards(directory), original)
        except CheckpointError as exc:
            return f"the reader refuses the save: {_clip(str(exc), 220)}"
        if problem is not None:
            return problem
        left = sorted(p.name for p in directory.iterdir() if p.name not in {*names, INDEX_NAME})
        if left:
            return f"left {left} in the directory after a successful save"
        commit = watch.commit
        if commit is None:
            return (
                f"never renamed a temp file onto {INDEX_NAME}: write it beside, fsync it, then os.replace it "
                "(a crash mid-write would leave half an index)"
            )
        if commit["src"].parent != Path(os.path.abspath(directory)):
            return f"renamed {commit['src']} onto {INDEX_NAME}; write the temp file in the same directory"
        final = {name: _file_state(directory / name) for name in names}
        for name in names:
            if commit["shards"][name] != final[name]:
                return (
                    f"{INDEX_NAME} appeared before {name} was complete: a crash at that moment leaves an "
                    "index naming a file that is not all there (write every shard first)"
                )
        synced = {inode for kind, inode in commit["synced_before"] if kind == "file"}
        for name in names:
            if final[name] is not None and final[name][0] not in synced:
                return (
                    f"{name} was not fsynced before {INDEX_NAME} was renamed into place: after a power loss "
                    "the index could name bytes that never reached the disk"
                )
        if commit["src_inode"] not in synced:
            return f"the temp file of {INDEX_NAME} was not fsynced before the rename"
        dir_inode = os.stat(directory).st_ino
        after = watch.fsynced[len(commit["synced_before"]) :]
        if ("dir", dir_inode) not in after:
            return (
                f"did not fsync the directory after the rename: {INDEX_NAME} itself may vanish on power loss"
            )
        return None

    describe = f"[{label}, fsync and renames watched] write_shards(shards, '{directory.name}')"
    return _Case(describe, call, judge)


def _fault_case(directory: Path, shards: dict[str, dict[str, torch.Tensor]]) -> _Case:
    last = list(shards)[-1]

    def call(f: Callable[..., Any]) -> Any:
        (directory / last).mkdir(parents=True)  # the disk refuses this one name: a real OSError
        try:
            f(shards, directory)
        except NotImplementedError:
            raise
        except Exception as exc:  # expected: the save cannot finish
            return type(exc).__name__
        return None

    def judge(raised: str | None) -> str | None:
        if (directory / INDEX_NAME).exists():
            return (
                f"{INDEX_NAME} exists although {last} was never written: a reader takes the unfinished save "
                "for a finished one (write the index last, only after every shard succeeded)"
            )
        if raised is None:
            return f"returned normally although {last} could not be written: let the error reach the caller"
        try:
            read_shards(directory)
        except IncompleteCheckpointError:
            return None
        except CheckpointError as exc:
            return f"the reader should find an unfinished save, but says: {_clip(str(exc), 160)}"
        return "the reader loads a save whose last shard was never written"

    return _Case(
        f"[the disk refuses the last shard: a directory stands at {last}] write_shards(shards, 'fault')",
        call,
        judge,
    )


def _tamper_case(directory: Path, shards: dict[str, dict[str, torch.Tensor]]) -> _Case:
    def call(f: Callable[..., Any]) -> Any:
        f(shards, directory)
        target = directory / list(shards)[0]
        data = bytearray(target.read_bytes())
        data[len(data) // 2] ^= 0x01  # one bit, in the middle of the file
        target.write_bytes(bytes(data))
        try:
            read_shards(directory)
        except CorruptCheckpointError:
            return None
        except CheckpointError as exc:
            return f"refused, but not as damage: {_clip(str(exc), 160)}"
        return f"a flipped bit in {target.name} still loads: record the sha256 of the exact bytes written"

    return _Case(
        "[one bit of a shard flipped after the save] write_shards(shards, 'tamper'), then read it back",
        call,
        lambda problem: problem,
    )
