"""Migrating an old checkpoint *object* in a bucket, without ever losing the original.

:func:`~ckpt_lesson.files.migrate.migrate_file` rewrites a local file with a
hard-link backup and one atomic rename. An object store has neither, so the
same promise (the original bytes are always somewhere, a kill at any moment is
finished by running the command again) is kept with its own two primitives,
conditional writes and strong read-after-write consistency:

1. ``HEAD`` the object (size and ETag) and refuse a part of a committed save
   (a ``manifest.json`` or ``COMMIT`` beside it pins its digest);
2. download it into a local temporary folder, streaming, and run the local
   migration there: read and verify, migrate in memory, check every bucket a
   resume needs, write the new file with its integrity footer. Nothing in the
   bucket has changed yet;
3. upload the original bytes as ``KEY + SUFFIX`` with ``If-None-Match: *``
   (a backup is never overwritten), then read it back and hash it. A backup
   already holding exactly these bytes (an interrupted earlier run) is reused;
4. overwrite ``KEY`` with the migrated bytes with ``If-Match: ETAG``: if
   anyone changed the object since step 1, nothing is replaced. A PUT is
   atomic per object (readers see the old bytes or the new, never a mix);
5. read ``KEY`` back and hash it against what was uploaded.

A kill before 4 leaves the original at ``KEY`` (and maybe its verified
backup); after 4, the new file at ``KEY`` and the original in the backup.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

from ckpt_lesson.errors import CheckpointError, CorruptCheckpointError
from ckpt_lesson.files.hashing import DEFAULT_ALGO, hash_chunks
from ckpt_lesson.files.migrate import (
    DEFAULT_BACKUP_SUFFIX,
    MigrationResult,
    check_backup_suffix,
    migrate_file,
    refuse_recorded_part,
)
from ckpt_lesson.files.schema import MANIFEST_NAME
from ckpt_lesson.files.storage import is_store_url
from ckpt_lesson.files.storage_fsspec import FsspecStorage

__all__ = ["migrate_store_object"]

#: The commit marker of a store save (runs/store_commit.py); files/ cannot import runs/.
_MARKER_NAME = "COMMIT"
#: The biggest object migrate downloads (a checkpoint file, not a data set).
MAX_MIGRATE_BYTES = 64 << 30


def _split(url: str) -> tuple[str, str]:
    head, sep, name = url.rstrip("/").rpartition("/")
    if not sep or "://" not in head or head.endswith(":/") or not name:
        raise CheckpointError(f"{url}: name an object, as s3://BUCKET/PREFIX/FILE.pt.")
    return head, name


def _download(storage: FsspecStorage, key: str, size: int, dest: Path) -> str:
    with open(dest, "xb") as out:
        got, digest = hash_chunks(storage.iter_chunks(key, size=size), DEFAULT_ALGO, into=out)
    if got != size:
        raise CheckpointError(
            f"{storage.where(key)}: changed while it was being downloaded ({got} bytes, expected {size}); "
            "nothing was changed. Stop the writer and run migrate again."
        )
    return digest


def _hash_object(storage: FsspecStorage, key: str, size: int) -> str:
    got, digest = hash_chunks(storage.iter_chunks(key, size=size), DEFAULT_ALGO)
    return digest if got == size else ""


def migrate_store_object(
    url: str, *, backup_suffix: str = DEFAULT_BACKUP_SUFFIX, storage_options: dict[str, Any] | None = None
) -> MigrationResult:
    """Rewrite an old checkpoint object in the current schema, keeping the original as ``URL + SUFFIX``.

    Args:
        url: The object, e.g. ``s3://bucket/runs/old/last.pt``.
        backup_suffix: Appended to the key for the backup object.
        storage_options: fsspec options (default: credentials and endpoint from the environment).

    Returns:
        A :class:`~ckpt_lesson.files.migrate.MigrationResult` whose ``path``
        and ``backup`` are URLs; nothing in the bucket changed when the object
        was already current.

    Raises:
        CheckpointError: Not an object URL, a part of a committed save, a backup
            with other bytes already there, or the object changed meanwhile
            (nothing replaced). Everything :func:`migrate_file` raises for the
            bytes themselves (damaged, unsafe, unknown schema, a bucket missing).
        LoadEnvironmentError: The store cannot be reached (bucket named).

    Example:
        >>> migrate_store_object("s3://my-bucket/runs/old/last.pt").backup  # doctest: +SKIP
        's3://my-bucket/runs/old/last.pt.v1.bak'
    """
    if not is_store_url(url):
        raise CheckpointError(f"{url}: not a bucket URL; migrate_file handles local files.")
    check_backup_suffix(backup_suffix)
    folder_url, name = _split(url)
    storage = FsspecStorage(folder_url, storage_options)
    backup_key = name + backup_suffix
    try:
        size, etag = storage.stat(name)
    except FileNotFoundError:
        raise CheckpointError(f"{url}: no such object; check the URL.") from None
    refuse_recorded_part(url, (MANIFEST_NAME, _MARKER_NAME), storage.exists)
    if size > MAX_MIGRATE_BYTES:
        raise CheckpointError(
            f"{url}: {size} bytes, over the {MAX_MIGRATE_BYTES}-byte cap for one checkpoint."
        )
    with tempfile.TemporaryDirectory(prefix="ckpt-lesson-migrate-") as work:
        local = Path(work) / name
        original = _download(storage, name, size, local)
        result = migrate_file(local, backup_suffix=backup_suffix)  # verified, migrated, footer added
        if not result.changed:
            return MigrationResult(url, None, result.from_schema, result.to_schema)
        _keep_backup(storage, backup_key, Path(str(local) + backup_suffix), size, original, url)
        try:
            if not storage.exists(name):  # If-Match on a vanished key would read as a missing bucket
                raise FileExistsError(name)
            new_size, new_digest = storage.put_file(name, local, condition={"IfMatch": etag})
        except FileExistsError:
            raise CheckpointError(
                f"{url}: changed while it was being migrated (another writer?); it was not replaced. "
                f"The original bytes are kept in {storage.where(backup_key)}; run migrate again."
            ) from None
        if _hash_object(storage, name, new_size) != new_digest:
            raise CorruptCheckpointError(
                f"{url}: the migrated bytes read back differ from those uploaded; the original is kept "
                f"in {storage.where(backup_key)}. Copy it back over {name} and run migrate again."
            )
    return MigrationResult(url, storage.where(backup_key), result.from_schema, result.to_schema)


def _keep_backup(storage: FsspecStorage, key: str, local: Path, size: int, digest: str, url: str) -> None:
    """Upload the original as ``key`` unless that exact backup exists; verify it by reading it back."""
    try:
        storage.put_file(key, local, algo=DEFAULT_ALGO, condition={"IfNoneMatch": "*"})
    except FileExistsError:
        existing, _ = storage.stat(key)
        if existing != size or _hash_object(storage, key, size) != digest:
            raise CheckpointError(
                f"{url}: backup {storage.where(key)} already exists with other bytes and is never "
                "overwritten; move it away or pass a different --backup-suffix. Nothing was changed."
            ) from None
        return  # an interrupted earlier run's backup of exactly these bytes: reuse it
    if _hash_object(storage, key, size) != digest:
        raise CheckpointError(
            f"{url}: the backup {storage.where(key)} reads back with other bytes; nothing was replaced. "
            "Check the store and run migrate again."
        )
