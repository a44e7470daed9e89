"""Atomic, durable file writes: the old file or the new one, never half of either.

``torch.save(obj, "ckpt.pt")`` truncates the target and then writes into it. A
kill in between leaves a file that exists, has the right name, and does not
load. The sequence below leaves the previous file untouched until the very
last, atomic step:

1. write a *uniquely named* temp file in the *target's own directory*
   (same directory: a rename across file systems is a copy, not atomic, and
   fails with EXDEV; unique name: two writers never share a temp file);
2. flush Python's buffer and ``os.fsync`` the file, so the bytes are on disk
   before any name points at them;
3. ``os.replace(temp, target)``: atomic for every other process;
4. ``os.fsync`` the directory, so the rename itself survives a power loss.

Temp files start with ``.`` and contain ``.tmp-``; nothing in this package ever
mistakes one for a checkpoint, and any failure (``KeyboardInterrupt``
included) removes it.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import stat
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

import torch

from ckpt_lesson.errors import CheckpointError
from ckpt_lesson.files.hashing import DEFAULT_ALGO, digest_bytes, zip_crc32_off
from ckpt_lesson.files.integrity import FileDigest, FooterWriter

__all__ = [
    "TEMP_MARKER",
    "atomic_save",
    "atomic_write_bytes",
    "atomic_write_json",
    "fsync_dir",
    "is_temp_file",
    "make_dirs",
]

#: Every temp file's name contains this marker (and starts with a dot).
TEMP_MARKER = ".tmp-"


def fsync_dir(directory: str | os.PathLike[str]) -> None:
    """Flush a directory's entries (new names, renames, deletions) to disk."""
    fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def make_dirs(directory: str | os.PathLike[str]) -> None:
    """Create ``directory`` and any missing parents, durably.

    ``mkdir`` only changes the parent's entries in memory; like a rename, a new
    directory can vanish on power loss until its parent is fsynced. So each
    directory created here has its parent fsynced, outermost first.

    Raises:
        CheckpointError: Something on the way is a regular file (or otherwise
            not a directory), or the directory cannot be created.

    Example:
        >>> make_dirs(tmp_dir / "runs" / "exp1")  # doctest: +SKIP
    """
    directory = Path(directory)
    missing = [p for p in (directory, *directory.parents) if not p.is_dir()]
    blocked = [p for p in missing if p.exists() or p.is_symlink()]
    if blocked:
        # One line, named: "mkdir: File exists" would not say which part is in the way.
        raise CheckpointError(
            f"{directory}: cannot create the directory because {blocked[-1]} exists and is not a "
            "directory; pick a path whose folders are folders."
        )
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise CheckpointError(f"{directory}: cannot create the directory ({exc.strerror or exc}).") from exc
    for p in reversed(missing):
        fsync_dir(p.parent)


def is_temp_file(path: str | os.PathLike[str]) -> bool:
    """True for the temp files this module writes (never a finished checkpoint)."""
    name = Path(path).name
    return name.startswith(".") and TEMP_MARKER in name


def atomic_save(
    payload: Any, path: str | os.PathLike[str], *, algo: str = DEFAULT_ALGO, zip_crc32: bool = False
) -> FileDigest:
    """``torch.save`` ``payload`` to ``path`` atomically and durably.

    The file also gets an integrity footer (see :mod:`ckpt_lesson.files.integrity`),
    hashed while the bytes are written: the file is never reopened to hash it.

    Args:
        payload: Anything ``torch.save`` accepts; keep it to tensors and plain
            Python values so that a weights-only load can read it back.
        path: The final file name. Missing parent directories are created
            (durably, see :func:`make_dirs`), as the lesson's version does.
        algo: Hash algorithm of the footer and the returned digest.
        zip_crc32: ``True`` keeps the zip CRC32s ``torch.save`` normally
            writes. Off by default: ``torch.load`` never checks them, our
            digest covers the same bytes, and they cost about 0.026 s per
            128 MB (see :func:`~ckpt_lesson.files.hashing.zip_crc32_off`).

    Returns:
        Size and digest of the file as written.

    Raises:
        CheckpointError: The target is itself a directory, or a parent on
            the way is a regular file.

    Example:
        >>> digest = atomic_save({"w": torch.zeros(3)}, tmp_dir / "w.pt")  # doctest: +SKIP
    """

    def write(f: BinaryIO) -> FileDigest:
        writer = FooterWriter(f, algo)
        try:
            if zip_crc32:
                torch.save(payload, writer)
            else:
                with zip_crc32_off():
                    torch.save(payload, writer)
        except RuntimeError as exc:
            # torch's zip writer reports a failed write (a full disk) as "unexpected pos"; say what it is.
            if "unexpected pos" not in str(exc) and "write" not in str(exc).lower():
                raise
            raise _no_space(Path(path), _payload_bytes(payload)) from exc
        return writer.finish()

    try:
        return _atomic_write(Path(path), write)
    except OSError as exc:
        if exc.errno != errno.ENOSPC:
            raise
        raise _no_space(Path(path), _payload_bytes(payload)) from exc


