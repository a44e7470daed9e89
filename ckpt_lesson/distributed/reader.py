"""Verify a distributed save before DCP reads a byte of it, and read it without unpickling code.

Restoring one candidate save happens in two stages:

1. :func:`verify_save` runs on every rank together. Each rank reads the
   manifest and ``.metadata`` (small) itself, hashes its share of the data
   files (file ``i`` goes to rank ``i % world_size``, so the ranks split the
   reading), and then every rank's findings are gathered to every rank. All
   ranks therefore reach the same verdict from the same evidence: use this
   save, skip it as damaged, or refuse it as unsafe. A verdict that differed
   between ranks would send them into different collectives and hang the job.
2. ``dcp.load`` runs with :class:`VerifyingReader`, which hands DCP the
   metadata parsed in stage 1 (from the bytes that matched the manifest) and
   refuses to read any file the manifest does not list, and with
   :class:`WeightsOnlyLoadPlanner`, which reads non-tensor values with
   ``torch.load(weights_only=True)`` where stock DCP turns weights_only off.

What stays open: between stage 1 and DCP's read a data file could be swapped.
The reader re-checks sizes, and every value is still read weights-only, so a
swap can give wrong numbers but cannot run code.
"""

from __future__ import annotations

import copy
import io
import os
import pickle
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, ReadItem
from torch.futures import Future

from ckpt_lesson.errors import (
    CheckpointError,
    CorruptCheckpointError,
    IncompleteCheckpointError,
    UnsafeCheckpointError,
)
from ckpt_lesson.files.hashing import hash_bytes
from ckpt_lesson.files.safe_read import read_regular_file
from ckpt_lesson.runs.dcp_manifest import METADATA_FILE, check_dcp_part, read_dcp_manifest

from .comm import Comm
from .safe_metadata import load_metadata_bytes, weights_only_refusal

__all__ = ["VerifiedSave", "VerifyingReader", "WeightsOnlyLoadPlanner", "verify_save"]


@dataclass(frozen=True)
class VerifiedSave:
    """A save every rank agreed is intact: its manifest, parsed metadata and file sizes."""

    folder: Path
    manifest: dict[str, Any]
    metadata: Metadata
    sizes: dict[str, int]


def _local_findings(folder: Path, comm: Comm) -> tuple[dict[str, Any], Any]:
    """This rank's view: manifest fingerprint, problems found, unsafe refusal, parsed metadata."""
    # "missing" (the save never finished) and "problems" (damage) are kept apart: the caller's
    # error type, IncompleteCheckpointError or CorruptCheckpointError, depends on which it was.
    findings: dict[str, Any] = {"manifest": None, "missing": [], "problems": [], "unsafe": None}
    try:
        manifest, raw = read_dcp_manifest(folder)
    except IncompleteCheckpointError as exc:
        findings["missing"] = [str(exc)]
        return findings, None
    except UnsafeCheckpointError as exc:
        findings["unsafe"] = str(exc)
        return findings, None
    except CheckpointError as exc:  # EIO, deep JSON, a FIFO: damage, reported by this rank
        findings["problems"] = [_on_rank(comm, str(exc))]
        return findings, None
    findings["manifest"] = hash_bytes(raw)["digest"]
    parts = {p["file"]: p for p in manifest["parts"]}
    # .metadata: every rank reads it (it is small) and parses exactly the bytes it hashed.
    meta_part = parts[METADATA_FILE]
    metadata = None
    problem = check_dcp_part(folder, meta_part, hash_it=False)  # stat + size; the digest is of the bytes read
    if problem is None:
        data, why = _read_metadata_file(folder, meta_part["bytes"])
        if data is None:
            problem = _on_rank(comm, f"{METADATA_FILE}: unreadable ({why})")
        elif (
            len(data) != meta_part["bytes"]
            or hash_bytes(data, meta_part["algo"])["digest"] != meta_part["digest"]
        ):
            problem = f"{METADATA_FILE}: changed while it was being verified"
        else:
            sizes = {name: p["bytes"] for name, p in parts.items() if name != METADATA_FILE}
            try:
                metadata = load_metadata_bytes(data, data_files=sizes, where=folder.name)
            except UnsafeCheckpointError as exc:
                findings["unsafe"] = str(exc)
            except CorruptCheckpointError as exc:
                problem = str(exc)
    _note(findings, problem)
    data_parts = sorted(name for name in parts if name != METADATA_FILE)
    for i, name in enumerate(data_parts):
        if i % comm.world_size == comm.rank:
            _note(findings, check_dcp_part(folder, parts[name]))
    return findings, (manifest, metadata)


