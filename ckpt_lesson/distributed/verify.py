"""Stage 1 of a distributed restore: every rank verifies its share of a save, and all reach one verdict.

See :mod:`.reader` for both stages. The folder and the store differ only in
where the bytes come from (:class:`FolderSave`, :class:`StoreSave`); the
findings, their exchange and the verdict are one path.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint.metadata import Metadata

from ckpt_lesson.errors import (
    CheckpointError,
    CorruptCheckpointError,
    IncompleteCheckpointError,
    LoadEnvironmentError,
    UnsafeCheckpointError,
)
from ckpt_lesson.files.hashing import hash_bytes
from ckpt_lesson.files.safe_read import read_regular_file
from ckpt_lesson.files.storage import Storage
from ckpt_lesson.runs.dcp_manifest import METADATA_FILE, check_dcp_part, read_dcp_manifest
from ckpt_lesson.runs.layout import step_dir_name
from ckpt_lesson.runs.store_restore import read_committed_manifest

from .comm import Comm
from .safe_metadata import load_metadata_bytes

__all__ = ["FolderSave", "StoreSave", "VerifiedSave", "fetch_part", "verify_save"]


@dataclass(frozen=True)
class VerifiedSave:
    """A save every rank agreed is intact.

    Attributes:
        folder: The save's folder, or its URL (``.../step-XXXXXXXX/<save_id>``) in a store.
        manifest: The parsed manifest.
        metadata: DCP's metadata, parsed from the verified bytes.
        sizes: Every listed file (``.metadata`` included) -> its size.
        storage: A store's save: its objects are read through it (``None`` for a folder).
        attempt: A store's save: the key prefix of its objects.
        verified: A store's save: file name -> the bytes this rank downloaded and hashed.
    """

    folder: Path | str
    manifest: dict[str, Any]
    metadata: Metadata
    sizes: dict[str, int]
    storage: Storage | None = None
    attempt: str = ""
    verified: dict[str, bytes] = field(default_factory=dict, compare=False, repr=False)


class FolderSave:
    """Where a folder's save is read from: files hashed as they stream from disk."""

    differ = "is the file system shared?"  # the likely cause when ranks read different manifests
    storage, attempt = None, ""  # what only a store's VerifiedSave carries

    def __init__(self, folder: str | os.PathLike[str], comm: Comm) -> None:
        self.folder, self.comm = Path(folder), comm
        self.name = self.where = self.folder.name

    def read_manifest(self) -> tuple[dict[str, Any], bytes]:
        return read_dcp_manifest(self.folder)

    def read_part(self, part: dict[str, Any], *, keep: bool) -> bytes | None:
        """Check one listed file; ``keep``: return its bytes (``.metadata``, parsed from what was hashed)."""
        problem = check_dcp_part(self.folder, part, hash_it=not keep)  # stat + size first
        if problem is None and keep:
            # Through the one bounded reader: EIO (a bad sector) is damage to this copy, not a crash
            # on one rank while the others wait in a collective.
            path = self.folder / part["file"]
            try:
                data = read_regular_file(path, limit=part["bytes"], what="DCP .metadata")
            except (OSError, CheckpointError) as exc:  # which rank: EIO may hit one node only
                problem = _on_rank(
                    self.comm, f"{part['file']}: unreadable ({str(exc).replace(f'{path}: ', '')[:200]})"
                )
            else:
                if len(data) == part["bytes"] and hash_bytes(data, part["algo"])["digest"] == part["digest"]:
                    return data
                problem = f"{part['file']}: changed while it was being verified"
        if problem is not None:
            raise (IncompleteCheckpointError if problem.endswith(": missing") else CorruptCheckpointError)(
                problem
            )
        return None


