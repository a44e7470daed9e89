"""Reading small record files (JSON, JSON lines) as if every one were hostile.

A run directory is data, and data can be crafted. The package reads a handful
of small records besides the checkpoints themselves: ``manifest.json``,
``index.json``, ``recovery.jsonl``, ``progress.json``. Each of them can be
turned into a weapon without touching a single checkpoint byte:

* a **symlink to the zero device** is "a file" that never ends: reading it whole
  fills memory;
* a **FIFO** (named pipe) blocks the reader forever: a restore that hangs is
  worse than one that fails;
* **200,000 nested brackets** are valid-looking JSON that makes the parser
  recurse until Python raises ``RecursionError``, which is not a ``ValueError``
  and so slips past ``except ValueError``.

So every record goes through :func:`read_regular_file`: the name must be a
regular file *itself* (checked with ``lstat``, never following a symlink),
opened with ``O_NOFOLLOW | O_NONBLOCK`` (a FIFO swapped in between the check
and the open cannot block us), checked again on the open descriptor, and read
with a size cap. :func:`read_json_file` then parses it and turns a parse
failure of *any* kind into :class:`~ckpt_lesson.errors.CorruptCheckpointError`,
so the caller treats the save as damaged and falls back to an older one.

A record inside a file too large to read whole (the ``data.pkl`` of a
Lightning ``.ckpt``) is read the same way: :func:`open_regular_file` opens
the file with the same checks, and :func:`read_exact_at` takes the piece,
capped, with a short read or an I/O error reported as damage.
"""

from __future__ import annotations

import errno
import json
import os
import stat
from typing import Any, BinaryIO

from ckpt_lesson.errors import CorruptCheckpointError

__all__ = [
    "MAX_RECORD_BYTES",
    "SAFE_OPEN_FLAGS",
    "file_kind",
    "open_regular_file",
    "parse_json_text",
    "read_exact_at",
    "read_json_file",
    "read_regular_file",
]

#: Cap for a record file. A manifest of a 1,000-shard save is about 200 kB; 64 MiB is generous
#: and still far from what it would take to hurt the machine.
MAX_RECORD_BYTES = 64 << 20

#: What every open of a file beside a save adds (here and in side_files): follow no symlink,
#: block on no FIFO, leak into no child process.
SAFE_OPEN_FLAGS = getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)


def open_regular_file(path: str | os.PathLike[str], *, what: str = "file") -> BinaryIO:
    """Open a file for reading the way every record is opened: a regular file itself, or nothing.

    ``lstat`` first (a symlink is refused, never followed), then ``O_NOFOLLOW |
    O_NONBLOCK`` (a symlink or FIFO swapped in after the check neither redirects
    nor blocks the open), then ``fstat`` on the descriptor. :func:`read_regular_file`
    reads a small file whole this way; from a file too large for that (a Lightning
    ``.ckpt``) take any bounded piece with :func:`read_exact_at`.

    Args:
        path: The file.
        what: How messages call the file.

    Returns:
        The file, open for binary reading (close it, or use ``with``).

    Raises:
        FileNotFoundError: The file does not exist.
        CorruptCheckpointError: Not a regular file, or it cannot be opened.

    Example:
        >>> with open_regular_file("checkpoints/last.ckpt", what="checkpoint") as f:  # doctest: +SKIP
        ...     head = read_exact_at(f, 0, 4, where="last.ckpt", what="zip signature")
    """
    st = os.lstat(path)  # the name itself, never what a symlink points to
    if not stat.S_ISREG(st.st_mode):
        raise CorruptCheckpointError(
            f"{path}: the {what} is {file_kind(st.st_mode)}, not a regular file; it was replaced by "
            "something else and is not read. Restore an older save or remove it."
        )
    try:
        fd = os.open(path, os.O_RDONLY | SAFE_OPEN_FLAGS)
    except FileNotFoundError:
        raise
    except OSError as exc:
        if exc.errno == errno.ELOOP:  # swapped for a symlink after the check
            raise CorruptCheckpointError(f"{path}: the {what} became a symlink; not following it.") from exc
        raise CorruptCheckpointError(f"{path}: cannot open the {what} ({exc.strerror or exc}).") from exc
    try:
        st = os.fstat(fd)
    except OSError as exc:
        os.close(fd)
        raise CorruptCheckpointError(f"{path}: cannot stat the {what} ({exc.strerror or exc}).") from exc
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise CorruptCheckpointError(f"{path}: the {what} is {file_kind(st.st_mode)}, not a regular file.")
    return os.fdopen(fd, "rb")


