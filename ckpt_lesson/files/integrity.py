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
``ckpt-lesson-sha256:<hex digest>`` as the comment. The result is still a valid
zip (``torch.load`` and ``zipfile`` both read it) and the hash costs no second
pass over the data.
"""

from __future__ import annotations

import hashlib
import os
import stat
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from ckpt_lesson.errors import CheckpointError, CorruptCheckpointError

__all__ = [
    "ALGORITHMS",
    "DEFAULT_ALGO",
    "FOOTER_MAGIC",
    "FileDigest",
    "FooterWriter",
    "check_algo",
    "digest_bytes",
    "file_digest",
    "file_sha256",
    "new_hasher",
    "part_digest",
    "read_footer_digest",
    "sha256_bytes",
    "verify_footer",
]

#: The integrity hash new records use. xxh3-128 runs at about 33 GB/s here
#: (sha256: 1.8 GB/s), so hashing costs a few percent of a save instead of half.
#: It detects damage, not tampering: the record sits beside the data, and
#: anyone who can rewrite one can rewrite the other.
DEFAULT_ALGO = "xxh3_128"

#: Every algorithm a record may name, with the length of its hex digest.
#: ``sha256`` and ``blake3`` are cryptographic: pick one when a digest is
#: pinned somewhere trusted (a release note, a registry) and checked from there.
ALGORITHMS: dict[str, int] = {"blake3": 64, "sha256": 64, "xxh3_128": 32}


def check_algo(name: Any) -> str:
    """Return ``name`` if it is a known algorithm, else raise.

    Raises:
        CheckpointError: ``name`` is not one of :data:`ALGORITHMS`.

    Example:
        >>> check_algo("sha256")
        'sha256'
    """
    if not isinstance(name, str) or name not in ALGORITHMS:
        raise CheckpointError(
            f"unknown integrity algorithm {name!r}; choose one of {sorted(ALGORITHMS)} "
            "(or upgrade ckpt_lesson if a newer version wrote this record)."
        )
    return name


def new_hasher(algo: str = DEFAULT_ALGO) -> Any:
    """A fresh incremental hasher (``update``, ``hexdigest``, ``copy``) for ``algo``.

    Raises:
        CheckpointError: Unknown algorithm, or ``blake3`` without its package.

    Example:
        >>> h = new_hasher("sha256"); h.update(b"abc"); h.hexdigest()[:8]
        'ba7816bf'
    """
    check_algo(algo)
    if algo == "sha256":
        return hashlib.sha256()
    if algo == "xxh3_128":
        import xxhash  # imported here: only the algorithms in use need their package

        return xxhash.xxh3_128()
    try:
        import blake3
    except ImportError as exc:
        raise CheckpointError(
            "blake3 is selected but its package is missing; `pip install blake3`, or use sha256."
        ) from exc
    return blake3.blake3(max_threads=blake3.blake3.AUTO)


def digest_bytes(data: bytes | bytearray | memoryview, algo: str = DEFAULT_ALGO) -> str:
    """Hex digest of ``data`` with ``algo``.

    Example:
        >>> len(digest_bytes(b"abc"))  # xxh3-128: 32 hex characters
        32
    """
    h = new_hasher(algo)
    h.update(data)
    return h.hexdigest()


def part_digest(record: Mapping[str, Any]) -> tuple[str, str]:
    """``(algo, hex digest)`` of a part record, old or new.

    New records carry ``{"algo": ..., "digest": ...}``; records written before
    the algorithm was recorded carry only ``{"sha256": ...}`` and still read.

    Raises:
        CorruptCheckpointError: Neither form is present, the algorithm is
            unknown, or the digest is not lowercase hex of the right length.

    Example:
        >>> part_digest({"file": "a.pt", "bytes": 1, "sha256": "0" * 64})
        ('sha256', '0000000000000000000000000000000000000000000000000000000000000000')
    """
    if "algo" in record or "digest" in record:
        algo, digest = record.get("algo"), record.get("digest")
    else:
        algo, digest = "sha256", record.get("sha256")
    if not isinstance(algo, str) or algo not in ALGORITHMS:
        raise CorruptCheckpointError(f"record {dict(record)!r}: unknown integrity algorithm {algo!r}.")
    if not isinstance(digest, str) or len(digest) != ALGORITHMS[algo] or not set(digest) <= _HEX:
        raise CorruptCheckpointError(f"record names algorithm {algo!r} but has no valid digest.")
    return algo, digest


#: Prefix of the zip comment that records the sha256 of everything before it.
FOOTER_MAGIC = b"ckpt-lesson-sha256:"
_FOOTER_LEN = len(FOOTER_MAGIC) + 64
_EOCD_SIG = b"PK\x05\x06"
_EOCD_LEN = 22
_CHUNK = 1 << 20
_HEX = frozenset("0123456789abcdef")


@dataclass(frozen=True)
class FileDigest:
    """What was written (or found) on disk.

    Attributes:
        size: Bytes in the whole file.
        sha256: Hex sha256 of the whole file, footer included. Indexes and
            manifests record this one, so any tool (``sha256sum``) can check it.
        content_sha256: Hex sha256 of the bytes before the footer (what the
            footer itself records), or ``None`` for a file without footer.
    """

    size: int
    sha256: str
    content_sha256: str | None = None


def sha256_bytes(data: bytes) -> str:
    """Hex sha256 of ``data``."""
    return hashlib.sha256(data).hexdigest()


class FooterWriter:
    """A write-only file wrapper for ``torch.save`` that hashes as it writes.

    Args:
        raw: A binary file opened for writing.

    Example:
        >>> import io, torch
        >>> buf = io.BytesIO()
        >>> w = FooterWriter(buf)
        >>> torch.save({"x": torch.ones(2)}, w)
        >>> digest = w.finish()
        >>> digest.size == len(buf.getvalue())
        True
    """

    def __init__(self, raw: BinaryIO) -> None:
        self._raw = raw
        self._hash = hashlib.sha256()
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
        self._emit(tail[:-2] + struct.pack("<H", _FOOTER_LEN))
        content = self._hash.hexdigest()
        footer = FOOTER_MAGIC + content.encode("ascii")
        whole = self._hash.copy()
        whole.update(footer)
        self._raw.write(footer)
        return FileDigest(self._size + len(footer), whole.hexdigest(), content)

    def _emit(self, chunk: bytes | memoryview) -> None:
        if len(chunk):
            self._hash.update(chunk)
            self._raw.write(chunk)
            self._size += len(chunk)


def read_footer_digest(f: BinaryIO, size: int) -> str | None:
    """Return the sha256 recorded in the footer of an open file, or ``None``.

    ``None`` means "no intact footer"; :func:`verify_footer` tells a file that
    never had one apart from a file whose footer was damaged.
    """
    return _inspect_footer(f, size)[1]


def _inspect_footer(f: BinaryIO, size: int) -> tuple[str, str | None]:
    """Classify the end of a file: ``("ok", digest)``, ``("absent", None)`` or ``("damaged", None)``.

    A footer has three recognisable parts: the end record's signature, its
    comment length (always ``_FOOTER_LEN`` for ours) and the magic prefix. One
    flipped byte can spoil at most one of them, so two out of three mean "this
    file had a footer and it was damaged", not "this file never had one". A
    plain ``torch.save`` file has comment length 0 and matches none of them.
    """
    window = min(size, _EOCD_LEN + _FOOTER_LEN + 64)
    f.seek(size - window)
    tail = f.read(window)
    end = tail[-(_EOCD_LEN + _FOOTER_LEN) :]
    if len(end) == _EOCD_LEN + _FOOTER_LEN:
        marks = (
            end[:4] == _EOCD_SIG,
            struct.unpack("<H", end[_EOCD_LEN - 2 : _EOCD_LEN])[0] == _FOOTER_LEN,
            end[_EOCD_LEN:].startswith(FOOTER_MAGIC),
        )
        if all(marks):
            return "ok", end[_EOCD_LEN + len(FOOTER_MAGIC) :].decode("ascii", errors="replace")
        if sum(marks) == 2:
            return "damaged", None
    # An end record that announces our comment, but not where a complete footer
    # would put it: the footer was cut off (truncation) or bytes were appended.
    at = tail.rfind(_EOCD_SIG)
    if at >= 0 and at + _EOCD_LEN <= len(tail):
        if struct.unpack("<H", tail[at + _EOCD_LEN - 2 : at + _EOCD_LEN])[0] == _FOOTER_LEN:
            return "damaged", None
    return "absent", None


def verify_footer(f: BinaryIO, *, name: str | os.PathLike[str] = "<file>") -> FileDigest:
    """Hash an open file once and check it against its own footer.

    Args:
        f: A binary file opened for reading; left positioned at offset 0.
        name: Used in error messages.

    Returns:
        The file's digests; ``content_sha256`` is ``None`` when the file has no
        footer (a file from elsewhere, or the lesson's legacy v1 format).

    Raises:
        CorruptCheckpointError: The footer's digest does not match the bytes,
            or the footer itself is damaged or cut off.
    """
    size = os.fstat(f.fileno()).st_size
    status, recorded = _inspect_footer(f, size)
    if status == "damaged":
        f.seek(0)
        raise CorruptCheckpointError(
            f"{name}: its integrity footer is damaged or cut off, so the file was truncated or "
            "changed after it was written. Restore an older checkpoint."
        )
    content_len = size - len(FOOTER_MAGIC) - 64 if recorded is not None else size
    f.seek(0)
    h = hashlib.sha256()
    buf = bytearray(_CHUNK)
    view = memoryview(buf)
    left = content_len
    while left > 0:
        got = f.readinto(view[: min(_CHUNK, left)])
        if not got:
            break
        h.update(view[:got])
        left -= got
    content = h.hexdigest()
    whole = h.copy()
    if recorded is not None:
        whole.update(f.read())
    f.seek(0)
    if recorded is not None and recorded != content:
        raise CorruptCheckpointError(
            f"{name}: contents do not match the sha256 recorded in the file's footer "
            f"(recorded {recorded[:12]}..., found {content[:12]}...). The file was changed "
            "or damaged after it was written; restore an older checkpoint."
        )
    return FileDigest(size, whole.hexdigest(), content if recorded is not None else None)


def file_digest(path: str | os.PathLike[str]) -> FileDigest:
    """Size and sha256 of a file on disk, footer checked when present.

    Raises:
        CorruptCheckpointError: The file's footer does not match its bytes.
    """
    with open(Path(path), "rb") as f:
        return verify_footer(f, name=path)


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
        f = open(Path(path), "rb")  # noqa: SIM115 - closed below, after the regular-file check
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot read it to hash ({exc.strerror or exc}).") from exc
    with f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            # A FIFO or device would block or never end; only files have a sha256.
            raise CheckpointError(f"{path}: is not a regular file; pass a file to hash.")
        h = hashlib.sha256()
        for chunk in iter(lambda: f.read(_CHUNK), b""):
            h.update(chunk)
    return h.hexdigest()
