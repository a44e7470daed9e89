"""The on-disk commit protocol behind :class:`~ckpt_lesson.runs.manager.CheckpointManager`.

Everything here is about *folders*, never tensors: how a save gets a private
place to be written in, how it becomes visible in one atomic step, and how a
save (or the wreck of one) goes away without ever looking like a save halfway
through. The manager decides *what* to write and *when*; these functions make
each change to the run directory safe against a crash at any instant.

The life of one save, as folder names in ``RUN_DIR``::

    .staging-step-00000240-<pid>-<hex8>/   written here, with .lock held (open_staging)
    step-00000240/                         one os.replace publishes it (publish)
    .deleting-step-00000240-<hex8>/        retention renames it first ... (delete_save)
                                           ... then removes it

Two rules carry the whole design:

* **Only a rename changes what a reader sees.** ``os.replace`` of a folder is
  atomic, so a reader finds the old name or the new one, never a mix. Writing
  and removing happen under names no reader mistakes for a save.
* **A lock, not a pid, says who is alive.** The writer holds an exclusive
  ``flock`` on ``.lock`` for the whole save. The kernel drops it when the
  process dies, even by ``SIGKILL``, so "can I take the lock?" tells exactly
  whether a staging folder's writer is gone (:func:`writer_is_dead`).

Where a folder cannot be renamed atomically (on an object store fsspec's
``rename`` is a copy and a delete), a multi-rank save publishes by *commit
marker* instead (``publish="marker"``): its files go straight into the final
``step-XXXXXXXX/`` under a held ``.marker-lock`` (:func:`open_marker_folder`), then
the manifest (it says ``"publish": "marker"``, so a reader requires the marker),
and *last* a sealed ``commit.json`` naming the manifest's digest, step and save id
(:func:`write_commit_marker`). A reader counts the folder only when that marker names exactly the manifest
beside it (:func:`check_commit_marker`); one without it whose lock is free lost
its writer (:mod:`ckpt_lesson.runs.marker_cleanup`).
"""

from __future__ import annotations

import fcntl
import logging
import os
import shutil
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, suppress
from pathlib import Path
from typing import Any

from ckpt_lesson.errors import CheckpointError, CorruptCheckpointError, IncompleteCheckpointError
from ckpt_lesson.files.atomic import atomic_write_json, fsync_dir
from ckpt_lesson.files.hashing import hash_bytes
from ckpt_lesson.files.record_seal import seal_record, verify_record_seal
from ckpt_lesson.files.safe_read import parse_json_text, read_regular_file
from ckpt_lesson.files.side_files import open_beside
from ckpt_lesson.runs.layout import STAGING_PREFIX, inspect_save, step_of

__all__ = [
    "COMMIT_MARKER",
    "DELETING_PREFIX",
    "LOCK_NAME",
    "MARKER_LOCK",
    "MARKER_SCHEMA",
    "PUBLISH_MODES",
    "QUARANTINE_PREFIX",
    "STALE_UNLOCKED_SECONDS",
    "check_commit_marker",
    "clean_stale",
    "delete_save",
    "lock_is_free",
    "open_marker_folder",
    "open_staging",
    "publish",
    "staging_name",
    "writer_is_dead",
    "write_commit_marker",
]

# These messages are the manager's: users (and the notebooks) filter and print them under that
# logger name, so moving the code into this module must not rename where they come from.
log = logging.getLogger("ckpt_lesson.runs.manager")

LOCK_NAME = ".lock"
DELETING_PREFIX = ".deleting-"
QUARANTINE_PREFIX = ".quarantine-"
#: A staging folder with no ``.lock`` this old lost its writer between mkdir and lock creation.
STALE_UNLOCKED_SECONDS = 10.0
#: A marker-mode save's commit, written last (:func:`write_commit_marker`).
COMMIT_MARKER = "commit.json"
MARKER_SCHEMA = "ckpt.commit.dcp.v1"
_MAX_MARKER_BYTES = 64 << 10
#: Held (flock) by the writer of a marker-mode folder while it writes; free once it is gone.
MARKER_LOCK = ".marker-lock"
#: ``DistributedCheckpointManager(publish=...)``: how a finished save becomes visible.
PUBLISH_MODES = ("rename", "marker")