def read_exact_at(
    f: BinaryIO, offset: int, size: int, *, where: str, what: str = "record", limit: int = MAX_RECORD_BYTES
) -> bytes:
    """Exactly ``size`` bytes of ``f`` from ``offset``: a bounded read where any failure is damage.

    Args:
        f: A file opened with :func:`open_regular_file`.
        offset: Where the piece starts.
        size: How many bytes it has (as a record inside the file declares it).
        where: The file's name, for messages.
        what: How messages call the piece (``"data.pkl record"``).
        limit: The most bytes accepted; a larger declared size is damage, never read.

    Returns:
        The bytes.

    Raises:
        CorruptCheckpointError: A size that is negative or over ``limit``, an
            offset outside the file, an I/O error, or fewer bytes than declared.

    Example:
        >>> import io
        >>> read_exact_at(io.BytesIO(b"head:body"), 5, 4, where="a.ckpt")
        b'body'
    """
    if size < 0 or offset < 0 or size > limit:
        raise CorruptCheckpointError(
            f"{where}: its {what} declares {size} bytes at offset {offset}, over the {limit}-byte cap "
            "for such a record (or negative); it is damaged or crafted and is not read."
        )
    try:
        f.seek(offset)
        data = f.read(size)
    except (OSError, ValueError) as exc:
        raise CorruptCheckpointError(
            f"{where}: I/O error reading its {what} ({getattr(exc, 'strerror', None) or exc}); "
            "this copy is damaged."
        ) from exc
    if len(data) != size:
        raise CorruptCheckpointError(
            f"{where}: its {what} is cut short ({len(data)} of {size} bytes); the file is truncated "
            "or damaged."
        )
    return data


def read_regular_file(
    path: str | os.PathLike[str], *, limit: int = MAX_RECORD_BYTES, what: str = "file"
) -> bytes:
    """Read a whole small file, refusing non-regular files and anything over ``limit`` bytes.

    Args:
        path: The file.
        limit: The most bytes accepted.
        what: How messages call the file.

    Returns:
        The file's bytes.

    Raises:
        FileNotFoundError: The file does not exist.
        CorruptCheckpointError: Not a regular file, larger than ``limit``, or
            an I/O error while reading (EIO and friends are damage to this copy).

    Example:
        >>> read_regular_file("run/progress.json", limit=1 << 20)  # doctest: +SKIP
        b'{"step": 12, ...}'
    """
    with open_regular_file(path, what=what) as f:
        try:
            size = os.fstat(f.fileno()).st_size
            if size > limit:
                raise CorruptCheckpointError(
                    f"{path}: the {what} is {size} bytes, over the {limit}-byte cap for such a record; "
                    "it is damaged or was replaced. Restore an older save."
                )
            chunks, total = [], 0
            # os.read on the descriptor, unbuffered: an I/O error surfaces here, at the OS boundary.
            while chunk := os.read(f.fileno(), min(1 << 20, limit + 1 - total)):
                chunks.append(chunk)
                total += len(chunk)
                if total > limit:  # it grew while we read it
                    raise CorruptCheckpointError(
                        f"{path}: the {what} grew past the {limit}-byte cap while read."
                    )
            return b"".join(chunks)
        except OSError as exc:
            raise CorruptCheckpointError(
                f"{path}: I/O error reading the {what} ({exc.strerror or exc}); this copy is damaged."
            ) from exc


def parse_json_text(data: bytes, *, where: str) -> Any:
    """Decode UTF-8 and parse JSON; any failure (``RecursionError`` too) is damage.

    Raises:
        CorruptCheckpointError: Not UTF-8, not JSON, nested too deeply, or holding
            NaN/Infinity (our writers never produce them).

    Example:
        >>> parse_json_text(b'{"step": 3}', where="manifest.json")
        {'step': 3}
    """
    try:
        return json.loads(data.decode("utf-8"), parse_constant=_refuse_constant)
    except RecursionError:
        # Deep nesting is the one parse failure that is not a ValueError.
        raise CorruptCheckpointError(
            f"{where}: not valid JSON (nested too deeply to be a record of ours); it is damaged."
        ) from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise CorruptCheckpointError(
            f"{where}: not valid JSON ({str(exc)[:120]}); it is damaged. Restore an older save."
        ) from None


def read_json_file(path: str | os.PathLike[str], *, limit: int = MAX_RECORD_BYTES, what: str = "file") -> Any:
    """:func:`read_regular_file` then :func:`parse_json_text`.

    Raises:
        FileNotFoundError: The file does not exist.
        CorruptCheckpointError: See both functions.

    Example:
        >>> read_json_file("run/step-00000240/manifest.json", what="manifest")["step"]  # doctest: +SKIP
        240
    """
    return parse_json_text(read_regular_file(path, limit=limit, what=what), where=str(path))


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def file_kind(mode: int) -> str:
    """What a non-regular file is, in words, for messages (``a FIFO (named pipe)``, ``a symlink``, ...)."""
    if stat.S_ISLNK(mode):
        return "a symlink"
    if stat.S_ISDIR(mode):
        return "a directory"
    if stat.S_ISFIFO(mode):
        return "a FIFO (named pipe)"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return "not a regular file"
