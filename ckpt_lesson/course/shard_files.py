"""Lesson 04's sharded save: shard files, then a hashed ``index.json`` written last.

The smallest form of what :func:`ckpt_lesson.save_sharded_checkpoint` does, in the
format the lesson's exercise asks for::

    model.shard-000.pt ... model.shard-NNN.pt   torch.save'd dicts of tensors
    index.json                                  {"shards": [{"file", "bytes", "sha256"}, ...]}

* :func:`write_shards` writes every shard durably, hashing the bytes it writes,
  and only then publishes ``index.json`` atomically: the index's presence is
  the commit. It is the package's version of the learner's exercise, built on
  the package's atomic writes.
* :func:`read_shards` trusts nothing: no index means the save never finished;
  a name that is not a plain file name, a file that is not a regular file, a
  size or sha256 that differs from the index, or bytes that do not load with
  ``weights_only=True`` are refused before anything is returned.
"""

from __future__ import annotations

import hashlib
import io
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from ckpt_lesson.errors import (
    CheckpointError,
    CorruptCheckpointError,
    IncompleteCheckpointError,
    UnsafeCheckpointError,
)
from ckpt_lesson.files.atomic import atomic_write_bytes, atomic_write_json, make_dirs
from ckpt_lesson.files.safe_read import parse_json_text, read_regular_file

__all__ = ["INDEX_NAME", "MAX_SHARD_BYTES", "read_shards", "write_shards"]

#: The commit record: written last, after every shard is on disk.
INDEX_NAME = "index.json"

#: The largest shard :func:`read_shards` reads (it holds a whole shard in memory to hash it once).
MAX_SHARD_BYTES = 4 << 30

_SHA256 = re.compile(r"[0-9a-f]{64}")
_PLAIN_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.\-]*")


def write_shards(shards: Mapping[str, Mapping[str, torch.Tensor]], directory: str | os.PathLike[str]) -> None:
    """Write each shard, then ``index.json`` with every shard's size and sha256, last and atomically.

    Args:
        shards: File name -> the tensors that file holds (``{"model.shard-000.pt": {...}}``).
        directory: A new directory (created with its parents) or one without an index yet.

    Raises:
        CheckpointError: ``directory`` already holds an ``index.json`` (a finished save is
            never rewritten in place), a name is not a plain file name, or a write failed
            (then no index is written: the directory reads as an unfinished save).

    Example:
        >>> write_shards({"model.shard-000.pt": {"w": torch.zeros(2)}}, tmp / "step-1")  # doctest: +SKIP
    """
    directory = Path(directory)
    if (directory / INDEX_NAME).exists():
        raise CheckpointError(
            f"{directory}: already holds {INDEX_NAME} (a finished save); write each save to a new directory."
        )
    for name in shards:
        _check_name(directory, name)
    make_dirs(directory)
    entries = []
    for name, tensors in shards.items():
        buffer = io.BytesIO()
        torch.save(dict(tensors), buffer)
        data = buffer.getvalue()
        written = atomic_write_bytes(data, directory / name, algo="sha256")  # temp, fsync, rename, fsync dir
        entries.append({"file": name, "bytes": written.size, "sha256": written.digest})
    atomic_write_json({"shards": entries}, directory / INDEX_NAME)  # the commit point, after every shard


