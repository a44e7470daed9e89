"""Where a restore reads one save from: a local folder, or a save already verified in memory.

The local restore (:mod:`ckpt_lesson.runs.restore`)
was written for a ``step-XXXXXXXX`` folder: read the manifest, check every part
is there with its size, hash every part, then a weights-only load. A save
fetched from an object store arrives differently: every part was hashed against
the manifest while it streamed down (:mod:`ckpt_lesson.runs.store_restore`), and
its bytes are in memory. Rather than a second copy of the restore logic, the
loaders accept either *source*; the few steps that differ ask this module:

* the manifest: read from the folder, or the one the marker pinned;
* presence, size and digest of every part: checked on disk, or already checked;
* a part to load: a path, or :class:`~ckpt_lesson.files.verified_bytes.VerifiedBytes`
  that go through the same archive check and weights-only load as a file.

:class:`Candidates` tells the restore loop which saves to try, newest first,
and how to open each one.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple, Union

from ckpt_lesson.errors import CheckpointError, CorruptCheckpointError, IncompleteCheckpointError
from ckpt_lesson.files.safe_read import read_json_file
from ckpt_lesson.files.shard_index import INDEX_NAME
from ckpt_lesson.files.verified_bytes import VerifiedBytes
from ckpt_lesson.files.verify import verify_record
from ckpt_lesson.runs.layout import read_manifest, step_dir_name

__all__ = [
    "Candidates",
    "SaveSource",
    "VerifiedSave",
    "check_parts_present",
    "folder_candidates",
    "index_parts",
    "source_folder",
    "source_manifest",
    "source_part",
    "verify_other_parts",
]


@dataclass(eq=False)
class VerifiedSave:
    """One committed save whose every part was verified against its manifest while it downloaded.

    Attributes:
        name: The save's folder name, ``step-XXXXXXXX`` (messages name it like a local save).
        url: Where it lives, e.g. ``s3://bucket/run/step-00000240``; ``str()`` gives it.
        manifest: The manifest, matched to the commit marker and sealed-checked.
        parts: ``{file name: its verified bytes}``, one entry per manifest part.

    Example:
        >>> save = VerifiedSave("step-00000240", "s3://b/run/step-00000240", {"parts": []})
        >>> str(save)
        's3://b/run/step-00000240'
    """

    name: str
    url: str
    manifest: dict[str, Any]
    parts: dict[str, VerifiedBytes] = field(default_factory=dict)

    def __str__(self) -> str:
        return self.url


#: A save to restore: its local folder, or its verified bytes in memory.
SaveSource = Union[Path, VerifiedSave]  # noqa: UP007 - a runtime alias; ``X | Y`` needs no quotes from 3.10 on


class Candidates(NamedTuple):
    """The saves a restore may choose from, and how to open one.

    Attributes:
        where: The run, for messages (a folder or a URL).
        steps: Their steps, ascending; the restore tries them newest first.
        open: ``open(step) -> SaveSource``; it may raise damage
            (``CorruptCheckpointError``, ``IncompleteCheckpointError``), which
            makes the restore try the next older step.
        noun: What the saves are called in the "none is usable" message.
        hint: The last line of that message: where to look next.
        relist: ``relist() -> steps``: the saves there are *now*, asked again when
            a candidate vanished or turned out damaged (another process's
            retention, or its next save, changes the run while it is restored).
    """

    where: str
    steps: list[int]
    open: Callable[[int], SaveSource]
    noun: str = "save(s)"
    hint: str = "Copy the folder for inspection; 'python -m ckpt_lesson scan DIR' shows the same list."
    relist: Callable[[], list[int]] | None = None


def folder_candidates(run_dir: Path, steps: list[int]) -> Candidates:
    """The published saves of a local run directory, each opened as its folder.

    Example:
        >>> folder_candidates(Path("run"), [40, 80]).open(80)
        PosixPath('run/step-00000080')
    """
    return Candidates(str(run_dir), steps, lambda step: run_dir / step_dir_name(step))


def source_manifest(source: SaveSource) -> dict[str, Any]:
    """The save's manifest: parsed and checked from the folder, or the one verified with the bytes.

    Raises:
        IncompleteCheckpointError, CorruptCheckpointError, SchemaError: As
            :func:`~ckpt_lesson.runs.scan.read_manifest` (a folder only).

    Example:
        >>> source_manifest(VerifiedSave("step-00000001", "s3://b/r/step-00000001", {"step": 1}))["step"]
        1
    """
    return source.manifest if isinstance(source, VerifiedSave) else read_manifest(source)


def source_part(source: SaveSource, file: str) -> Path | VerifiedBytes:
    """What a loader opens for part ``file``: its path in the folder, or its verified bytes.

    Raises:
        IncompleteCheckpointError: A save in memory that holds no such part.

    Example:
        >>> source_part(Path("run/step-00000240"), "checkpoint.pt")
        PosixPath('run/step-00000240/checkpoint.pt')
    """
    if not isinstance(source, VerifiedSave):
        return source / file
    try:
        return source.parts[file]
    except KeyError:
        raise IncompleteCheckpointError(
            f"{source.url}: part {file} is not in its manifest; restore an older save."
        ) from None


def source_folder(source: SaveSource) -> Path:
    """The folder of a save whose loader reads a directory (the sharded layouts).

    Raises:
        CheckpointError: ``source`` is in memory; the store restore hands a
            sharded save over as a verified folder, so this names a bug.
    """
    if isinstance(source, VerifiedSave):
        raise CheckpointError(
            f"{source.url}: a sharded save cannot load from memory; restore it from a local folder "
            "(StoreCheckpointManager downloads sharded saves into its cache folder)."
        )
    return source


def check_parts_present(target: SaveSource, manifest: dict[str, Any]) -> None:
    """Every manifest part exists with its recorded size: a ``stat`` each, no reading.

    A save in memory passes at once: each part's size was checked as it streamed in.

    Raises:
        IncompleteCheckpointError: A part is missing.
        CorruptCheckpointError: A part has another size.
    """
    if isinstance(target, VerifiedSave):
        return
    for part in manifest["parts"]:  # presence and size first: free, and names a missing part exactly
        path = target / part["file"]
        if not path.is_file() or path.is_symlink():
            raise IncompleteCheckpointError(f"{target.name}: part {part['file']} is missing")
        if path.stat().st_size != part["bytes"]:
            size = path.stat().st_size
            raise CorruptCheckpointError(
                f"{target.name}: {part['file']}: size {size} != recorded {part['bytes']}"
            )


def verify_other_parts(target: SaveSource, manifest: dict[str, Any], *, skip: set[str]) -> None:
    """Hash every manifest part except ``skip`` (and, when sharded, the files the index covers).

    A save in memory passes at once: every part was hashed against the manifest as it streamed in.

    Raises:
        CorruptCheckpointError: A part's size or digest differs from the manifest.

    Example:
        >>> verify_other_parts(target, manifest, skip={"checkpoint.pt"})  # doctest: +SKIP
    """
    if isinstance(target, VerifiedSave):
        return
    if manifest["layout"] == "sharded":
        index = {p["file"] for p in index_parts(target)}
        skip = skip | index  # verified by the sharded loader, against the index pinned below
    for part in manifest["parts"]:
        if part["file"] in skip:
            continue
        problem = verify_record(target / part["file"], part)
        if problem:
            raise CorruptCheckpointError(f"{target.name}: {problem}")


def index_parts(target: Path) -> list[dict[str, Any]]:
    """Files the sharded index lists (shards + meta); read only after index.json itself is verified.

    An unreadable index yields ``[]``: every part is then hashed against the manifest instead.

    Example:
        >>> [p["file"] for p in index_parts(target)]  # doctest: +SKIP
        ['model.shard-000.pt', 'model.shard-001.pt', 'meta.pt']
    """
    try:
        index = read_json_file(target / INDEX_NAME, what="index")
        entries = [*index["shards"], index["meta"]]
        return [e for e in entries if isinstance(e, dict) and isinstance(e.get("file"), str)]
    except (OSError, ValueError, KeyError, TypeError):  # CorruptCheckpointError is a ValueError
        return []
