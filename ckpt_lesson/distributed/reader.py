"""Verify a distributed save before DCP reads a byte of it, and read it without unpickling code.

One path for a folder every rank shares and for an object store. Restoring one
candidate save happens in two stages:

1. :func:`~.verify.verify_save` runs on every rank together. Each rank reads the
   manifest (in a store: the step's ``COMMIT`` marker first, and the manifest
   whose digest it names) and ``.metadata`` (small; parsed by the restricted
   unpickler from exactly the bytes it hashed), then hashes its share of the
   data files (file ``i`` goes to rank ``i % world_size``, so the ranks split
   the reading). Every rank's findings are gathered to every rank, so all
   reach the same verdict from the same evidence: use this save, skip it as
   damaged or missing, refuse it as unsafe, or stop because the store cannot
   be reached (never taken for damage). A verdict that differed between ranks
   would send them into different collectives and hang the job.
2. ``dcp.load`` runs with :class:`VerifyingReader` (the metadata of stage 1, only the
   listed files) and :class:`WeightsOnlyLoadPlanner` (non-tensor values weights-only).

What the two storages do differently is only where the bytes come from (a
:class:`FolderSave` or a :class:`StoreSave`):

* a folder's files are hashed as they stream from disk; between the stages a
  file could be swapped, so the reader re-checks sizes, and every value is
  still read weights-only: a swap can give wrong numbers but cannot run code;
* a store's objects are downloaded and hashed, and the verified bytes stay in
  that rank's memory; any other object a rank needs (after resharding, or a
  part another rank hashed) is downloaded whole and hashed again before DCP
  sees it, so a swap between the stages is caught. The cost: each rank holds
  the objects it reads in memory while it loads.
"""

from __future__ import annotations

import copy
import io
import os
import pickle
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint._fsspec_filesystem import FileSystem as FsspecFileSystem
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import ReadItem

from ckpt_lesson.errors import CorruptCheckpointError, IncompleteCheckpointError, UnsafeCheckpointError
from ckpt_lesson.runs.dcp_manifest import METADATA_FILE

from .safe_metadata import weights_only_refusal
from .verify import VerifiedSave, fetch_part

__all__ = ["VerifyingReader", "WeightsOnlyLoadPlanner"]


class _ListedFiles:
    """What the read-only file systems of :class:`VerifyingReader` refuse: any file the manifest omits."""

    def __init__(self, save: VerifiedSave) -> None:
        super().__init__()
        self.save = save

    def _listed(self, path: str | os.PathLike[str], mode: str) -> str:
        name = os.fspath(path).rsplit("/", 1)[-1]
        if "r" not in mode or name not in self.save.sizes or name == METADATA_FILE:
            raise UnsafeCheckpointError(
                f"{self.save.folder}: refusing to read unlisted file {name!r} ({mode}); "
                "only the verified files are read."
            )
        return name


class _CheckedFiles(_ListedFiles, FileSystem):
    """A folder's files, each re-checked (regular, same size) as DCP opens it."""

    @contextmanager
    def create_stream(self, path: str | os.PathLike[str], mode: str) -> Iterator[Any]:
        name = self._listed(path, mode)
        info = os.lstat(path)
        if not stat.S_ISREG(info.st_mode) or info.st_size != self.save.sizes[name]:
            raise CorruptCheckpointError(f"{self.save.folder}: {name} changed after it was verified.")
        with super().create_stream(path, mode) as stream:
            yield stream


class _VerifiedFiles(_ListedFiles, FsspecFileSystem):
    """A store's objects: the bytes this rank verified, or downloaded and hashed again now."""

    @contextmanager
    def create_stream(self, path: str | os.PathLike[str], mode: str) -> Iterator[Any]:
        name = self._listed(path, mode)
        data = self.save.verified.get(name)
        if data is None:  # not this rank's share: download it and check it the same way
            part = next(p for p in self.save.manifest["parts"] if p["file"] == name)
            try:
                data = fetch_part(self.save.storage, self.save.attempt, part)  # type: ignore[arg-type]
            except (CorruptCheckpointError, IncompleteCheckpointError) as exc:
                raise type(exc)(f"{self.save.folder}: {exc} (changed after it was verified)") from None
        yield io.BytesIO(data)


class VerifyingReader(FileSystemReader):
    """DCP's file reader, restricted to a save :func:`verify_save` accepted.

    ``read_metadata`` returns the metadata parsed from the verified bytes (never
    re-reading the file) and refuses DCP's fallback to rank-local ``__N.metadata``
    files; reading refuses files the manifest does not list, and re-checks the
    others as the module doc says.

    Args:
        verified: The verified save.
        storage_options: A store's fsspec options for DCP's own file system object.

    Example:
        >>> reader = VerifyingReader(verified)  # doctest: +SKIP
        >>> dcp.load(sd, storage_reader=reader, planner=WeightsOnlyLoadPlanner())  # doctest: +SKIP
    """

    def __init__(self, verified: VerifiedSave, storage_options: dict[str, Any] | None = None) -> None:
        super().__init__(verified.folder)
        self.verified = verified
        if verified.storage is None:
            self.fs = _CheckedFiles(verified)
        else:
            self.fs = _VerifiedFiles(verified)
            self.path = self.fs.init_path(verified.folder, **dict(storage_options or {}))

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if kwargs.get("rank") is not None:
            raise UnsafeCheckpointError(
                f"{self.verified.folder}: refusing DCP's fallback to rank-local metadata files; "
                "only the verified .metadata is read."
            )
        return copy.deepcopy(self.verified.metadata)  # DCP writes a load id into the one it gets


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
