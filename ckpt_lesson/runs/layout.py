"""What a managed save looks like: its folder name, its manifest, and the check of one save.

A run directory written by :class:`~ckpt_lesson.runs.manager.CheckpointManager`
looks like this::

    RUN_DIR/
      step-00000240/          a published save
        checkpoint.pt         (or model.shard-NNN.pt + meta.pt + index.json,
                              or DCP's __R_N.distcp + .metadata from a multi-rank save)
        manifest.json         the commit record: every part's size and digest
      .staging-step-00000280-<pid>-<hex8>/   a save in progress (or abandoned)

A save is *ok* only if its ``manifest.json`` exists and every part it lists
has the recorded size and digest (and, for ``.pt`` files, matches its own
in-file footer). Each record names its algorithm (``xxh3_128`` by default;
records from earlier versions carry a ``sha256`` and still verify). A step
folder without a manifest is *incomplete*; one whose bytes differ is *corrupt*.
Nothing here loads a tensor: a check costs one read of every byte (xxh3-128
hashes far faster than the disk reads), no unpickling.

Everything that writes, lists or restores saves reads the layout from here;
:mod:`~ckpt_lesson.runs.scan` puts a whole run (a folder or a bucket) in one table.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

from ckpt_lesson.errors import (
    CheckpointError,
    CorruptCheckpointError,
    IncompleteCheckpointError,
    SchemaError,
    UnsafeCheckpointError,
)
from ckpt_lesson.files.hashing import part_digest
from ckpt_lesson.files.record_seal import verify_record_seal
from ckpt_lesson.files.safe_read import read_json_file
from ckpt_lesson.files.schema import MANIFEST_NAME, MANIFEST_SCHEMA, STEP_DIR_RE
from ckpt_lesson.files.verify import verify_record
from ckpt_lesson.short_repr import short_repr

__all__ = [
    "LAYOUTS",
    "MANIFEST_NAME",
    "STAGING_PREFIX",
    "ScanResult",
    "check_manifest",
    "check_part_file",
    "inspect_save",
    "published_steps",
    "read_manifest",
    "step_dir_name",
    "step_of",
]

LAYOUTS = ("single", "sharded")
#: The multi-rank manifest's schema (its reader, runs/dcp_manifest.py, registers in MANIFEST_KINDS).
DCP_MANIFEST_SCHEMA = "ckpt.manifest.dcp.v1"
#: Prefix of a save in progress: ``.staging-step-00000280-<pid>-<hex8>``.
STAGING_PREFIX = ".staging-step-"
STAGING_RE = re.compile(r"^\.staging-step-([0-9]{8,})-")
#: Every top-level key a manifest had before manifests carried their own checksum.
LEGACY_MANIFEST_KEYS = frozenset(
    {"schema", "save_id", "step", "payload_schema", "layout", "parts", "covers", "state", "env", "data"}
    | {"metadata", "created_at", "num_shards"}
)


def step_dir_name(step: int) -> str:
    """``step-00000240``: zero-padded so that text order equals numeric order."""
    return f"step-{step:08d}"


def published_steps(run_dir: Path) -> list[int]:
    """Steps of the ``step-XXXXXXXX`` folders in ``run_dir`` (no links), ascending. Nothing is read."""
    steps = []
    # scandir, not iterdir + is_dir: the kind of each entry comes with the listing (d_type), so
    # 10,000 step folders cost one pass over the directory, not 20,000 stat calls.
    with os.scandir(run_dir) as entries:
        for entry in entries:
            step = step_of(entry.name)
            if step is not None and entry.is_dir(follow_symlinks=False):
                steps.append(step)
    return sorted(steps)


def step_of(name: str) -> int | None:
    """The step of a published save folder's name, or ``None`` for any other name."""
    found = STEP_DIR_RE.match(name)
    return int(found.group(1)) if found else None


class ManifestKind(NamedTuple):
    """How to read a save whose manifest another module owns (the multi-rank one).

    A single-process save never needs that module: :func:`inspect_save` and the store's
    restore look a manifest's schema up in :data:`MANIFEST_KINDS` only when it is not theirs.
    """

    read: Callable[[Path], dict[str, Any]]  # a folder's manifest, read and validated
    check: Callable[[Any, str], None]  # a parsed manifest (from a store): seal and fields
    check_part: Callable[..., str | None]  # (folder, part, *, hash_it) -> a problem, or None
    marker: str  # written after the manifest; without it the save never finished


#: Manifest kinds by schema, each filled in by the module that owns it, on import.
MANIFEST_KINDS: dict[str, ManifestKind] = {}