def read_shards(directory: str | os.PathLike[str]) -> dict[str, dict[str, torch.Tensor]]:
    """Verify every shard against ``index.json``, then return their tensors.

    Args:
        directory: A directory written by :func:`write_shards` (or by the lesson's exercise).

    Returns:
        File name -> the tensors that file holds, in the index's order.

    Raises:
        IncompleteCheckpointError: No ``index.json``: the save never finished.
        UnsafeCheckpointError: The index names something other than a plain file name.
        CorruptCheckpointError: The index is damaged, or a shard is missing, not a regular
            file, of another size or sha256 than recorded, or not a dict of tensors that
            loads with ``weights_only=True``.

    Example:
        >>> sorted(read_shards(tmp / "step-1"))  # doctest: +SKIP
        ['model.shard-000.pt']
    """
    directory = Path(directory)
    where = directory / INDEX_NAME
    try:
        raw = read_regular_file(where, limit=1 << 20, what="index")
    except FileNotFoundError:
        raise IncompleteCheckpointError(
            f"{directory}: no {INDEX_NAME}; the save never finished (the index is written last). "
            "Resume from an older checkpoint."
        ) from None
    entries = _entries(where, parse_json_text(raw, where=str(where)))
    loaded = {}
    for entry in entries:  # every shard is read and verified before anything is returned
        loaded[entry["file"]] = _verified_shard(directory, entry)
    return loaded


def _check_name(directory: Path, name: Any) -> None:
    if not isinstance(name, str) or not _PLAIN_NAME.fullmatch(name) or name == INDEX_NAME:
        raise UnsafeCheckpointError(
            f"{directory}: shard name {name!r} is not a plain file name inside the directory "
            f"(letters, digits, '_', '-', '.'; not {INDEX_NAME}). An index must not point anywhere else."
        )


def _entries(where: Path, index: Any) -> list[dict[str, Any]]:
    shards = index.get("shards") if isinstance(index, dict) else None
    if not isinstance(shards, list):
        raise CorruptCheckpointError(
            f"{where}: has no 'shards' list; it is damaged. Resume from an older save."
        )
    for i, entry in enumerate(shards):
        ok = (
            isinstance(entry, dict)
            and isinstance(entry.get("bytes"), int)
            and not isinstance(entry.get("bytes"), bool)
            and 0 <= entry["bytes"] <= MAX_SHARD_BYTES
            and isinstance(entry.get("sha256"), str)
            and _SHA256.fullmatch(entry["sha256"]) is not None
        )
        if not ok:
            raise CorruptCheckpointError(
                f"{where}: shard entry {i} is not {{'file', 'bytes', 'sha256'}} with a size and a 64-digit "
                "hex digest; the index is damaged. Resume from an older save."
            )
        _check_name(where.parent, entry.get("file"))
    names = [e["file"] for e in shards]
    if len(set(names)) != len(names):
        raise CorruptCheckpointError(f"{where}: names one file twice; the index is damaged.")
    return shards


def _verified_shard(directory: Path, entry: dict[str, Any]) -> dict[str, torch.Tensor]:
    path = directory / entry["file"]
    try:
        data = read_regular_file(path, limit=entry["bytes"], what="shard")
    except FileNotFoundError:
        raise CorruptCheckpointError(
            f"{path}: listed in {INDEX_NAME} but missing; the checkpoint is damaged. Resume from an older "
            "one."
        ) from None
    except CorruptCheckpointError as exc:
        if "cap" not in str(exc):
            raise
        raise CorruptCheckpointError(
            f"{path}: larger than the {entry['bytes']} bytes {INDEX_NAME} records; the file changed after "
            "the save. Resume from an older checkpoint."
        ) from None
    if len(data) != entry["bytes"]:
        raise CorruptCheckpointError(
            f"{path}: {len(data)} bytes, {INDEX_NAME} records {entry['bytes']}; the file changed after the "
            "save. Resume from an older checkpoint."
        )
    if hashlib.sha256(data).hexdigest() != entry["sha256"]:
        raise CorruptCheckpointError(
            f"{path}: sha256 differs from the one {INDEX_NAME} records; the file changed after the save. "
            "Resume from an older checkpoint."
        )
    try:  # only verified bytes are unpickled, from memory: the file is not read a second time
        tensors = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as exc:
        raise CorruptCheckpointError(f"{path}: does not load ({type(exc).__name__}); it is damaged.") from exc
    if not isinstance(tensors, dict) or not all(
        isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in tensors.items()
    ):
        raise CorruptCheckpointError(
            f"{path}: is not a dict of named tensors; it is not a shard of this format."
        )
    return tensors
