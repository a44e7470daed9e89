"""Integrity records that are written in the same pass as the data.

``torch.load`` does not check the CRC32s of the zip archive that ``torch.save``
writes: a byte flipped inside tensor data loads without complaint as a
different weight. So every ``.pt`` file this package writes carries its own
record, and the record lives *inside* the file, where a crash cannot separate
it from the data it describes (a sidecar written a moment later can).

The trick: a zip archive ends with an "end of central directory" record whose
last field is the length of an optional archive comment. :class:`FooterWriter`
holds back those final 22 bytes while ``torch.save`` streams through it,
hashes everything else as it passes, then sets the comment length and appends
``ckpt-lesson-<algo>:<hex digest>`` as the comment (``algo`` is named, see
:mod:`ckpt_lesson.files.hashing`; files from earlier versions carry
``ckpt-lesson-sha256:`` and still verify). The result is still a valid
zip (``torch.load`` and ``zipfile`` both read it) and the hash costs no second
pass over the data.
"""

from __future__ import annotations

import os
import stat
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from ckpt_lesson.errors import CheckpointError, CorruptCheckpointError
from ckpt_lesson.files.hashing import (
    ALGORITHMS,
    DEFAULT_ALGO,
    check_algo,
    hash_chunks,
    new_hasher,
    record_fields,
)
from ckpt_lesson.short_repr import short_repr

__all__ = [
    "FOOTER_MAGIC",
    "FileDigest",
    "FooterWriter",
    "file_digest",
    "file_sha256",
    "read_footer",
    "verify_footer",
]

#: Prefix of the zip comment; the algorithm's name and ``:`` follow, then the hex digest.
FOOTER_MAGIC = b"ckpt-lesson-"
_EOCD_SIG = b"PK\x05\x06"
_EOCD_LEN = 22
_CHUNK = 1 << 20


def _footer_len(algo: str) -> int:
    return len(FOOTER_MAGIC) + len(algo) + 1 + ALGORITHMS[algo]


#: Comment length -> algorithms whose footer has that length (sha256 and blake3 share 83).
_LENGTHS: dict[int, list[str]] = {}
for _algo in ALGORITHMS:
    _LENGTHS.setdefault(_footer_len(_algo), []).append(_algo)


@dataclass(frozen=True)
class FileDigest:
    """What was written (or found) on disk.

    Attributes:
        size: Bytes in the whole file.
        digest: Hex digest of the whole file, footer included, in ``algo``.
            Indexes and manifests record this one.
        content_digest: Hex digest of the bytes before the footer (what the
            footer itself records, in the footer's algorithm), or ``None`` for
            a file without footer.
        algo: The algorithm of ``digest`` (see :data:`ALGORITHMS`); the
            footer's too, unless a reader asked for another one.
    """

    __repr__ = short_repr  # one short line: see ckpt_lesson/short_repr.py

    size: int
    digest: str
    content_digest: str | None = None
    algo: str = "sha256"

    @property
    def sha256(self) -> str | None:
        """The whole-file digest if it is a sha256 (older callers), else ``None``."""
        return self.digest if self.algo == "sha256" else None

    @property
    def has_footer(self) -> bool:
        """True when the file carried an intact footer that matched its bytes."""
        return self.content_digest is not None

    def record(self) -> dict[str, Any]:
        """``{"bytes", "algo", "digest"}``: this file's fields in a part record."""
        return {"bytes": self.size, **record_fields(self.algo, self.digest)}