def check_parts_list(parts: Any, where: str, check_part: Callable[[Any, str], None]) -> set[str]:
    """The file names in a manifest's ``parts``: a non-empty list, each valid by ``check_part``, none twice.

    Raises:
        CorruptCheckpointError: Not a non-empty list, a bad entry, or a file listed twice.
    """
    if not isinstance(parts, list) or not parts:
        raise CorruptCheckpointError(f"{where}: 'parts' must be a non-empty list.")
    seen: set[str] = set()
    for part in parts:
        check_part(part, where)
        if part["file"] in seen:
            raise CorruptCheckpointError(f"{where}: part {part['file']!r} is listed twice.")
        seen.add(part["file"])
    return seen


@dataclass(frozen=True)
class ScanResult:
    """One save found in a run directory.

    Attributes:
        path: The save's folder (or a Lightning ``.ckpt`` file).
        step: Its step number (from the folder name; a Lightning file's
            ``global_step``, ``None`` when unreadable).
        status: ``"ok"``, ``"corrupt"`` or ``"incomplete"``; a Lightning file
            without our integrity footer is ``"unverified"``.
        reason: Why it is not ok (file names only, no directories); ``""`` when ok.
        epoch: A Lightning file's ``epoch`` where readable; ``None`` otherwise.
    """

    __repr__ = short_repr  # one short line: see ckpt_lesson/short_repr.py

    path: Path
    step: int | None
    status: str
    reason: str = ""
    epoch: int | None = None

    @property
    def ok(self) -> bool:
        return self.status == "ok"


def read_manifest(step_dir: str | os.PathLike[str]) -> dict[str, Any]:
    """Read and validate a save's ``manifest.json`` (structure only, no hashing).

    Args:
        step_dir: A published save folder (or a staging folder).

    Returns:
        The manifest dict; ``parts`` is a list of ``{"file", "bytes", "algo", "digest"}``.

    Raises:
        IncompleteCheckpointError: There is no manifest: the save never finished.
        CorruptCheckpointError: Not JSON, or a field is missing or malformed.
        SchemaError: A manifest schema this code does not know.
        UnsafeCheckpointError: A part's name would leave the folder.

    Example:
        >>> manifest = read_manifest("run/step-00000240")  # doctest: +SKIP
        >>> [p["file"] for p in manifest["parts"]]  # doctest: +SKIP
        ['checkpoint.pt']
    """
    step_dir = Path(step_dir)
    where = f"{step_dir.name}/{MANIFEST_NAME}"
    try:
        # A regular file, size-capped, any parse failure = damaged (see files/safe_read.py).
        manifest = read_json_file(step_dir / MANIFEST_NAME, what="manifest")
    except FileNotFoundError:
        raise IncompleteCheckpointError(
            f"{step_dir.name}: no {MANIFEST_NAME}; the save never finished (the manifest is written "
            "last). Restore an older save."
        ) from None
    except OSError as exc:
        why = exc.strerror or exc
        raise CorruptCheckpointError(f"{where}: unreadable ({why}); restore an older save.") from exc
    return check_manifest(manifest, where=where)


def check_manifest(manifest: Any, *, where: str) -> dict[str, Any]:
    """Validate a parsed ``manifest.json`` (seal, schema, step, layout, parts), as :func:`read_manifest` does.

    Also for a manifest that arrived as bytes (from an object store). Raises as :func:`read_manifest`.

    Example:
        >>> check_manifest({"schema": "?"}, where="step-00000240/manifest.json")  # doctest: +SKIP
    """
    if not isinstance(manifest, dict):
        raise CorruptCheckpointError(f"{where}: expected a JSON object; restore an older save.")
    schema = manifest.get("schema")
    if schema == DCP_MANIFEST_SCHEMA:
        # Before the seal check: a multi-rank record has its own seal rule (dcp_manifest.py), and
        # its reader, not the legacy rule of single-process records, gives the verdict.
        raise SchemaError(
            f"{where}: a multi-rank save (schema {schema!r}); restore it with DistributedCheckpointManager."
        )
    # The manifest's own checksum comes first: an unverifiable record is damage, never a refusal.
    verify_record_seal(manifest, where=where, legacy_keys=LEGACY_MANIFEST_KEYS)
    if not isinstance(schema, str):
        raise CorruptCheckpointError(f"{where}: no 'schema' field; restore an older save.")
    if schema != MANIFEST_SCHEMA:
        raise SchemaError(f"{where}: unknown manifest schema {schema!r}; upgrade ckpt_lesson to read it.")
    step = manifest.get("step")
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise CorruptCheckpointError(f"{where}: 'step' must be an int >= 0, got {step!r}.")
    if manifest.get("layout") not in LAYOUTS:
        found = manifest.get("layout")
        raise CorruptCheckpointError(f"{where}: 'layout' must be one of {LAYOUTS}, got {found!r}.")
    seen = check_parts_list(manifest.get("parts"), where, _check_part_entry)
    if manifest["layout"] == "single" and "checkpoint.pt" not in seen:
        raise CorruptCheckpointError(f"{where}: a single-file save must list 'checkpoint.pt' as a part.")
    return manifest


