"""The storage interface every backend implements, and the keys it accepts.

A checkpoint protocol needs surprisingly few verbs from its storage (see
:class:`Storage`). Both backends build on this module; :mod:`ckpt_lesson.files.storage`
picks one of them and says why the interface sits down here.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from ckpt_lesson.errors import UnsafeCheckpointError
from ckpt_lesson.files.hashing import DEFAULT_ALGO

__all__ = ["CHUNK_BYTES", "Storage", "check_key", "is_plain_key"]

#: Upload and download chunk: large enough that per-request overhead vanishes, small enough to stream.
CHUNK_BYTES = 8 << 20


def is_plain_key(key: str) -> bool:
    """True for a key that stays inside the root: no ``..``, ``.`` or empty part, no ``\\``, no leading ``/``.

    Example:
        >>> is_plain_key("step-00000010/COMMIT"), is_plain_key("step-5/junk/../x"), is_plain_key("a//b")
        (True, False, False)
    """
    parts = key.split("/")
    return (
        bool(key)
        and not key.startswith("/")
        and "\\" not in key
        and not any(p in ("", ".", "..") for p in parts)
    )


def check_key(key: str) -> str:
    """Refuse a key that could leave the storage's root (``..``, absolute, empty parts).

    Raises:
        UnsafeCheckpointError: The key is unsafe.

    Example:
        >>> check_key("step-00000010/COMMIT")
        'step-00000010/COMMIT'
    """
    if not is_plain_key(key):
        raise UnsafeCheckpointError(f"storage key {key!r} would leave the run's prefix; refusing it.")
    return key


class Storage:
    """The interface both backends implement (see the module docstring)."""

    #: Human-readable root (a folder path or a URL), used in every message.
    url: str = ""

    def where(self, key: str) -> str:
        """``url/key``, for messages."""
        return f"{self.url.rstrip('/')}/{key}"

    def put_file(self, key: str, local: Path, *, algo: str = DEFAULT_ALGO) -> tuple[int, str]:
        """Stream ``local`` up to ``key``, hashing each chunk; returns ``(bytes, digest)``."""
        raise NotImplementedError

    def put_bytes(self, key: str, data: bytes) -> None:
        """Write a small object (overwriting)."""
        raise NotImplementedError

    def create_if_absent(self, key: str, data: bytes) -> bool:
        """Write ``key`` only if it does not exist; False when it already did (atomic)."""
        raise NotImplementedError

    def read_bytes(self, key: str, *, limit: int) -> bytes:
        """The whole object, refusing one larger than ``limit`` bytes. ``FileNotFoundError`` if missing."""
        raise NotImplementedError

    def iter_chunks(self, key: str, *, chunk: int = CHUNK_BYTES, size: int | None = None) -> Iterator[bytes]:
        """Stream the object in ranged chunks. ``FileNotFoundError`` if missing.

        ``size``: the expected size, when known (saves a round trip); a longer
        object still yields at least one byte more, so the caller sees it differs.
        """
        raise NotImplementedError

    def list_keys(self, prefix: str = "") -> list[str]:
        """Every key under ``prefix`` (recursive, sorted, however many pages the listing takes)."""
        raise NotImplementedError

    def delete(self, keys: list[str]) -> None:
        """Delete ``keys``; missing ones are not an error."""
        raise NotImplementedError

    def check_reachable(self) -> None:
        """Raise ``LoadEnvironmentError`` if the store (its bucket) cannot be read; writes nothing."""

    def check_conditional_writes(self) -> None:
        """Raise :class:`CheckpointError` if ``create_if_absent`` is not really conditional here."""

    def abort_uploads(self, prefix: str) -> int:
        """Abort unfinished multipart uploads under ``prefix`` (object stores); returns how many."""
        return 0