class FooterWriter:
    """A write-only file wrapper for ``torch.save`` that hashes as it writes.

    Args:
        raw: A binary file opened for writing.
        algo: The hash algorithm (default :data:`DEFAULT_ALGO`).

    Example:
        >>> import io, torch
        >>> buf = io.BytesIO()
        >>> w = FooterWriter(buf)
        >>> torch.save({"x": torch.ones(2)}, w)
        >>> digest = w.finish()
        >>> digest.size == len(buf.getvalue())
        True
    """

    def __init__(self, raw: BinaryIO, algo: str = DEFAULT_ALGO) -> None:
        self._raw = raw
        self._algo = check_algo(algo)
        self._hash = new_hasher(algo)
        self._tail = b""  # the last 22 bytes seen: the zip's end record, held back
        self._size = 0

    def write(self, data: bytes | bytearray | memoryview) -> int:
        view = memoryview(data).cast("B")
        n = len(view)
        if n >= _EOCD_LEN:
            # Emit the old tail and all but the last 22 new bytes, without copying.
            self._emit(self._tail)
            self._emit(view[: n - _EOCD_LEN])
            self._tail = bytes(view[n - _EOCD_LEN :])
        else:
            joined = self._tail + bytes(view)
            cut = max(0, len(joined) - _EOCD_LEN)
            self._emit(joined[:cut])
            self._tail = joined[cut:]
        return n

    def flush(self) -> None:
        self._raw.flush()

    def finish(self) -> FileDigest:
        """Patch the comment length, write the footer, and return the digests.

        Raises:
            CorruptCheckpointError: What was written does not end in a zip end
                record (it was not written by ``torch.save``).
        """
        tail = self._tail
        if len(tail) != _EOCD_LEN or tail[:4] != _EOCD_SIG or tail[-2:] != b"\x00\x00":
            raise CorruptCheckpointError(
                "FooterWriter expected torch.save's zip end record as the last 22 bytes; "
                "only pass it to torch.save (the zip format, the default since torch 1.6)."
            )
        self._tail = b""
        self._emit(tail[:-2] + struct.pack("<H", _footer_len(self._algo)))
        content = self._hash.hexdigest()
        footer = FOOTER_MAGIC + self._algo.encode("ascii") + b":" + content.encode("ascii")
        whole = self._hash.copy()
        whole.update(footer)
        self._raw.write(footer)
        return FileDigest(self._size + len(footer), whole.hexdigest(), content, self._algo)

    def _emit(self, chunk: bytes | memoryview) -> None:
        if len(chunk):
            self._hash.update(chunk)
            self._raw.write(chunk)
            self._size += len(chunk)


def read_footer(f: BinaryIO, size: int, *, name: str | os.PathLike[str]) -> tuple[str, str] | None:
    """``(algo, digest)`` recorded in the footer at the end of a file, or ``None`` if it has none.

    A footer has three recognisable parts: the end record's signature, its
    comment length (one of our footer lengths) and the magic prefix with a
    known algorithm of that length. One flipped byte can spoil at most one of
    them, so two out of three mean "this file had a footer and it was
    damaged", not "this file never had one". A plain ``torch.save`` file has
    comment length 0 and matches none of them.

    Raises:
        CorruptCheckpointError: The footer is damaged or cut off (``f`` is left at offset 0).

    Example:
        >>> with open("ckpt/last.pt", "rb") as f:  # doctest: +SKIP
        ...     read_footer(f, os.fstat(f.fileno()).st_size, name="ckpt/last.pt")
        ('xxh3_128', '9f0c...')
    """
    longest = max(_LENGTHS)
    window = min(size, _EOCD_LEN + longest + 64)
    f.seek(size - window)
    tail = f.read(window)
    damaged = False
    for length, algos in _LENGTHS.items():
        end = tail[-(_EOCD_LEN + length) :]
        if len(end) != _EOCD_LEN + length:
            continue
        comment = end[_EOCD_LEN:]
        named = next((a for a in algos if comment.startswith(FOOTER_MAGIC + a.encode() + b":")), None)
        marks = (
            end[:4] == _EOCD_SIG,
            struct.unpack("<H", end[_EOCD_LEN - 2 : _EOCD_LEN])[0] == length,
            named is not None,
        )
        if all(marks) and named is not None:
            return named, comment[-ALGORITHMS[named] :].decode("ascii", errors="replace")
        damaged = damaged or sum(marks) == 2
    # An end record that announces one of our comments, but not where a complete
    # footer would put it: the footer was cut off (truncation) or bytes were appended.
    at = tail.rfind(_EOCD_SIG)
    if not damaged and at >= 0 and at + _EOCD_LEN <= len(tail):
        damaged = struct.unpack("<H", tail[at + _EOCD_LEN - 2 : at + _EOCD_LEN])[0] in _LENGTHS
    if damaged:
        f.seek(0)
        raise CorruptCheckpointError(
            f"{name}: its integrity footer is damaged or cut off, so the file was truncated or "
            "changed after it was written. Restore an older checkpoint."
        )
    return None