def staging_name(step: int) -> str:
    """A staging folder name no other writer (or earlier attempt) can collide with.

    Example:
        >>> staging_name(240).startswith(".staging-step-00000240-")
        True
    """
    return f"{STAGING_PREFIX}{step:08d}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def _aside_name(prefix: str, name: str) -> str:
    # A random suffix: the same step can be quarantined or deleted more than once in a run's life.
    return f"{prefix}{name}-{uuid.uuid4().hex[:8]}"


@contextmanager
def _locked_folder(
    folder: Path, lock_name: str, committed: Callable[[], bool], *, durable: bool = False
) -> Iterator[Path]:
    folder.mkdir()
    # Create and lock right after mkdir: an unlocked staging folder is abandoned (STALE_UNLOCKED_SECONDS).
    fd = None
    try:
        fd = open_beside(folder / lock_name, os.O_RDWR | os.O_CREAT | os.O_EXCL)
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BaseException:
        if fd is not None:
            os.close(fd)
        shutil.rmtree(folder, ignore_errors=True)
        raise
    if durable:  # a marker-mode folder is the save's final name: its entry must survive a crash
        fsync_dir(folder.parent)
    try:
        yield folder
    except BaseException:
        if not committed():  # garbage, never a save
            shutil.rmtree(folder, ignore_errors=True)
        raise
    finally:
        if committed():
            # A committed folder needs no lock, and one left behind would make a marker-mode folder
            # look like an interrupted save to cleanup if commit.json were ever lost.
            with suppress(OSError):
                os.unlink(folder / lock_name)
        os.close(fd)  # releases the flock


def open_staging(run_dir: Path, step: int) -> AbstractContextManager[Path]:
    """A fresh staging folder for ``step``, its ``.lock`` held until the block ends.

    If the block raises anything (an error, Ctrl-C), the staging folder is
    removed: it is garbage, never a save. The lock is released either way.

    Args:
        run_dir: The run directory (must exist).
        step: The step being saved; it goes into the folder's name.

    Yields:
        The staging folder's path.

    Raises:
        OSError: The folder or its lock cannot be created (nothing is left behind).

    Example:
        >>> with open_staging(run_dir, 240) as staging:  # doctest: +SKIP
        ...     write_parts(staging)
        ...     publish(staging, run_dir / "step-00000240")
    """
    # Never "committed" here: publish() renames the folder away and removes the .lock itself.
    return _locked_folder(run_dir / staging_name(step), LOCK_NAME, lambda: False)


def open_marker_folder(final: Path) -> AbstractContextManager[Path]:
    """Create the final folder of a marker-mode save and hold its ``.marker-lock`` while writing.

    If the block raises before the marker exists, the folder is removed (it was
    never a save); after the marker it is a committed save and is kept.

    Raises:
        FileExistsError: The folder exists (the caller moves a damaged one aside first).

    Example:
        >>> with open_marker_folder(run / "step-00000040") as folder:  # doctest: +SKIP
        ...     write_everything(folder)
    """
    return _locked_folder(final, MARKER_LOCK, (final / COMMIT_MARKER).exists, durable=True)


def publish(staging: Path, final: Path, *, on_quarantined: Callable[[Path], None] | None = None) -> Path:
    """Make a finished staging folder the save ``final`` with one atomic rename.

    A folder already at ``final`` that verifies is never replaced. One that does
    not (corrupt or incomplete) is renamed aside to ``.quarantine-...`` first,
    kept for inspection rather than deleted, and ``on_quarantined(aside)`` is called.
    After the rename the parent directory is fsynced, so the save survives a
    power loss, and the no longer needed ``.lock`` file is removed.

    Args:
        staging: The complete staging folder (parts and manifest written and fsynced).
        final: Where the save goes, e.g. ``RUN_DIR/step-00000240``.
        on_quarantined: Called with the quarantine path when a damaged save was moved aside.

    Returns:
        ``final``.

    Raises:
        CheckpointError: A good save of that step already exists (another writer made it).

    Example:
        >>> publish(staging, run_dir / "step-00000240")  # doctest: +SKIP
    """
    run_dir = final.parent
    if final.exists():
        if inspect_save(final)[0].ok:
            raise CheckpointError(
                f"step {step_of(final.name)} was saved by another writer meanwhile ({final}); "
                "not replacing it."
            )
        aside = run_dir / _aside_name(QUARANTINE_PREFIX, final.name)
        os.replace(final, aside)
        log.warning(
            "%s was corrupt or incomplete; moved it aside to %s, publishing the new save",
            final,
            aside.name,
        )
        if on_quarantined is not None:
            on_quarantined(aside)
    os.replace(staging, final)
    fsync_dir(run_dir)
    (final / LOCK_NAME).unlink(missing_ok=True)  # still held via the caller's fd; no longer needed
    return final