class StoreSave:
    """Where a store's committed save of ``step`` is read from: objects downloaded, hashed and kept."""

    differ = "two commits of one step?"

    def __init__(self, storage: Storage, step: int) -> None:
        self.storage, self.step, self.attempt, self.folder = storage, step, "", ""  # read_manifest sets them
        self.name, self.where = step_dir_name(step), storage.where(step_dir_name(step))

    def read_manifest(self) -> tuple[dict[str, Any], bytes]:
        # The marker names this step; the manifest matches its digest and seal, and is a multi-rank one.
        manifest, raw, self.attempt = read_committed_manifest(self.storage, self.step, multi_rank=True)
        self.folder = self.storage.where(self.attempt)
        return manifest, raw

    def read_part(self, part: dict[str, Any], *, keep: bool) -> bytes:
        return fetch_part(self.storage, self.attempt, part)


def fetch_part(storage: Storage, attempt: str, part: dict[str, Any]) -> bytes:
    """Download one listed object whole and check its size and digest.

    Raises:
        IncompleteCheckpointError: The object is missing (deleted during the restore, or never uploaded).
        CorruptCheckpointError: Its size or digest differs from the manifest.
        LoadEnvironmentError: The store cannot be reached.

    Example:
        >>> data = fetch_part(store, "step-00000040/5be0c1", manifest["parts"][0])  # doctest: +SKIP
    """
    key = f"{attempt}/{part['file']}"
    try:
        data = storage.read_bytes(key, limit=part["bytes"])
    except FileNotFoundError:
        raise IncompleteCheckpointError(f"{part['file']}: missing") from None
    except LoadEnvironmentError:
        raise
    except CheckpointError:  # longer than recorded: read_bytes refuses past the cap
        raise CorruptCheckpointError(
            f"{part['file']}: larger than the recorded {part['bytes']} bytes"
        ) from None
    if len(data) != part["bytes"]:
        raise CorruptCheckpointError(f"{part['file']}: size {len(data)} != recorded {part['bytes']}")
    found = hash_bytes(data, part["algo"])["digest"]
    if found != part["digest"]:
        raise CorruptCheckpointError(
            f"{part['file']}: {part['algo']} {found[:12]}... != recorded {part['digest'][:12]}..."
        )
    return data


def _on_rank(comm: Comm, problem: str) -> str:
    # Which rank saw it: EIO may hit one node only, and every rank reports the gathered finding.
    return f"rank {comm.rank}: {problem}" if comm.world_size > 1 else problem


def _note(findings: dict[str, Any], exc: CheckpointError) -> None:
    # "missing" (the save never finished) and "problems" (damage) are kept apart: the caller's
    # error type, IncompleteCheckpointError or CorruptCheckpointError, depends on which it was.
    findings["missing" if isinstance(exc, IncompleteCheckpointError) else "problems"].append(str(exc))


def _local_findings(source: FolderSave | StoreSave, comm: Comm) -> tuple[dict[str, Any], VerifiedSave | None]:
    """This rank's view: manifest fingerprint, problems found, and the save as this rank verified it."""
    findings: dict[str, Any] = {"manifest": None, "missing": [], "problems": [], "unsafe": None, "env": None}
    try:
        manifest, raw = source.read_manifest()
    except IncompleteCheckpointError as exc:
        findings["missing"] = [str(exc)]
        return findings, None
    findings["manifest"] = hash_bytes(raw)["digest"]
    parts = {p["file"]: p for p in manifest["parts"]}
    data_files = {name: p["bytes"] for name, p in parts.items() if name != METADATA_FILE}
    metadata, kept = None, {}
    try:  # .metadata: every rank reads it (it is small) and parses exactly the bytes it hashed
        data = source.read_part(parts[METADATA_FILE], keep=True)
        metadata = load_metadata_bytes(data, data_files=data_files, where=source.name)  # type: ignore[arg-type]
    except (IncompleteCheckpointError, CorruptCheckpointError) as exc:
        _note(findings, exc)
    for i, name in enumerate(sorted(data_files)):
        if i % comm.world_size == comm.rank:
            try:
                data = source.read_part(parts[name], keep=False)
                if data is not None:
                    kept[name] = data
            except (IncompleteCheckpointError, CorruptCheckpointError) as exc:
                _note(findings, exc)
    sizes = {name: p["bytes"] for name, p in parts.items()}
    return findings, VerifiedSave(
        source.folder,
        manifest,
        metadata,
        sizes,
        source.storage,
        source.attempt,
        kept,  # type: ignore[arg-type]
    )