def verify_footer(
    f: BinaryIO, *, name: str | os.PathLike[str] = "<file>", algo: str | None = None
) -> FileDigest:
    """Hash an open file once and check it against its own footer.

    Args:
        f: A binary file opened for reading; left positioned at offset 0.
        name: Used in error messages.
        algo: Algorithm of the whole-file digest to return (a record's
            algorithm, to compare with it). ``None``: the footer's algorithm,
            or :data:`DEFAULT_ALGO` for a file without footer. When it differs
            from the footer's, both are computed in the same single pass.

    Returns:
        The file's digests; ``content_digest`` is ``None`` when the file has no
        footer (a file from elsewhere, or the lesson's legacy v1 format).

    Raises:
        CorruptCheckpointError: The footer's digest does not match the bytes,
            or the footer itself is damaged or cut off.
    """
    size = os.fstat(f.fileno()).st_size
    found = read_footer(f, size, name=name)
    footer_algo = found[0] if found else None
    algo = check_algo(algo or footer_algo or DEFAULT_ALGO)
    content_len = size - _footer_len(footer_algo) if footer_algo else size
    f.seek(0)
    h = new_hasher(footer_algo or algo)
    extra = new_hasher(algo) if footer_algo and algo != footer_algo else None
    # A private copy's reader hands out each piece where it will be loaded from (read_view), so
    # the bytes hashed are the bytes kept, with no copy between the two.
    read_view = getattr(f, "read_view", None)
    view = memoryview(bytearray(_CHUNK if read_view is None else 0))
    left = content_len
    while left > 0:
        if read_view is not None:
            chunk = read_view(min(_CHUNK, left))
        else:
            chunk = view[: f.readinto(view[: min(_CHUNK, left)]) or 0]
        if not len(chunk):
            break
        h.update(chunk)
        if extra is not None:
            extra.update(chunk)
        left -= len(chunk)
    content = h.hexdigest()
    whole = extra if extra is not None else h.copy()
    if found is not None:
        whole.update(f.read())
    f.seek(0)
    if found is not None and found[1] != content:
        raise CorruptCheckpointError(
            f"{name}: contents do not match the {footer_algo} recorded in the file's footer "
            f"(recorded {found[1][:12]}..., found {content[:12]}...). The file was changed "
            "or damaged after it was written; restore an older checkpoint."
        )
    return FileDigest(size, whole.hexdigest(), content if found is not None else None, algo)


def file_digest(path: str | os.PathLike[str], algo: str | None = None) -> FileDigest:
    """Size and digest of a file on disk, footer checked when present.

    Args:
        path: The file.
        algo: Algorithm of the returned whole-file digest; see :func:`verify_footer`.

    Raises:
        CorruptCheckpointError: The file's footer does not match its bytes.
    """
    with open(Path(path), "rb") as f:
        return verify_footer(f, name=path, algo=algo)


def file_sha256(path: str | os.PathLike[str]) -> str:
    """Hex sha256 of a whole file's bytes, like ``sha256sum`` (the lesson's helper).

    Any regular file works, with or without our footer; nothing is checked but
    that it is a file. :func:`file_digest` is the checking variant.

    Raises:
        CheckpointError: ``path`` is missing or not a regular file.

    Example:
        >>> file_sha256("ckpt.pt")  # doctest: +SKIP
        '9f86d081884c7d65...'
    """
    try:
        # O_NONBLOCK: opening a FIFO for reading would otherwise wait for a writer, forever.
        f = os.fdopen(os.open(Path(path), os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)), "rb")
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot read it to hash ({exc.strerror or exc}).") from exc
    with f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            # A FIFO or device would block or never end; only files have a sha256.
            raise CheckpointError(f"{path}: is not a regular file; pass a file to hash.")
        return hash_chunks(iter(lambda: f.read(_CHUNK), b""), "sha256")[1]