def check_part_file(part: Any, where: str) -> str:
    """Check a manifest part's ``file`` (a plain name in the save folder) and ``bytes``; returns the name.

    Shared by both manifest kinds; each checks its digest fields after this.

    Raises:
        CorruptCheckpointError: Not an object, no name, or no valid size.
        UnsafeCheckpointError: A name that would leave the save folder.

    Example:
        >>> check_part_file({"file": "checkpoint.pt", "bytes": 10}, "m")
        'checkpoint.pt'
    """
    if not isinstance(part, dict):
        raise CorruptCheckpointError(f"{where}: every part must be an object with file, bytes, algo, digest.")
    name = part.get("file")
    if not isinstance(name, str) or not name:
        raise CorruptCheckpointError(f"{where}: a part has no 'file' name.")
    # A manifest is data, and data can be hostile: a part name may only name a file in this folder.
    if "/" in name or "\\" in name or name in (".", "..") or name == MANIFEST_NAME or "\x00" in name:
        raise UnsafeCheckpointError(
            f"{where}: part name {name!r} is not a plain file name in the save folder."
        )
    size = part.get("bytes")
    if isinstance(size, bool) or not isinstance(size, int) or size < 0:
        raise CorruptCheckpointError(f"{where}: part {name!r} has no valid 'bytes' count.")
    return name


def _check_part_entry(part: Any, where: str) -> None:
    name = check_part_file(part, where)
    try:
        part_digest(part)  # {"algo", "digest"}, or {"sha256"} from earlier versions
    except CorruptCheckpointError:
        raise CorruptCheckpointError(
            f"{where}: part {name!r} has no valid 'algo' and 'digest' (or 'sha256')."
        ) from None


def inspect_save(
    step_dir: str | os.PathLike[str], *, hash_parts: bool = True
) -> tuple[ScanResult, dict[str, Any] | None]:
    """Classify one published save folder; returns its result and manifest (if readable).

    Args:
        step_dir: A ``step-XXXXXXXX`` folder.
        hash_parts: ``False`` checks only presence and sizes (a cheap ``stat``
            per part), for callers that verified the bytes earlier.

    A multi-rank save (``layout: dcp``, written by
    :class:`~ckpt_lesson.distributed.DistributedCheckpointManager`) is checked
    the same way, against its own manifest; its manifest is returned as well.

    Raises:
        SchemaError: The manifest has a schema this code does not know (not a
            damaged save, so not silently classified as one).
    """
    step_dir = Path(step_dir)
    step = step_of(step_dir.name)
    if step is None:
        raise CheckpointError(f"{step_dir.name}: not a save folder name (expected step-XXXXXXXX).")
    try:
        manifest, kind = _read_any_manifest(step_dir)
    except IncompleteCheckpointError:
        # With a manifest present, what is missing is a multi-rank save's commit marker (written last).
        markers = [k.marker for k in MANIFEST_KINDS.values()]
        missing = markers[0] if markers and (step_dir / MANIFEST_NAME).exists() else MANIFEST_NAME
        return ScanResult(step_dir, step, "incomplete", f"no {missing} (save never finished)"), None
    except (CorruptCheckpointError, UnsafeCheckpointError) as exc:
        return ScanResult(step_dir, step, "corrupt", str(exc)), None
    if manifest["step"] != step:
        reason = f"{MANIFEST_NAME} records step {manifest['step']}, folder says {step}"
        return ScanResult(step_dir, step, "corrupt", reason), manifest
    problems = []
    for part in manifest["parts"]:
        path = step_dir / part["file"]
        if kind is not None:  # DCP's files carry no footer: size, then the tagged digest (never unpickled)
            problem = kind.check_part(step_dir, part, hash_it=hash_parts)
        elif hash_parts:
            problem = verify_record(path, part)
        elif not path.is_file() or path.is_symlink():
            problem = f"{part['file']}: missing"
        elif path.stat().st_size != part["bytes"]:
            problem = f"{part['file']}: size {path.stat().st_size} != recorded {part['bytes']}"
        else:
            problem = None
        if problem:
            problems.append(problem)
    if problems:
        missing_only = all(p.endswith(": missing") for p in problems)
        status = "incomplete" if missing_only else "corrupt"
        return ScanResult(step_dir, step, status, "; ".join(problems)), manifest
    return ScanResult(step_dir, step, "ok", ""), manifest


def _read_any_manifest(step_dir: Path) -> tuple[dict[str, Any], ManifestKind | None]:
    """``(manifest, kind)``: a single-process manifest (kind ``None``), else one of a registered kind."""
    try:
        return read_manifest(step_dir), None
    except SchemaError as unknown:
        for kind in MANIFEST_KINDS.values():
            try:
                return kind.read(step_dir), kind
            except SchemaError:
                continue
        raise unknown from None  # no reader knows it: keep the first reader's message
