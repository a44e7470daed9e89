"""Verify a distributed save in an object store before DCP reads a byte of it.

The object-store twin of :mod:`.reader`, in the same two stages:

1. :func:`verify_store_save` runs on every rank together. Each rank reads the
   step's ``COMMIT`` marker (it must name this step) and the manifest it names
   (the bytes must hash to the marker's digest), then ``.metadata`` (small;
   parsed by the restricted unpickler from exactly the bytes it hashed), then
   downloads and hashes its share of the data objects (object ``i`` goes to
   rank ``i % world_size``). The verified bytes stay in that rank's memory.
   Every rank's findings are gathered to every rank, so all reach the same
   verdict: use this save, skip it as damaged or missing, refuse it as unsafe,
   or stop because the store cannot be reached (never taken for damage).
2. ``dcp.load`` runs with :class:`StoreReader`, DCP's ``FsspecReader`` with a
   file system that serves only verified bytes: an object this rank verified
   comes from memory; any other object it needs (after resharding, or a part
   another rank hashed) is downloaded whole and hashed again before DCP sees
   it. A swap between the stages is caught there, not just by size.

Cost: each rank holds the objects it reads in memory while it loads, and
objects verified by one rank but read by another cross the network twice.
"""

from __future__ import annotations

import copy
import io
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from torch.distributed.checkpoint._fsspec_filesystem import FileSystem as FsspecFileSystem
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader
from torch.distributed.checkpoint.metadata import Metadata

from ckpt_lesson.errors import (
    CheckpointError,
    CorruptCheckpointError,
    IncompleteCheckpointError,
    LoadEnvironmentError,
    UnsafeCheckpointError,
)
from ckpt_lesson.files.storage import Storage
from ckpt_lesson.files.tagged_hash import hash_bytes
from ckpt_lesson.runs.dcp_manifest import METADATA_FILE
from ckpt_lesson.runs.layout import step_dir_name
from ckpt_lesson.runs.store_restore import read_committed_manifest

from .comm import Comm
from .reader import one_verdict
from .safe_metadata import load_metadata_bytes

__all__ = ["StoreReader", "VerifiedStoreSave", "verify_store_save"]


@dataclass(frozen=True)
class VerifiedStoreSave:
    """A save in a store that every rank agreed is intact.

    Attributes:
        storage: The run's store.
        step: The step.
        attempt: ``step-XXXXXXXX/<save_id>``: the key prefix of its objects.
        manifest: The parsed manifest.
        metadata: DCP's metadata, parsed from the verified bytes.
        sizes: Every listed object (``.metadata`` included) -> its size.
        verified: Object name -> the bytes this rank downloaded and hashed (its share).
    """

    storage: Storage
    step: int
    attempt: str
    manifest: dict[str, Any]
    metadata: Metadata
    sizes: dict[str, int]
    verified: dict[str, bytes] = field(default_factory=dict, compare=False, repr=False)

    @property
    def url(self) -> str:
        """Where the save's objects live."""
        return self.storage.where(self.attempt)


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


def _read_manifest(storage: Storage, step: int) -> tuple[dict[str, Any], bytes, str]:
    # The marker names this step; the manifest matches its digest and seal, and is a multi-rank one.
    return read_committed_manifest(storage, step, multi_rank=True)


def _local_findings(storage: Storage, step: int, comm: Comm) -> tuple[dict[str, Any], Any]:
    findings: dict[str, Any] = {"manifest": None, "missing": [], "problems": [], "unsafe": None, "env": None}
    try:
        manifest, raw, attempt = _read_manifest(storage, step)
    except IncompleteCheckpointError as exc:
        findings["missing"] = [str(exc)]
        return findings, None
    findings["manifest"] = hash_bytes(raw)["digest"]
    parts = {p["file"]: p for p in manifest["parts"]}
    sizes = {name: p["bytes"] for name, p in parts.items()}
    verified: dict[str, bytes] = {}
    metadata = None
    try:
        data = fetch_part(storage, attempt, parts[METADATA_FILE])
        data_files = {name: size for name, size in sizes.items() if name != METADATA_FILE}
        metadata = load_metadata_bytes(data, data_files=data_files, where=step_dir_name(step))
    except IncompleteCheckpointError as exc:
        findings["missing"].append(str(exc))
    except CorruptCheckpointError as exc:
        findings["problems"].append(str(exc))
    for i, name in enumerate(sorted(n for n in parts if n != METADATA_FILE)):
        if i % comm.world_size != comm.rank:
            continue
        try:
            verified[name] = fetch_part(storage, attempt, parts[name])
        except IncompleteCheckpointError as exc:
            findings["missing"].append(str(exc))
        except CorruptCheckpointError as exc:
            findings["problems"].append(str(exc))
    return findings, (manifest, attempt, metadata, sizes, verified)