def _safe_local_findings(source: FolderSave | StoreSave, comm: Comm) -> tuple[dict[str, Any], Any]:
    """:func:`_local_findings`, with *any* failure turned into a finding this rank reports.

    Why a catch-all here and nowhere else: what follows is a collective. A rank
    that raised here (a RecursionError from a crafted file, an OSError the
    readers did not expect) would leave the other ranks waiting in
    ``all_gather`` until gloo gives up with a "Read error", and each rank
    would tell a different story. Reported as a problem, every rank sees it
    and all fall back to the older save together.
    """
    try:
        return _local_findings(source, comm)
    except LoadEnvironmentError as exc:
        finding: dict[str, Any] = {"env": str(exc)}
    except UnsafeCheckpointError as exc:
        finding = {"unsafe": str(exc)}
    except CheckpointError as exc:  # EIO, deep JSON, a FIFO: damage, reported by this rank
        finding = {"problems": [_on_rank(comm, str(exc))]}
    except Exception as exc:
        finding = {
            "problems": [f"rank {comm.rank} could not read it ({type(exc).__name__}: {str(exc)[:160]})"]
        }
    return {"manifest": None, "missing": [], "problems": [], "unsafe": None, "env": None, **finding}, None


def verify_save(save: str | os.PathLike[str] | StoreSave, comm: Comm) -> VerifiedSave:
    """Verify one save on every rank together; collective over ``comm``.

    Args:
        save: A published ``step-XXXXXXXX`` folder, or a store's committed save (:class:`StoreSave`).
        comm: The ranks that will load it (all must call this).

    Returns:
        The verified save; its manifest and metadata are the same on every rank.

    Raises:
        IncompleteCheckpointError: No manifest or marker, or a listed file is missing.
        CorruptCheckpointError: A size or digest differs, a stale or damaged marker, the ranks
            read different manifests, or ``.metadata`` does not parse as DCP metadata.
        UnsafeCheckpointError: The manifest names a path outside the save, or
            ``.metadata`` refers to anything DCP's metadata never contains.
        LoadEnvironmentError: Some rank cannot reach the store (the bucket is named).
        (Every rank raises the same error.)

    Example:
        >>> verified = verify_save(run / "step-00000040", Comm())  # doctest: +SKIP
        >>> verified = verify_save(StoreSave(store, 40), Comm())  # doctest: +SKIP
    """
    source = save if isinstance(save, StoreSave) else FolderSave(save, comm)
    findings, verified = _safe_local_findings(source, comm)
    everyone = comm.all_gather(findings)
    env = [f"rank {r}: {f['env']}" for r, f in enumerate(everyone) if f["env"]]
    if env:
        raise LoadEnvironmentError(f"{source.where}: not restored, the store cannot be reached: {env[0]}")
    unsafe = [f"rank {r}: {f['unsafe']}" for r, f in enumerate(everyone) if f["unsafe"]]
    if unsafe:
        raise UnsafeCheckpointError(f"{source.where}: refused before loading anything: {unsafe[0]}")
    problems = sorted({p for f in everyone for p in f["problems"]})
    missing = sorted({p for f in everyone for p in f["missing"]})
    if problems or missing:
        kind = CorruptCheckpointError if problems else IncompleteCheckpointError
        raise kind(f"{source.where}: {'; '.join(problems + missing)}")
    if len({f["manifest"] for f in everyone}) != 1:
        raise CorruptCheckpointError(f"{source.where}: ranks read different manifests ({source.differ})")
    return verified
