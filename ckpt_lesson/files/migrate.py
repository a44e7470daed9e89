"""Migrating checkpoint *files* from an old schema to the current one.

:mod:`ckpt_lesson.files.schema` already lifts an old payload *in memory* every time
one is loaded, so an old file never stops working. Rewriting the file on disk
is still worth doing once: the lesson's original (v1) files carry no integrity
record, so a flipped byte in them loads silently as different weights. A
migrated file is written by :func:`~ckpt_lesson.files.atomic.atomic_save`, which adds
the in-file sha256 footer.

The rewrite is careful in the same way as a save:

1. read and verify the file, migrate the payload in memory, and check that
   every bucket a resume needs is there (nothing on disk has changed yet);
2. keep the original bytes as a backup next to it (a hard link when the file
   system allows, else an fsynced copy) and never overwrite an existing backup;
3. atomically replace the file with the migrated payload.

A kill at any moment leaves either the old file or the new one at ``path``,
and the original bytes are always somewhere; running the migration again
finishes an interrupted one.

It also keeps :func:`write_legacy_v1_checkpoint`, the lesson's original *naive* save.

Command line::

    python -m ckpt_lesson migrate runs/old/last.pt
"""

from __future__ import annotations

import os
import shutil
import stat
import time
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ckpt_lesson.errors import CheckpointError, CorruptCheckpointError, StateMismatchError
from ckpt_lesson.files import schema
from ckpt_lesson.files.atomic import atomic_save, fsync_dir, is_temp_file
from ckpt_lesson.files.checkpoint import BUCKETS, TrainState, load_verified_file
from ckpt_lesson.files.integrity import FileDigest, file_digest
from ckpt_lesson.files.rng import capture_rng_state
from ckpt_lesson.files.schema import MANIFEST_NAME
from ckpt_lesson.files.shard_index import INDEX_NAME
from ckpt_lesson.short_repr import short_repr

__all__ = [
    "DEFAULT_BACKUP_SUFFIX",
    "MigrationResult",
    "migrate_file",
    "write_legacy_v1_checkpoint",
]

#: Appended to the file name to name the backup of the original bytes.
DEFAULT_BACKUP_SUFFIX = ".v1.bak"


@dataclass(frozen=True)
class MigrationResult:
    """What :func:`migrate_file` did.

    Also what :func:`~ckpt_lesson.files.store_migrate.migrate_store_object`
    did to an object in a bucket: then ``path`` and ``backup`` are URLs.

    Attributes:
        path: The checkpoint file (now in ``to_schema``).
        backup: Where the original bytes were kept, or ``None`` when nothing
            was changed (the file was already current).
        from_schema: The schema the file had.
        to_schema: The schema it has now.
    """

    __repr__ = short_repr  # one short line: see ckpt_lesson/short_repr.py

    path: Path | str
    backup: Path | str | None
    from_schema: str
    to_schema: str

    @property
    def changed(self) -> bool:
        """True when the file was rewritten."""
        return self.backup is not None


def write_legacy_v1_checkpoint(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    state: TrainState,
    path: str | os.PathLike[str],
) -> Path:
    """Write a checkpoint exactly as the lesson's ORIGINAL code did (naive, do not use).

    This exists so that tests and notebook 09 have genuine ``ckpt.v1`` files to
    read and migrate. It repeats the original's two weaknesses on purpose:
    a plain ``torch.save`` straight onto the target (a kill mid-write leaves
    a truncated file under the real name) and no integrity record (a flipped
    byte loads silently). Use :func:`~ckpt_lesson.files.checkpoint.save_checkpoint`
    for real saves.

    Args:
        model: The live model.
        optimizer: The live optimizer.
        scheduler: The live scheduler, or ``None``.
        state: Counters and loss history.
        path: Target file; its directory must exist.

    Returns:
        ``path`` as a :class:`~pathlib.Path`.

    Raises:
        CheckpointError: ``state`` is not a :class:`TrainState`.

    Example:
        >>> write_legacy_v1_checkpoint(model, opt, sched, TrainState(step=5), "old.pt")  # doctest: +SKIP
    """
    if not isinstance(state, TrainState):
        raise CheckpointError(f"state must be a TrainState, got {type(state).__name__}.")
    payload = {
        "schema": schema.SCHEMA_V1,
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "scheduler": None if scheduler is None else scheduler.state_dict(),
        "state": state.to_dict(),
        "rng": capture_rng_state(),
        "wall_saved_at": time.time(),
        "extras": None,
    }
    path = Path(path)
    torch.save(payload, path)  # naive on purpose: not atomic, not fsynced, no footer
    return path