def _read_metadata_file(folder: Path, size: int) -> tuple[bytes | None, str]:
    # Through the one bounded reader: EIO (a bad sector) is damage to this copy, not a crash on
    # one rank while the others wait in a collective. The reason drops the path (the caller's
    # message names the folder).
    path = folder / METADATA_FILE
    try:
        return read_regular_file(path, limit=size, what="DCP .metadata"), ""
    except (OSError, CheckpointError) as exc:
        return None, str(exc).replace(f"{path}: ", "")[:200]


def _on_rank(comm: Comm, problem: str) -> str:
    # Which rank saw it: EIO may hit one node only, and every rank reports the gathered finding.
    return f"rank {comm.rank}: {problem}" if comm.world_size > 1 else problem


def _safe_local_findings(folder: Path, comm: Comm) -> tuple[dict[str, Any], Any]:
    """:func:`_local_findings`, with *any* failure turned into a finding this rank reports.

    Why a catch-all here and nowhere else: what follows is a collective. A rank
    that raised here (a RecursionError from a crafted file, an OSError the
    readers did not expect) would leave the other ranks waiting in
    ``all_gather`` until gloo gives up with a "Read error", and each rank
    would tell a different story. Reported as a problem, every rank sees it
    and all fall back to the older save together.
    """
    try:
        return _local_findings(folder, comm)
    except Exception as exc:
        problem = f"rank {comm.rank} could not read it ({type(exc).__name__}: {str(exc)[:160]})"
        return {"manifest": None, "missing": [], "problems": [problem], "unsafe": None}, None


def _note(findings: dict[str, Any], problem: str | None) -> None:
    if problem:
        findings["missing" if problem.endswith(": missing") else "problems"].append(problem)


def verify_save(folder: str | os.PathLike[str], comm: Comm) -> VerifiedSave:
    """Verify one save on every rank together; collective over ``comm``.

    Args:
        folder: A published ``step-XXXXXXXX`` folder.
        comm: The ranks that will load it (all must call this).

    Returns:
        The verified save, identical in content on every rank.

    Raises:
        IncompleteCheckpointError: The manifest or a listed file is missing.
        CorruptCheckpointError: A size or digest differs, the ranks read
            different manifests, or ``.metadata`` does not parse as DCP metadata.
        UnsafeCheckpointError: The manifest names a path outside the folder, or
            ``.metadata`` refers to anything DCP's metadata never contains.
        (Every rank raises the same error.)

    Example:
        >>> verified = verify_save(run / "step-00000040", Comm())  # doctest: +SKIP
    """
    folder = Path(folder)
    findings, parsed = _safe_local_findings(folder, comm)
    one_verdict(comm.all_gather(findings), where=folder.name, differ="is the file system shared?")
    manifest, metadata = parsed
    sizes = {p["file"]: p["bytes"] for p in manifest["parts"]}
    return VerifiedSave(folder, manifest, metadata, sizes)


