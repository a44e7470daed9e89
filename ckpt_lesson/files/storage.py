"""Where a run's bytes live: a small storage interface with two backends.

A checkpoint protocol needs surprisingly few verbs from its storage:

* ``put_file``: stream a local file up, hashing every chunk on the way;
* ``create_if_absent``: write a small object only if nobody wrote it first
  (the one atomic step a commit marker needs);
* ``read_bytes`` / ``iter_chunks``: ranged and streaming reads;
* ``list_keys`` and ``delete``.

:class:`LocalStorage` is a POSIX folder (atomic rename, ``O_EXCL``).
:class:`~ckpt_lesson.files.storage_fsspec.FsspecStorage` is any fsspec URL
(``s3://`` through s3fs; ``gcs://`` and ``az://`` need no new code). The
default for a plain path stays the local folder with the manager's own
protocol; a URL is opened with :func:`open_storage`.

Keys are ``/``-separated and relative to the storage's root. The fsspec
backend builds on :class:`Storage` and the key checks here, so
:func:`open_storage` imports it only when a URL asks for it (a top-level
import would be a cycle).
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, BinaryIO

from ckpt_lesson.errors import CheckpointError, UnsafeCheckpointError
from ckpt_lesson.files.hashing import DEFAULT_ALGO, hash_chunks

__all__ = [
    "CHUNK_BYTES",
    "LocalStorage",
    "Storage",
    "check_key",
    "is_plain_key",
    "is_store_url",
    "open_storage",
]

_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_SCHEME = re.compile(r"^([a-z][a-z0-9+.-]*)://", re.IGNORECASE)

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


def is_store_url(location: Any) -> bool:
    """True when ``location`` is a URL such as ``s3://bucket/prefix`` (not a plain path or ``file://``).

    Example:
        >>> is_store_url("s3://bucket/runs/a"), is_store_url("runs/a")
        (True, False)
    """
    if not isinstance(location, str):
        return False
    match = _SCHEME.match(location)
    return bool(match) and match.group(1).lower() not in ("file", "local")


class LocalStorage(Storage):
    """A POSIX folder: atomic renames for puts, ``O_CREAT | O_EXCL`` for create-if-absent.

    Args:
        root: The folder (created if missing).

    Example:
        >>> store = LocalStorage(tmp_path / "bucket")  # doctest: +SKIP
        >>> [store.create_if_absent("a/COMMIT", b"{}") for _ in range(2)]  # doctest: +SKIP
        [True, False]
    """

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.url = str(self.root)

    def _path(self, key: str) -> Path:
        return self.root / check_key(key)

    def _open_new(self, path: Path, *, exclusive: bool) -> BinaryIO:
        path.parent.mkdir(parents=True, exist_ok=True)
        flags = os.O_WRONLY | os.O_CREAT | _NOFOLLOW | (os.O_EXCL if exclusive else os.O_TRUNC)
        return os.fdopen(os.open(path, flags, 0o644), "wb")

    def _write(self, key: str, fill: Callable[[BinaryIO], Any], *, exclusive: bool = False) -> Any:
        """Fill ``key`` durably: a temporary file renamed over it, or the name itself with ``O_EXCL``."""
        final = self._path(key)
        target = final if exclusive else final.with_name(f".{final.name}.{os.getpid()}.tmp")
        with self._open_new(target, exclusive=exclusive) as dst:
            result = fill(dst)
            dst.flush()
            os.fsync(dst.fileno())
        if not exclusive:
            os.replace(target, final)
        return result

    def put_file(self, key: str, local: Path, *, algo: str = DEFAULT_ALGO) -> tuple[int, str]:
        with open(local, "rb") as src:
            chunks = iter(lambda: src.read(CHUNK_BYTES), b"")
            return self._write(key, lambda dst: hash_chunks(chunks, algo, into=dst))

    def put_bytes(self, key: str, data: bytes) -> None:
        self._write(key, lambda dst: dst.write(data))

    def create_if_absent(self, key: str, data: bytes) -> bool:
        try:
            self._write(key, lambda dst: dst.write(data), exclusive=True)
        except FileExistsError:
            return False
        return True

    def read_bytes(self, key: str, *, limit: int) -> bytes:
        with open(os.open(self._path(key), os.O_RDONLY | _NOFOLLOW), "rb") as f:
            data = f.read(limit + 1)
        if len(data) > limit:
            raise CheckpointError(
                f"{self.where(key)}: larger than {limit} bytes; not a record this package wrote."
            )
        return data

    def iter_chunks(self, key: str, *, chunk: int = CHUNK_BYTES, size: int | None = None) -> Iterator[bytes]:
        with open(os.open(self._path(key), os.O_RDONLY | _NOFOLLOW), "rb") as f:
            while block := f.read(chunk):
                yield block

    def list_keys(self, prefix: str = "") -> list[str]:
        base = self.root / prefix if prefix else self.root
        if not base.is_dir():
            return []
        found = (p for p in base.rglob("*") if p.is_file() and not p.is_symlink())
        return sorted(p.relative_to(self.root).as_posix() for p in found)

    def delete(self, keys: list[str]) -> None:
        for key in keys:
            self._path(key).unlink(missing_ok=True)


def open_storage(
    url: str | os.PathLike[str],
    storage_options: Mapping[str, Any] | None = None,
    *,
    timeout: float | None = None,
) -> Storage:
    """The storage behind ``url``: :class:`LocalStorage` for a path, fsspec for a URL.

    Args:
        url: A folder, or an fsspec URL such as ``s3://bucket/runs/exp1``.
        storage_options: Passed to the fsspec filesystem (``key``, ``secret``,
            ``client_kwargs={"endpoint_url": ...}``); by default credentials and
            endpoint come from the environment, as for boto3.
        timeout: Seconds any one request to a store may wait (default 300); ignored for a folder.

    Returns:
        A :class:`Storage`.

    Raises:
        CheckpointError: The URL needs a package that is not installed (the
            message names ``pip install ckpt_lesson[s3]``), or is malformed.

    Example:
        >>> open_storage("s3://my-bucket/runs/exp1")  # doctest: +SKIP
        FsspecStorage('s3://my-bucket/runs/exp1')
    """
    if not is_store_url(url):
        return LocalStorage(url)
    from ckpt_lesson.files.storage_fsspec import FsspecStorage  # it builds on this module

    return FsspecStorage(str(url), storage_options, timeout=timeout)