def migrate_file(
    path: str | os.PathLike[str], *, backup_suffix: str = DEFAULT_BACKUP_SUFFIX
) -> MigrationResult:
    """Rewrite an old checkpoint file in the current schema, keeping a backup.

    Args:
        path: A single-file checkpoint (``.pt``).
        backup_suffix: Appended to the file name for the backup of the
            original bytes (``last.pt`` -> ``last.pt.v1.bak``).

    A backup that already exists is never overwritten. The one exception is
    not an overwrite: if it holds exactly the bytes of ``path`` (an earlier run
    was killed between making the backup and replacing the file), it is kept
    and reused, so rerunning is the way to finish an interrupted migration.
    Tensors are loaded to CPU and written back as CPU tensors; loading maps
    them to the requested device anyway.

    Returns:
        A :class:`MigrationResult`; ``backup`` is ``None`` and nothing on disk
        changed when the file was already current.

    Raises:
        CheckpointError: ``path`` is missing, a directory, a symlink, or the
            backup name already exists with other bytes (never overwritten).
        CorruptCheckpointError: The file is damaged, not a ``torch.save``
            archive, or a current-schema file has lost its integrity footer.
        UnsafeCheckpointError: The weights-only loader refused it.
        SchemaError: No schema field, an unknown schema, or one newer than
            this code.
        StateMismatchError: The payload lacks a bucket a resume needs.

    Example:
        >>> result = migrate_file("runs/old/last.pt")  # doctest: +SKIP
        >>> result.from_schema, result.to_schema, result.backup.name  # doctest: +SKIP
        ('ckpt.v1', 'ckpt.v2', 'last.pt.v1.bak')
    """
    path = Path(path)
    _check_target(path)
    check_backup_suffix(backup_suffix)
    backup = path.with_name(path.name + backup_suffix)

    # Step 1: everything that can fail is checked before anything on disk changes.
    payload, digest = load_verified_file(path)
    original = payload.get("schema") if isinstance(payload, dict) else None
    migrated = schema.migrate_payload(payload, source=str(path))
    current = schema.CURRENT_SCHEMA  # read at call time: tests register a fake v3
    if original == current:
        if not digest.has_footer:
            raise CorruptCheckpointError(
                f"{path}: a {current} checkpoint without its integrity footer; its end was damaged "
                "or it was rewritten by other code. Adding a footer now would bless damaged bytes, "
                "so migrate refuses; restore an older checkpoint."
            )
        return MigrationResult(path, None, str(original), current)
    refuse_recorded_part(path, (MANIFEST_NAME, INDEX_NAME), lambda record: (path.parent / record).exists())
    missing = [b for b in BUCKETS if b not in migrated]
    if missing:
        raise StateMismatchError(
            f"{path}: checkpoint lacks {missing}, so even a migrated file could not resume "
            "training. Nothing was changed."
        )
    # Step 2: keep the original bytes, and make sure they are the bytes we just read (an identical
    # backup is an interrupted run's: reused, see the docstring).
    if not _is_backup_of(backup, digest):
        if backup.exists() or backup.is_symlink():
            raise _backup_exists(path, backup)
        _make_backup(path, backup)
        if not _is_backup_of(backup, digest):
            backup.unlink(missing_ok=True)
            raise CheckpointError(
                f"{path}: the file changed while it was being migrated (another process is writing "
                "it?); nothing was migrated. Stop the writer and run migrate again."
            )

    # Step 3: one atomic replace; the footer is the integrity record v1 lacked.
    atomic_save(migrated, path)
    return MigrationResult(path, backup, str(original), current)