def _safe_local_findings(storage: Storage, step: int, comm: Comm) -> tuple[dict[str, Any], Any]:
    """Any failure becomes a finding: a rank that raised would leave the others waiting in a collective."""
    try:
        return _local_findings(storage, step, comm)
    except LoadEnvironmentError as exc:
        finding = {"env": str(exc)}
    except UnsafeCheckpointError as exc:
        finding = {"unsafe": str(exc)}
    except CheckpointError as exc:
        finding = {"problems": [str(exc)]}
    except Exception as exc:
        finding = {
            "problems": [f"rank {comm.rank} could not read it ({type(exc).__name__}: {str(exc)[:160]})"]
        }
    return {"manifest": None, "missing": [], "problems": [], "unsafe": None, "env": None, **finding}, None


def verify_store_save(storage: Storage, step: int, comm: Comm) -> VerifiedStoreSave:
    """Verify committed save ``step`` in ``storage`` on every rank together; collective over ``comm``.

    Args:
        storage: The run's store.
        step: A step with a ``COMMIT`` marker.
        comm: The ranks that will load it (all must call this).

    Returns:
        The verified save; its manifest and metadata are the same on every rank.

    Raises:
        IncompleteCheckpointError: No marker, or the manifest or a listed object is missing.
        CorruptCheckpointError: A stale or damaged marker or manifest, a size or digest that
            differs, ranks that read different manifests, or ``.metadata`` that does not parse.
        UnsafeCheckpointError: ``.metadata`` refers to anything DCP's metadata never contains.
        LoadEnvironmentError: Some rank cannot reach the store (the bucket is named).
        (Every rank raises the same error.)

    Example:
        >>> verified = verify_store_save(store, 40, Comm())  # doctest: +SKIP
    """
    findings, parsed = _safe_local_findings(storage, step, comm)
    everyone = comm.all_gather(findings)
    where = storage.where(step_dir_name(step))
    env = [f"rank {r}: {f['env']}" for r, f in enumerate(everyone) if f["env"]]
    if env:
        raise LoadEnvironmentError(f"{where}: not restored, the store cannot be reached: {env[0]}")
    one_verdict(everyone, where=where, differ="two commits of one step?")
    manifest, attempt, metadata, sizes, verified = parsed
    return VerifiedStoreSave(storage, step, attempt, manifest, metadata, sizes, verified)


class _VerifiedFiles(FsspecFileSystem):
    """A read-only DCP file system that hands out only bytes that match the manifest."""

    def __init__(self, save: VerifiedStoreSave) -> None:
        super().__init__()
        self.save = save
        self.parts = {p["file"]: p for p in save.manifest["parts"]}

    @contextmanager
    def create_stream(self, path: str | os.PathLike[str], mode: str) -> Iterator[Any]:
        name = os.fspath(path).rsplit("/", 1)[-1]
        if "r" not in mode or name not in self.parts or name == METADATA_FILE:
            raise UnsafeCheckpointError(
                f"{self.save.url}: refusing to open {name!r} ({mode}); only the verified objects are read."
            )
        data = self.save.verified.get(name)
        if data is None:  # not this rank's share: download it and check it the same way
            try:
                data = fetch_part(self.save.storage, self.save.attempt, self.parts[name])
            except (CorruptCheckpointError, IncompleteCheckpointError) as exc:
                raise type(exc)(f"{self.save.url}: {exc} (changed after it was verified)") from None
        yield io.BytesIO(data)


class StoreReader(FsspecReader):
    """DCP's fsspec reader, restricted to a save :func:`verify_store_save` accepted.

    ``read_metadata`` returns the metadata parsed from the verified bytes and
    refuses DCP's fallback to rank-local ``__N.metadata`` objects; ``read_data``
    reads only listed objects, each checked against the manifest first.

    Args:
        save: The verified save.
        storage_options: fsspec options for DCP's own file system object.

    Example:
        >>> reader = StoreReader(verified)  # doctest: +SKIP
        >>> dcp.load(sd, storage_reader=reader, planner=WeightsOnlyLoadPlanner())  # doctest: +SKIP
    """

    def __init__(self, save: VerifiedStoreSave, storage_options: dict[str, Any] | None = None) -> None:
        super().__init__(save.url, **dict(storage_options or {}))
        self.fs = _VerifiedFiles(save)
        self.verified = save

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if kwargs.get("rank") is not None:
            raise UnsafeCheckpointError(
                f"{self.verified.url}: refusing DCP's fallback to rank-local metadata; only the verified "
                ".metadata is read."
            )
        return copy.deepcopy(self.verified.metadata)  # DCP writes a load id into the one it gets