def delete_save(src: Path, *, on_renamed: Callable[[Path], None] | None = None) -> bool:
    """Remove one save (or a dead writer's folder): rename it out of sight first, then delete the files.

    The rename is atomic, so a kill during the (slow) ``rmtree`` leaves a
    ``.deleting-`` folder for :func:`clean_stale`, never a half-deleted folder
    that still looks like a save. Failures are logged, not raised: a save that
    cannot be deleted must not stop training. ``on_renamed(aside)`` is called
    between the rename and the removal.

    Returns:
        True once the save is no longer visible (even if removing its files failed).

    Example:
        >>> delete_save(run_dir / "step-00000040")  # doctest: +SKIP
        True
    """
    run_dir = src.parent
    doomed = run_dir / _aside_name(DELETING_PREFIX, src.name)
    try:
        os.replace(src, doomed)
    except OSError as exc:
        log.warning("could not delete %s (%s); training goes on, retention will retry", src.name, exc)
        return False
    if on_renamed is not None:
        on_renamed(doomed)
    try:
        fsync_dir(run_dir)
        # Another cleaner (clean_stale of a manager opened meanwhile) may be removing the same
        # leftover: a file it removed first is not a failure, the folder goes either way.
        shutil.rmtree(doomed, onerror=_gone_is_fine)
    except OSError as exc:
        log.warning("could not remove %s (%s); training goes on; delete it by hand", doomed.name, exc)
    return True


def _gone_is_fine(func: object, path: str, exc_info: tuple[type, BaseException, object]) -> None:
    if not isinstance(exc_info[1], FileNotFoundError):
        raise exc_info[1]


def clean_stale(run_dir: Path, *, spare_pid: int | None = None) -> list[str]:
    """Remove staging folders of dead writers and leftover ``.deleting-`` folders.

    A staging folder goes only when :func:`writer_is_dead`; one a live writer holds is never touched.

    ``spare_pid``: skip staging folders that process made. A cleaner running on
    a background thread passes its own pid: a save of its own process may have
    created its staging folder and not yet locked it, and the cleaner's probe of
    that lock would both make the save's own lock fail and call it abandoned.

    Returns:
        Names of the folders removed.

    Example:
        >>> clean_stale(run_dir)  # doctest: +SKIP
        ['.staging-step-00000280-4242-0f3a9c1e']
    """
    removed = []
    # Only the names starting with a dot can be ours to clean: filter on the name first, so a run
    # directory of 10,000 saves costs one listing, not a stat per save (scandir gives the kind).
    with os.scandir(run_dir) as listing:
        hidden = sorted(e.name for e in listing if e.name.startswith(".") and e.is_dir(follow_symlinks=False))
    for entry in (run_dir / name for name in hidden):
        if entry.name.startswith(DELETING_PREFIX):
            shutil.rmtree(entry, ignore_errors=True)
            removed.append(entry.name)
        elif not entry.name.startswith(STAGING_PREFIX) or f"-{spare_pid}-" in entry.name:
            continue  # not a staging folder, or this process's own save (perhaps between mkdir and flock)
        elif writer_is_dead(entry) and delete_save(entry):
            log.info("removed %s: its writer is gone (an interrupted save)", entry.name)
            removed.append(entry.name)
    return removed


