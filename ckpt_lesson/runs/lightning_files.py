"""Lightning ``.ckpt`` files in a folder: which verify, which are damaged, which cannot be vouched for.

Lightning's ``ModelCheckpoint`` keeps one ``torch.save`` file per save
(``epoch=3-step=12.ckpt``, ``last.ckpt``) in one folder.
:class:`~ckpt_lesson.integrations.lightning.VerifiedCheckpointIO` writes them
with this package's integrity footer, so each file can be judged on its own:

* ``ok``: the footer matches every byte;
* ``corrupt``: the footer does not match (a flipped byte, a cut-off tail), or
  a file without footer is not even a readable archive (the stock writer,
  killed mid-save);
* ``unverified``: a readable archive without our footer (Lightning's stock
  writer): nothing says whether its bytes are the ones that were saved;
* ``incomplete``: the temp file of a save that never finished
  (``.last.ckpt.tmp-...``, left by a kill; no loader ever picks it).

The epoch and step are read from the archive's ``data.pkl`` by walking its
pickle *opcodes* (:mod:`ckpt_lesson.runs.pickle_keys`), which executes
nothing: no unpickler, not even the weights-only one, runs during a scan. A
key set twice resolves as ``torch.load`` resolves it (the last one wins), and
the walk stops once the rest cannot change the answer. A file without them
is listed with step and epoch unknown.

Every byte read here goes through :mod:`ckpt_lesson.files.safe_read`, the
reader of every record: the file is opened only if it is a regular file
itself (a symlink is not followed, a FIFO does not block the scan), and the
``data.pkl`` record is read capped at
:data:`~ckpt_lesson.files.safe_read.MAX_RECORD_BYTES`. Any failure to open,
read or parse it makes the file ``corrupt``, never an exception.
"""

from __future__ import annotations

import os
import re
import struct
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from ckpt_lesson.errors import CheckpointError, CorruptCheckpointError, UnsafeCheckpointError
from ckpt_lesson.files.atomic import TEMP_MARKER, is_temp_file
from ckpt_lesson.files.integrity import verify_footer
from ckpt_lesson.files.loading import check_archive
from ckpt_lesson.files.safe_read import MAX_RECORD_BYTES, open_regular_file, read_exact_at
from ckpt_lesson.runs.pickle_keys import read_top_level_ints

__all__ = [
    "LIGHTNING_SUFFIX",
    "LightningFile",
    "inspect_lightning_file",
    "is_lightning_temp_file",
    "newness",
    "read_epoch_and_step",
]

LIGHTNING_SUFFIX = ".ckpt"
#: A zip local file header: signature, versions, flags, method, time, date, crc, sizes, name/extra lengths.
_LOCAL_HEADER = struct.Struct("<4sHHHHHIIIHH")
_NAME_STEP_RE = re.compile(r"(?:^|[-_])step=([0-9]+)")


@dataclass(frozen=True)
class LightningFile:
    """One ``.ckpt`` file judged.

    Attributes:
        path: The file.
        status: ``"ok"``, ``"corrupt"``, ``"unverified"`` or ``"incomplete"``.
        reason: Why it is not ok (file name only); ``""`` when ok.
        epoch: Lightning's ``epoch`` in the file, ``None`` when unreadable.
        step: Its ``global_step``; for a temp file, the ``step=N`` in its name; else ``None``.
    """

    path: Path
    status: str
    reason: str = ""
    epoch: int | None = None
    step: int | None = None


def is_lightning_temp_file(name: str) -> bool:
    """True for the temp file of an unfinished atomic save of a ``.ckpt`` (``.last.ckpt.tmp-...``)."""
    return is_temp_file(name) and LIGHTNING_SUFFIX + TEMP_MARKER in name


def read_epoch_and_step(f: BinaryIO, *, name: str = "<file>") -> tuple[int | None, int | None]:
    """``(epoch, global_step)`` of a checkpoint archive, read from its pickle's opcodes, never executed.

    Only the outermost dict's keys count (a nested ``{"epoch": ...}`` does not);
    call :func:`~ckpt_lesson.files.loading.check_archive` first so that the
    archive's members are bounded.

    Raises:
        CorruptCheckpointError: Not a readable archive, no ``data.pkl`` record, one over
            the record cap (:data:`~ckpt_lesson.files.safe_read.MAX_RECORD_BYTES`), or one
            cut short or unreadable (an I/O error).

    Example:
        >>> with open("checkpoints/last.ckpt", "rb") as f:  # doctest: +SKIP
        ...     read_epoch_and_step(f)
        (3, 12)
    """
    try:
        with zipfile.ZipFile(f) as archive:
            member = next((i for i in archive.infolist() if i.filename.endswith("/data.pkl")), None)
    except (zipfile.BadZipFile, ValueError, OSError, EOFError) as exc:
        raise CorruptCheckpointError(f"{name}: not a readable archive ({str(exc)[:120]}).") from exc
    finally:
        f.seek(0)
    if member is None:
        raise CorruptCheckpointError(f"{name}: not a torch.save checkpoint (no data.pkl record).")
    # data.pkl holds the structure only (tensors are separate records): a few MB even for big
    # models, so the cap of every record applies (read_exact_at refuses a larger one unread).
    data = _stored_bytes(f, member, name)
    # An abstract walk, last assignment winning as in torch.load, stopped as soon as the rest of
    # the bytes cannot change the answer (runs/pickle_keys.py).
    found = read_top_level_ints(data, ("epoch", "global_step"))
    return found.get("epoch"), found.get("global_step")