def _payload_bytes(payload: Any) -> int:
    """Bytes of tensor data in ``payload``: about what a save needs on disk."""
    if isinstance(payload, torch.Tensor):
        return payload.untyped_storage().nbytes() if payload.device.type != "meta" else 0
    if isinstance(payload, dict):
        return sum(_payload_bytes(v) for v in payload.values())
    if isinstance(payload, (list, tuple)):
        return sum(_payload_bytes(v) for v in payload)
    return 0


def _size(n: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} bytes"


def _no_space(path: Path, needed: int) -> CheckpointError:
    try:
        free = shutil.disk_usage(path.parent).free
    except OSError:
        free = -1
    have = f"{_size(free)} free" if free >= 0 else "free space unknown"
    return CheckpointError(
        f"{path}: no space left on device while saving (about {_size(needed)} needed, {have}); "
        "nothing was replaced. Free space, lower keep_last, or save to another disk."
    )


def atomic_write_bytes(data: bytes, path: str | os.PathLike[str], *, algo: str = DEFAULT_ALGO) -> FileDigest:
    """Write ``data`` to ``path`` atomically and durably; returns its digest in ``algo``."""

    def write(f: BinaryIO) -> FileDigest:
        f.write(data)
        return FileDigest(len(data), digest_bytes(data, algo), None, algo)

    return _atomic_write(Path(path), write)


def atomic_write_json(obj: Any, path: str | os.PathLike[str], *, algo: str = DEFAULT_ALGO) -> FileDigest:
    """Write ``obj`` as indented, key-sorted JSON, atomically and durably.

    Raises:
        CheckpointError: ``obj`` is not JSON-serializable (NaN and infinity
            included: JSON has no spelling for them), or a parent is a file.
    """
    try:
        text = json.dumps(obj, indent=2, sort_keys=True, allow_nan=False) + "\n"
    except (TypeError, ValueError) as exc:
        raise CheckpointError(
            f"{path}: cannot write as JSON ({exc}); pass plain dicts, lists, str, int, float."
        ) from exc
    return atomic_write_bytes(text.encode("utf-8"), path, algo=algo)


def _keep_mode_and_owner(path: Path, fd: int) -> None:
    """Give the temp file the mode (and, as root, the owner) of the file it will replace.

    Replacing a private ``0600`` checkpoint must not make it world-readable: the
    rename swaps in a new inode, which would otherwise carry the default mode.
    """
    try:
        old = os.stat(path)
    except FileNotFoundError:
        return
    os.fchmod(fd, stat.S_IMODE(old.st_mode))
    if os.geteuid() == 0 and hasattr(os, "fchown"):
        os.fchown(fd, old.st_uid, old.st_gid)


def _atomic_write(path: Path, write: Callable[[BinaryIO], FileDigest]) -> FileDigest:
    directory = path.parent
    if path.is_dir():
        # Checked before writing: otherwise a whole payload is written, then refused by os.replace.
        raise CheckpointError(f"{path}: is a directory; choose a file name inside it instead.")
    make_dirs(directory)
    tmp = directory / f".{path.name}{TEMP_MARKER}{os.getpid()}-{uuid.uuid4().hex[:8]}"
    # 0o666 minus the umask: a new file gets the mode any new file would get here.
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        _keep_mode_and_owner(path, fd)
        with os.fdopen(fd, "wb") as f:
            digest = write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        # BaseException on purpose: Ctrl-C mid-save must not leave temp files behind.
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(directory)
    return digest