def one_verdict(everyone: list[dict[str, Any]], *, where: str, differ: str) -> None:
    """Raise the one verdict every rank reaches from all ranks' findings (nothing when all is well).

    Shared by :func:`verify_save` and the object-store reader: each rank checks what it
    can see, the findings are gathered, and every rank raises the same error, so they fall
    back to the same older save together.

    Args:
        everyone: Each rank's findings (``unsafe``, ``problems``, ``missing``, ``manifest``).
        where: The save, for messages.
        differ: The likely cause, when the ranks read different manifests.

    Raises:
        UnsafeCheckpointError: A rank found something that must never be loaded.
        CorruptCheckpointError: Damage on any rank, or ranks that read different manifests.
        IncompleteCheckpointError: Files missing on some rank, and no damage.
    """
    unsafe = [f"rank {r}: {f['unsafe']}" for r, f in enumerate(everyone) if f["unsafe"]]
    if unsafe:
        raise UnsafeCheckpointError(f"{where}: refused before loading anything: {unsafe[0]}")
    problems = sorted({p for f in everyone for p in f["problems"]})
    missing = sorted({p for f in everyone for p in f["missing"]})
    if problems or missing:
        kind = CorruptCheckpointError if problems else IncompleteCheckpointError
        raise kind(f"{where}: {'; '.join(problems + missing)}")
    if len({f["manifest"] for f in everyone}) != 1:
        raise CorruptCheckpointError(f"{where}: ranks read different manifests ({differ})")


class VerifyingReader(FileSystemReader):
    """DCP's file reader, restricted to a save :func:`verify_save` accepted.

    ``read_metadata`` returns the metadata parsed from the verified bytes
    (never re-reading the file) and refuses DCP's fallback to rank-local
    ``__N.metadata`` files; ``read_data`` refuses files the manifest does not
    list and files whose size changed since verification.

    Example:
        >>> reader = VerifyingReader(verified)  # doctest: +SKIP
        >>> dcp.load(sd, storage_reader=reader, planner=WeightsOnlyLoadPlanner())  # doctest: +SKIP
    """

    def __init__(self, verified: VerifiedSave) -> None:
        super().__init__(verified.folder)
        self.verified = verified

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if kwargs.get("rank") is not None:
            raise UnsafeCheckpointError(
                f"{self.verified.folder.name}: refusing DCP's fallback to rank-local metadata files; "
                "only the verified .metadata is read."
            )
        return copy.deepcopy(self.verified.metadata)  # DCP writes a load id into the one it gets

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        for name in {self.storage_data[item.storage_index].relative_path for item in plan.items}:
            if name not in self.verified.sizes or name == METADATA_FILE:
                raise UnsafeCheckpointError(
                    f"{self.verified.folder.name}: refusing to read unlisted file {name!r}."
                )
            info = os.lstat(self.verified.folder / name)
            if not stat.S_ISREG(info.st_mode) or info.st_size != self.verified.sizes[name]:
                raise CorruptCheckpointError(
                    f"{self.verified.folder.name}: {name} changed after it was verified."
                )
        return super().read_data(plan, planner)


class WeightsOnlyLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, except that non-tensor values are read weights-only.

    Stock ``DefaultLoadPlanner.load_bytes`` calls ``torch.load`` with weights_only off,
    which runs whatever a crafted value's pickle asks for. Here the same bytes
    go through the weights-only unpickler: tensors, plain containers and
    numbers load; anything else is refused before it is constructed.

    Example:
        >>> planner = WeightsOnlyLoadPlanner()
        >>> planner.allow_partial_load
        False
    """

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        try:
            obj = torch.load(value, weights_only=True, map_location="cpu")
        except pickle.UnpicklingError as exc:
            raise UnsafeCheckpointError(
                f"value {fqn!r} is not plain data (the weights-only load refused it: "
                f"{weights_only_refusal(exc)}); nothing was executed. Move this save aside and "
                "restore an older one."
            ) from exc
        except (RuntimeError, EOFError, ValueError) as exc:
            raise CorruptCheckpointError(
                f"value {fqn!r} does not load ({type(exc).__name__}: {exc})."
            ) from exc
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], obj)
        else:
            self.state_dict[fqn] = obj