def writer_is_dead(staging: Path) -> bool:
    """True if nobody holds ``staging/.lock`` (or there is no lock and the folder is old).

    Example:
        >>> writer_is_dead(run_dir / ".staging-step-00000280-4242-0f3a9c1e")  # doctest: +SKIP
        True
    """
    if not os.path.lexists(staging / LOCK_NAME):
        try:
            return time.time() - staging.stat().st_mtime > STALE_UNLOCKED_SECONDS
        except FileNotFoundError:
            return False
    return lock_is_free(staging / LOCK_NAME)


def lock_is_free(path: Path) -> bool:
    """True when ``path`` is a regular lock file nobody holds (``False`` when missing or odd).

    Example:
        >>> lock_is_free(run / "step-00000040" / MARKER_LOCK)  # doctest: +SKIP
        True
    """
    try:
        fd = open_beside(path, os.O_RDWR)
    except (OSError, CheckpointError):  # gone, or a FIFO or symlink at the lock: not ours to judge
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except OSError:  # BlockingIOError: a live process holds it
        return False
    finally:
        os.close(fd)  # closing releases the lock we may have taken


def write_commit_marker(folder: Path, manifest: dict[str, Any], manifest_raw: bytes) -> None:
    """Write ``folder/commit.json`` naming the manifest's digest, durably: the save's commit.

    Args:
        folder: The save folder, manifest already written and fsynced.
        manifest: The manifest (for its step, save id and algorithm).
        manifest_raw: The manifest file's exact bytes.

    Example:
        >>> write_commit_marker(run / "step-00000040", manifest, raw)  # doctest: +SKIP
    """
    algo = manifest["parts"][0]["algo"]
    marker = {
        "schema": MARKER_SCHEMA,
        "step": manifest["step"],
        "save_id": manifest["save_id"],
        "manifest": hash_bytes(manifest_raw, algo),
    }
    atomic_write_json(seal_record(marker), folder / COMMIT_MARKER)  # fsyncs the file and the folder


def check_commit_marker(folder: Path, manifest: dict[str, Any], manifest_raw: bytes) -> None:
    """Refuse a marker-mode save whose marker is missing or does not name this manifest.

    Raises:
        IncompleteCheckpointError: No marker: the save never finished.
        CorruptCheckpointError: The marker is unreadable, unsealed or damaged, or
            names another step, save or manifest digest.

    Example:
        >>> check_commit_marker(folder, manifest, raw)  # doctest: +SKIP
    """
    where = f"{folder.name}/{COMMIT_MARKER}"
    try:
        data = read_regular_file(folder / COMMIT_MARKER, limit=_MAX_MARKER_BYTES, what="commit marker")
    except FileNotFoundError:
        raise IncompleteCheckpointError(
            f"{folder.name}: no {COMMIT_MARKER}; this save publishes by commit marker, which is written "
            "last, so the save never finished. Restore an older save (restore_latest falls back)."
        ) from None
    marker = parse_json_text(data, where=where)
    if not isinstance(marker, dict) or "record_digest" not in marker:
        raise CorruptCheckpointError(f"{where}: not a sealed commit marker; restore an older save.")
    verify_record_seal(marker, where=where, legacy_keys=())
    named = marker.get("manifest")
    if marker.get("schema") != MARKER_SCHEMA or not isinstance(named, dict) or "algo" not in named:
        raise CorruptCheckpointError(f"{where}: not a {MARKER_SCHEMA} record; restore an older save.")
    try:
        found = hash_bytes(manifest_raw, named["algo"])
    except CheckpointError as exc:  # an algorithm name we do not know: the marker is not ours
        raise CorruptCheckpointError(f"{where}: names an unknown algorithm ({exc}).") from exc
    same_save = (marker.get("step"), marker.get("save_id")) == (manifest["step"], manifest["save_id"])
    if not same_save or named != found:
        raise CorruptCheckpointError(
            f"{where}: names manifest {str(named.get('digest'))[:12]}... of step {marker.get('step')}, but "
            f"manifest.json here is {found['digest'][:12]}... of step {manifest['step']}; the marker commits "
            "another save's files, so this one is not committed. Restore an older save."
        )
