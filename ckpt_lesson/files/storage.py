"""Where a run's bytes live: :func:`open_storage` picks a backend for a path or a URL.

:class:`LocalStorage` is a POSIX folder (atomic rename, ``O_EXCL``).
:class:`~ckpt_lesson.files.storage_fsspec.FsspecStorage` is any fsspec URL
(``s3://`` through s3fs; ``gcs://`` and ``az://`` need no new code). The
default for a plain path stays the local folder with the manager's own
protocol. Both implement the few verbs of
:class:`~ckpt_lesson.files.storage_base.Storage` over ``/``-separated keys
relative to the root (``create_if_absent`` is the one atomic step a commit
marker needs); the interface sits below both backends so that this module
can import the one it hands out, and re-exports it where callers import it.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, BinaryIO

from ckpt_lesson.errors import CheckpointError
from ckpt_lesson.files.hashing import DEFAULT_ALGO, hash_chunks
from ckpt_lesson.files.storage_base import CHUNK_BYTES, Storage, check_key, is_plain_key
from ckpt_lesson.files.storage_fsspec import FsspecStorage

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
    return FsspecStorage(str(url), storage_options, timeout=timeout)