def _stored_bytes(f: BinaryIO, member: zipfile.ZipInfo, name: str) -> bytes:
    """A stored (uncompressed) member's bytes, read past its local header.

    Not ``ZipFile.read``: that checks the zip CRC32, which our writer leaves at
    zero (``torch.load`` never checks it; the footer covers the bytes instead).
    """
    what = f"{member.filename[:80]!r} record"
    header = read_exact_at(f, member.header_offset, _LOCAL_HEADER.size, where=name, what=f"{what} header")
    if header[:4] != b"PK\x03\x04":
        raise CorruptCheckpointError(f"{name}: not a readable archive (bad local header of the {what}).")
    name_len, extra_len = _LOCAL_HEADER.unpack(header)[-2:]
    start = member.header_offset + _LOCAL_HEADER.size + name_len + extra_len
    try:
        return read_exact_at(f, start, member.file_size, where=name, what=what, limit=MAX_RECORD_BYTES)
    finally:
        f.seek(0)


def inspect_lightning_file(path: str | os.PathLike[str]) -> LightningFile:
    """Judge one ``.ckpt`` file (or the temp file of a killed save) without unpickling it.

    One read of every byte for the footer, then the small ``data.pkl`` record
    for the epoch and step.

    Example:
        >>> inspect_lightning_file("checkpoints/last.ckpt").status  # doctest: +SKIP
        'ok'
    """
    path = Path(path)
    if is_lightning_temp_file(path.name):
        named = _NAME_STEP_RE.search(path.name)
        step = int(named.group(1)) if named else None
        return LightningFile(
            path, "incomplete", "unfinished save (temp file left by a killed save)", None, step
        )
    try:
        with open_regular_file(path, what="Lightning checkpoint") as f:
            try:
                digest = verify_footer(f, name=path.name)
            except CorruptCheckpointError as exc:
                return LightningFile(path, "corrupt", str(exc), *_best_effort(f))
            check_archive(f, os.fstat(f.fileno()).st_size, name=path.name)
            epoch, step = read_epoch_and_step(f, name=path.name)
    except (CorruptCheckpointError, UnsafeCheckpointError) as exc:
        # Messages from the shared reader name the whole path; the listing names the file.
        return LightningFile(path, "corrupt", str(exc).replace(str(path), path.name))
    except OSError as exc:
        return LightningFile(path, "corrupt", f"{path.name}: unreadable ({exc.strerror or exc})")
    if not digest.has_footer:
        return LightningFile(
            path,
            "unverified",
            f"{path.name}: no integrity footer (written by Lightning's stock writer?), so its bytes "
            "cannot be checked; save with VerifiedCheckpointIO",
            epoch,
            step,
        )
    return LightningFile(path, "ok", "", epoch, step)


def _best_effort(f: BinaryIO) -> tuple[int | None, int | None]:
    """Epoch and step of a damaged file, if its archive still reads (for the listing only)."""
    try:
        f.seek(0)
        check_archive(f, os.fstat(f.fileno()).st_size)
        return read_epoch_and_step(f)
    except (CheckpointError, OSError, zipfile.BadZipFile, EOFError):
        return None, None


def newness(found: Any) -> tuple[int, int, int, str]:
    """Sort key for Lightning files, newest last: step, then epoch, then modification time, then name.

    Works on anything with ``path``, ``step`` and ``epoch`` (a :class:`LightningFile`
    or a scan result), so that the scan and the resume helper name the same file.
    """
    unknown = -1  # a file whose step cannot be read ranks below every readable one
    step = unknown if found.step is None else found.step
    epoch = unknown if found.epoch is None else found.epoch
    try:
        mtime = found.path.stat().st_mtime_ns
    except OSError:
        mtime = 0
    return step, epoch, mtime, found.path.name
