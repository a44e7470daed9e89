"""A commit record for a folder written by someone else (a Hugging Face ``checkpoint-N``).

Our own saves publish a folder by renaming it into place once its manifest is
written. A trainer we do not control writes its files straight into the final
folder, one after another, and never fsyncs them; a kill half-way leaves a
folder with the right name and some of the files. We cannot change *how* it
writes, but we can decide *what counts*: after the trainer says the save is
done, :func:`write_folder_manifest`

1. fsyncs every file (the trainer did not), hashing it in the same read;
2. fsyncs the folder (and any sub-folder), so the names are durable;
3. writes ``ckpt_lesson_manifest.json`` atomically, **last**: every file's
   relative path, size and digest (xxh3-128 by default, the algorithm named;
   manifests from earlier versions record sha256 and still verify);
4. fsyncs the parent, so the folder itself survives a power cut.

A folder counts as a save only if its manifest exists and every listed file
has its recorded size and digest, and nothing unlisted was added after it.
:func:`latest_verified_folder` walks the folders newest first and returns the
first that passes, logging why each newer one was skipped.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from ckpt_lesson.errors import CheckpointError, CorruptCheckpointError
from ckpt_lesson.files.atomic import atomic_write_json, fsync_dir, is_temp_file
from ckpt_lesson.files.hashing import DEFAULT_ALGO, hash_chunks, hash_file, part_digest, record_fields
from ckpt_lesson.files.safe_read import parse_json_text, read_regular_file
from ckpt_lesson.files.schema import CHECKPOINT_DIR_RE, check_recorded_step
from ckpt_lesson.files.storage_base import is_plain_key

__all__ = [
    "FOLDER_MANIFEST_NAME",
    "FOLDER_MANIFEST_SCHEMA",
    "checkpoint_folder_step",
    "latest_verified_folder",
    "verify_folder",
    "write_folder_manifest",
]

log = logging.getLogger(__name__)

#: Written last into each folder it vouches for.
FOLDER_MANIFEST_NAME = "ckpt_lesson_manifest.json"
FOLDER_MANIFEST_SCHEMA = "ckpt.folder-manifest.v1"
_MAX_MANIFEST_BYTES = 16 << 20
_CHUNK = 1 << 20


def checkpoint_folder_step(name: str) -> int | None:
    """The step of a Hugging Face folder name (``checkpoint-500`` -> 500), else ``None``."""
    found = CHECKPOINT_DIR_RE.match(name)
    return int(found.group(1)) if found else None


def _files_in(folder: Path) -> list[Path]:
    """Every regular file under ``folder`` (relative paths), manifest and our temp files excluded."""
    found = []
    for path in sorted(folder.rglob("*")):
        rel = path.relative_to(folder)
        if path.is_symlink():
            raise CheckpointError(f"{folder.name}/{rel}: is a symlink; a save folder holds its own files.")
        if path.is_file() and rel.as_posix() != FOLDER_MANIFEST_NAME and not is_temp_file(path):
            found.append(rel)
    return found


def write_folder_manifest(
    folder: str | os.PathLike[str], *, step: int | None = None, algo: str = DEFAULT_ALGO
) -> dict[str, Any]:
    """Make a finished folder durable and record every file's size and digest, manifest last.

    Args:
        folder: A folder whose writer has finished (e.g. ``checkpoint-500``).
        step: Recorded in the manifest; defaults to the number in the folder's name.
        algo: Hash of every entry (``sha256`` or ``blake3`` where a digest is pinned elsewhere).

    Returns:
        The manifest written.

    Raises:
        CheckpointError: ``folder`` is missing, holds a symlink, or holds no files.

    Example:
        >>> write_folder_manifest("out/checkpoint-500")["files"][0]["file"]  # doctest: +SKIP
        'config.json'
    """
    folder = Path(folder)
    if not folder.is_dir():
        raise CheckpointError(f"{folder}: no such folder to record; was the save written elsewhere?")
    files = _files_in(folder)
    if not files:
        raise CheckpointError(f"{folder.name}: holds no files; nothing to record as a save.")
    entries = []
    for rel in files:
        with open(folder / rel, "rb") as f:
            size, digest = hash_chunks(iter(lambda: f.read(_CHUNK), b""), algo)
            # fsync through a read-only descriptor flushes the file's dirty pages all the same on Linux.
            os.fsync(f.fileno())
        entries.append({"file": rel.as_posix(), "bytes": size, **record_fields(algo, digest)})
    for sub in sorted({(folder / rel).parent for rel in files}, key=lambda p: -len(p.parts)):
        fsync_dir(sub)
    manifest = {
        "schema": FOLDER_MANIFEST_SCHEMA,
        "step": step if step is not None else checkpoint_folder_step(folder.name),
        "files": entries,
    }
    atomic_write_json(manifest, folder / FOLDER_MANIFEST_NAME)  # last: from here on the save counts
    fsync_dir(folder.parent)
    return manifest


def _read(folder: Path) -> tuple[dict[str, Any] | None, str]:
    path = folder / FOLDER_MANIFEST_NAME
    if path.is_symlink() or not path.is_file():
        return None, f"no {FOLDER_MANIFEST_NAME} (the save never finished, or no callback recorded it)"
    try:
        # The one bounded reader (safe_read.py): over the cap, EIO, deep nesting, a swapped-in FIFO: damage.
        raw = read_regular_file(path, limit=_MAX_MANIFEST_BYTES, what="folder manifest")
        manifest = parse_json_text(raw, where=f"{folder.name}/{FOLDER_MANIFEST_NAME}")
    except (OSError, CheckpointError) as exc:
        return None, f"{FOLDER_MANIFEST_NAME}: unreadable ({str(exc)[:160]})"
    if not isinstance(manifest, dict) or manifest.get("schema") != FOLDER_MANIFEST_SCHEMA:
        return None, f"{FOLDER_MANIFEST_NAME}: not a {FOLDER_MANIFEST_SCHEMA} manifest"
    try:
        check_recorded_step(manifest.get("step"), folder, record=FOLDER_MANIFEST_NAME)
    except CheckpointError as exc:
        return None, str(exc)
    files = manifest.get("files")
    if not isinstance(files, list) or not files:
        return None, f"{FOLDER_MANIFEST_NAME}: 'files' must be a non-empty list"
    for entry in files:
        name = entry.get("file") if isinstance(entry, dict) else None
        # Data can be hostile: a listed name may only point inside the folder.
        plain = isinstance(name, str) and is_plain_key(name) and "\x00" not in name
        if not plain or not isinstance(entry.get("bytes"), int) or not _has_digest(entry):
            return None, f"{FOLDER_MANIFEST_NAME}: malformed entry {str(entry)[:80]}"
    return manifest, ""


def _has_digest(entry: dict[str, Any]) -> bool:
    try:
        part_digest(entry)  # {"algo", "digest"}, or {"sha256"} from earlier versions
    except CorruptCheckpointError:
        return False
    return True


def verify_folder(folder: str | os.PathLike[str]) -> str | None:
    """Check a folder against its manifest; ``None`` when it verifies, else the first reason it does not.

    Sizes are compared first (a ``stat`` each); only then is every file read once and hashed.

    Example:
        >>> verify_folder("out/checkpoint-500")  # doctest: +SKIP
        'optimizer.pt: size 1024 != recorded 5120'
    """
    folder = Path(folder)
    manifest, reason = _read(folder)
    if manifest is None:
        return reason
    listed = {e["file"]: e for e in manifest["files"]}
    try:
        present = {rel.as_posix() for rel in _files_in(folder)}
    except CheckpointError as exc:
        return str(exc)
    extra = sorted(present - set(listed))
    if extra:
        return f"{extra[0]}: not in the manifest (written after the save was recorded)"
    for name, entry in listed.items():
        path = folder / name
        if name not in present:
            return f"{name}: missing"
        if path.stat().st_size != entry["bytes"]:
            return f"{name}: size {path.stat().st_size} != recorded {entry['bytes']}"
    for name, entry in listed.items():
        algo, want = part_digest(entry)
        try:
            found = hash_file(folder / name, algo)[1]["digest"]
        except OSError as exc:  # EIO on a bad sector: this copy is damaged, not a crash
            return f"{name}: unreadable ({exc.strerror or type(exc).__name__})"
        except CheckpointError as exc:  # swapped for a symlink or a FIFO since it was listed
            return str(exc)
        if found != want:
            return f"{name}: {algo} {found[:12]}... != recorded {want[:12]}..."
    return None


def latest_verified_folder(output_dir: str | os.PathLike[str]) -> Path | None:
    """The highest-numbered ``checkpoint-N`` folder in ``output_dir`` that verifies, or ``None``.

    Each newer folder that fails is skipped with a warning on this module's
    logger naming the folder and the reason.

    Raises:
        CheckpointError: ``output_dir`` is not a directory.

    Example:
        >>> latest_verified_folder("out")  # doctest: +SKIP
        PosixPath('out/checkpoint-400')
    """
    output_dir = Path(output_dir)
    if not output_dir.is_dir():
        raise CheckpointError(f"{output_dir}: no such output directory; pass the Trainer's output_dir.")
    found = []
    for entry in output_dir.iterdir():
        step = checkpoint_folder_step(entry.name)
        if step is not None and entry.is_dir() and not entry.is_symlink():
            found.append((step, entry))
    for _, folder in sorted(found, reverse=True):
        reason = verify_folder(folder)
        if reason is None:
            return folder
        log.warning("skipping %s: %s", folder.name, reason)
    return None