def check_backup_suffix(suffix: str) -> None:
    """Refuse a backup suffix that is empty or would put the backup in another folder."""
    if not suffix or "/" in suffix or os.sep in suffix:
        raise CheckpointError(
            f"backup suffix {suffix!r} must be a non-empty file-name suffix like '.v1.bak'."
        )


def _is_backup_of(backup: Path, digest: FileDigest) -> bool:
    """True when ``backup`` is a regular file holding exactly the bytes ``digest`` describes."""
    if backup.is_symlink() or not backup.is_file():
        return False
    try:
        return file_digest(backup, algo=digest.algo).digest == digest.digest
    except CheckpointError:  # a damaged footer in whatever is there: not our backup
        return False


def refuse_recorded_part(where: Any, records: tuple[str, ...], exists: Callable[[str], bool]) -> None:
    """Refuse a file (or object) that a record beside it (manifest, shard index, commit marker) pins.

    Rewriting such a file changes its bytes, so the record would no longer
    match and every scan and restore would call the whole save corrupt.
    """
    for record in records:
        if exists(record):
            raise CheckpointError(
                f"{where}: is one part of a save recorded in {record}, which pins its digest; "
                "rewriting it would make that save fail verification. Nothing was changed. Such "
                "files are migrated in memory on every load; to upgrade them on disk, restore "
                "and save again through the CheckpointManager."
            )


def _check_target(path: Path) -> None:
    if path.is_symlink():
        raise CheckpointError(
            f"{path}: is a symbolic link; migrate the file it points to ({os.path.realpath(path)}) "
            "so the link keeps pointing at the migrated file."
        )
    if path.is_dir():
        raise CheckpointError(
            f"{path}: is a directory; migrate works on single checkpoint files, e.g. "
            f"{path / 'checkpoint.pt'}."
        )
    if not path.exists():
        raise CheckpointError(f"{path}: no such checkpoint file; check the path.")
    if is_temp_file(path):
        raise CheckpointError(f"{path}: is the temp file of an unfinished save, not a checkpoint.")
    if not stat.S_ISREG(path.stat().st_mode):
        # A device never ends (the zero device reads forever) and a FIFO blocks: refuse at once.
        raise CheckpointError(
            f"{path}: is not a regular file (a device, pipe or socket); nothing was changed."
        )
    if not zipfile.is_zipfile(path):
        # Checked up front for a clear message: torch.load would try a text file as a legacy
        # pickle and report it as unsafe, which is true but not the helpful diagnosis.
        raise CorruptCheckpointError(
            f"{path}: not a torch.save archive (no zip structure); it is not a checkpoint, or its "
            "end was cut off. Nothing was changed."
        )


def _backup_exists(path: Path, backup: Path) -> CheckpointError:
    return CheckpointError(
        f"{path}: backup {backup.name} already exists and is never overwritten; move it away "
        "or pass a different --backup-suffix. Nothing was changed."
    )


def _make_backup(path: Path, backup: Path) -> None:
    """Keep ``path``'s bytes under ``backup``; refuse if ``backup`` exists.

    A hard link costs no space and no copying, and it is safe here because the
    migrated file replaces ``path`` with a *new* file (``os.replace``), so the
    link keeps the old bytes. Where hard links are not allowed, copy instead.
    Both paths create ``backup`` exclusively, so a backup is never overwritten
    even if one appears between our check and now.
    """
    try:
        os.link(path, backup)
    except FileExistsError as exc:
        raise _backup_exists(path, backup) from exc
    except OSError:
        try:
            with open(path, "rb") as src, open(backup, "xb") as dst:
                os.fchmod(
                    dst.fileno(), stat.S_IMODE(os.fstat(src.fileno()).st_mode)
                )  # a private file stays private
                shutil.copyfileobj(src, dst, length=1 << 20)
                dst.flush()
                os.fsync(dst.fileno())
        except FileExistsError as exc:
            raise _backup_exists(path, backup) from exc
        except BaseException:
            backup.unlink(missing_ok=True)
            raise
    fsync_dir(backup.parent)
