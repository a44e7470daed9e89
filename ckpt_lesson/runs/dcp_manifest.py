"""The commit record of one distributed save: ``manifest.json`` beside DCP's files.

DCP's ``.metadata`` says which tensor chunk lives at which offset of which
file; it says nothing about whether those files are the bytes that were
written. The manifest does, and it is written last, after every rank's files
and ``.metadata``, so its presence means "this save finished"::

    {
      "schema": "ckpt.manifest.dcp.v1", "layout": "dcp", "step": 40, "world_size": 2,
      "save_id": "5c1e...", "parts": [
        {"file": ".metadata",    "bytes": 2911,  "algo": "xxh3_128", "digest": "..."},
        {"file": "__0_0.distcp", "bytes": 91280, "algo": "xxh3_128", "digest": "..."},
        ...
      ],
      "per_rank_keys": ["rank0_local", "rank1_local"], "state": {"step": 40, ...}, ...
    }

The manifest is JSON, never pickle: it is the one file read before anything
has been verified, so it must be safe to parse whatever it contains.
"""

from __future__ import annotations

import os
import stat
import time
from pathlib import Path
from typing import Any

import torch

from ckpt_lesson.errors import (
    CorruptCheckpointError,
    IncompleteCheckpointError,
    SchemaError,
)
from ckpt_lesson.files.hashing import check_hash_record, hash_file
from ckpt_lesson.files.record_seal import SEAL_KEY, verify_record_seal
from ckpt_lesson.files.safe_read import parse_json_text, read_regular_file
from ckpt_lesson.files.schema import MANIFEST_NAME, check_recorded_step
from ckpt_lesson.runs.commit import COMMIT_MARKER, PUBLISH_MODES, check_commit_marker
from ckpt_lesson.runs.layout import (
    DCP_MANIFEST_SCHEMA,
    MANIFEST_KINDS,
    ManifestKind,
    check_part_file,
    check_parts_list,
)

__all__ = [
    "LAYOUT",
    "MANIFEST_NAME",
    "MANIFEST_SCHEMA",
    "MAX_MANIFEST_BYTES",
    "METADATA_FILE",
    "build_manifest",
    "check_dcp_manifest",
    "check_dcp_part",
    "read_dcp_manifest",
]

MANIFEST_SCHEMA = DCP_MANIFEST_SCHEMA
LAYOUT = "dcp"
#: DCP's own index of the save (pickled by DCP; read here only through a restricted unpickler).
METADATA_FILE = ".metadata"
#: A manifest larger than this is refused unread: a save of a few thousand files is far below it.
MAX_MANIFEST_BYTES = 16 << 20


def build_manifest(
    *,
    step: int,
    world_size: int,
    parts: list[dict[str, Any]],
    per_rank_keys: list[str],
    state: dict[str, Any],
    covers: list[str],
    save_id: str,
    dcp_version: str | None,
    metadata: dict[str, Any] | None = None,
    publish: str = "rename",
) -> dict[str, Any]:
    """Assemble (and validate) the manifest of one save.

    Args:
        step: The step saved; names the folder.
        world_size: Ranks that wrote it; a restore with another count must re-map.
        parts: ``{"file", "bytes", "algo", "digest"}`` for every file, ``.metadata`` included.
        per_rank_keys: The state-dict key holding each rank's RNG and data position, by rank.
        state: Rank 0's counters (step, epoch, batch_in_epoch), for humans and scans.
        covers: The buckets saved (``model``, ``optimizer``, ``scheduler``, ``rng``, ``data``).
        save_id: A fresh unique id (DCP's own ``save_id``).
        dcp_version: The DCP format version written into ``.metadata``.
        metadata: The caller's JSON dict (run id, config hash), copied in.
        publish: ``"rename"`` or ``"marker"``; only a marker-mode manifest records
            it (``"publish": "marker"``), telling readers to require the commit marker.

    Returns:
        The manifest dict, sorted parts.

    Raises:
        CorruptCheckpointError: A field is malformed (a writer bug: nothing is published).

    Example:
        >>> m = build_manifest(step=4, world_size=1, parts=[{"file": ".metadata", "bytes": 1,
        ...     "algo": "sha256", "digest": "0" * 64}], per_rank_keys=["rank0_local"],
        ...     state={"step": 4}, covers=["model"], save_id="x", dcp_version="1.0.0")
        >>> m["layout"], m["world_size"]
        ('dcp', 1)
    """
    manifest = {
        "schema": MANIFEST_SCHEMA,
        "layout": LAYOUT,
        "step": step,
        "world_size": world_size,
        "save_id": save_id,
        "parts": sorted(parts, key=lambda p: p["file"]),
        "per_rank_keys": list(per_rank_keys),
        "state": dict(state),
        "covers": list(covers),
        "dcp_version": dcp_version,
        "torch": torch.__version__,
        "metadata": dict(metadata or {}),
        "created_at": time.time(),
    }
    if publish != "rename":
        manifest["publish"] = publish
    return check_dcp_manifest(manifest, where=f"manifest of step {step}", sealed=False)


def read_dcp_manifest(folder: str | os.PathLike[str]) -> tuple[dict[str, Any], bytes]:
    """Read and validate ``folder/manifest.json`` (structure only, no hashing).

    Args:
        folder: A published save (or a staging folder).

    Returns:
        ``(manifest, raw_bytes)``; the raw bytes let ranks check they all read the same record.

    Raises:
        IncompleteCheckpointError: No manifest (or, for ``publish="marker"``, no commit
            marker): the save never finished.
        CorruptCheckpointError: Not a regular file, too large, not JSON, or malformed.
        SchemaError: Another manifest schema (e.g. a single-process save).
        UnsafeCheckpointError: A part name that would leave the folder.

    Example:
        >>> manifest, raw = read_dcp_manifest("run/step-00000040")  # doctest: +SKIP
    """
    folder = Path(folder)
    where = f"{folder.name}/{MANIFEST_NAME}"
    try:
        # The one bounded reader: a symlink, a FIFO, an oversize file and EIO all come out as damage.
        raw = read_regular_file(folder / MANIFEST_NAME, limit=MAX_MANIFEST_BYTES, what="manifest")
    except FileNotFoundError:
        raise IncompleteCheckpointError(
            f"{folder.name}: no {MANIFEST_NAME}; the save never finished (it is written last). "
            "Restore an older save."
        ) from None
    manifest = check_dcp_manifest(parse_json_text(raw, where=where), where=where)
    check_recorded_step(manifest["step"], folder, record=MANIFEST_NAME)
    if manifest.get("publish") == "marker":
        check_commit_marker(folder, manifest, raw)  # written last: without it the save never finished
    return manifest, raw


def check_dcp_manifest(manifest: Any, *, where: str, sealed: bool = True) -> dict[str, Any]:
    """Check a multi-rank manifest read back (from a folder or a store): its seal first, then every field.

    Every multi-rank manifest is written sealed (see ``files/record_seal.py``), and
    there are no older unsealed ones to accept: a record without its seal, or with a
    field changed after sealing, can only be damage (or an edit), so nothing in it
    may be trusted, however well-formed its fields look. A record of another schema
    is refused with a message that names the right manager. ``sealed=False``
    checks the fields of a record being built, before its seal is added.

    Returns:
        ``manifest``, checked.

    Raises:
        CorruptCheckpointError: No seal, a damaged seal, contents that do not match it, or a bad field.
        SchemaError, UnsafeCheckpointError: As :func:`read_dcp_manifest`.

    Example:
        >>> check_dcp_manifest({"schema": MANIFEST_SCHEMA, "step": 4}, where="m")
        Traceback (most recent call last):
        ...
        ckpt_lesson.errors.CorruptCheckpointError: m: a multi-rank manifest without its checksum ...
        >>> check_dcp_manifest({"schema": "other"}, where="m")
        Traceback (most recent call last):
        ...
        ckpt_lesson.errors.SchemaError: m: manifest schema 'other' is not ckpt.manifest.dcp.v1; ...
    """
    if sealed and isinstance(manifest, dict) and SEAL_KEY in manifest:
        # A flipped bit anywhere in the record, the seal's own name included, fails here.
        verify_record_seal(manifest, where=where, legacy_keys=())
    elif sealed and isinstance(manifest, dict) and manifest.get("schema") == MANIFEST_SCHEMA:
        raise CorruptCheckpointError(
            f"{where}: a multi-rank manifest without its checksum ({SEAL_KEY!r}); every one is written "
            "sealed, so this one was damaged or edited after it was written and nothing in it can be "
            "trusted. Restore an older save (restore_latest falls back on its own)."
        )
    if not isinstance(manifest, dict):
        raise CorruptCheckpointError(f"{where}: expected a JSON object; restore an older save.")
    schema = manifest.get("schema")
    if schema != MANIFEST_SCHEMA:
        raise SchemaError(
            f"{where}: manifest schema {schema!r} is not {MANIFEST_SCHEMA}; "
            "this folder was not written by DistributedCheckpointManager (use CheckpointManager)."
        )
    if manifest.get("layout") != LAYOUT:
        raise CorruptCheckpointError(f"{where}: 'layout' must be {LAYOUT!r}, got {manifest.get('layout')!r}.")
    for key, low in (("step", 0), ("world_size", 1)):
        value = manifest.get(key)
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise CorruptCheckpointError(f"{where}: {key!r} must be an int >= {low}, got {value!r}.")
    if not isinstance(manifest.get("save_id"), str):
        raise CorruptCheckpointError(f"{where}: 'save_id' must be a string.")
    keys = manifest.get("per_rank_keys")
    if (
        not isinstance(keys, list)
        or len(keys) != manifest["world_size"]
        or not all(isinstance(k, str) for k in keys)
    ):
        raise CorruptCheckpointError(f"{where}: 'per_rank_keys' must list one key per rank.")
    if not isinstance(manifest.get("state"), dict):
        raise CorruptCheckpointError(f"{where}: 'state' must be an object.")
    covers = manifest.get("covers")
    if not isinstance(covers, list) or not all(isinstance(c, str) for c in covers):
        raise CorruptCheckpointError(f"{where}: 'covers' must list the saved buckets.")
    if manifest.get("publish", "rename") not in PUBLISH_MODES:
        raise CorruptCheckpointError(f"{where}: 'publish' must be one of {PUBLISH_MODES}.")
    seen = check_parts_list(manifest.get("parts"), where, _check_part)
    if METADATA_FILE not in seen:
        raise CorruptCheckpointError(f"{where}: no {METADATA_FILE} part; a DCP save always has one.")
    return manifest


def _check_part(part: Any, where: str) -> None:
    if not isinstance(part, dict) or set(part) != {"file", "bytes", "algo", "digest"}:
        raise CorruptCheckpointError(f"{where}: every part must be an object with file, bytes, algo, digest.")
    name = check_part_file(part, where)  # a plain name in the save folder, a size: as a single-process part
    check_hash_record(part, where=f"{where}: part {name!r}")


def check_dcp_part(folder: Path, part: dict[str, Any], *, hash_it: bool = True) -> str | None:
    """Check one listed file of a distributed save: type, size, then digest.

    The size comes first (a ``stat``, free); the file is read only when it could
    still match. The scan of a run directory and the ranks of a restore both
    call this, so one verdict serves both.

    Args:
        folder: The save folder.
        part: A validated part record ``{"file", "bytes", "algo", "digest"}``.
        hash_it: ``False`` stops after type and size.

    Returns:
        ``None`` when the file matches, else a short reason naming the file
        (``"__0_0.distcp: missing"`` when it is not there).

    Example:
        >>> check_dcp_part(Path("run/step-00000040"), manifest["parts"][0])  # doctest: +SKIP
        '__0_0.distcp: size 9 != recorded 91280'
    """
    name = part["file"]
    try:
        info = os.lstat(folder / name)
    except FileNotFoundError:
        return f"{name}: missing"
    if not stat.S_ISREG(info.st_mode):
        return f"{name}: not a regular file"
    if info.st_size != part["bytes"]:
        return f"{name}: size {info.st_size} != recorded {part['bytes']}"
    if not hash_it:
        return None
    try:
        _, record = hash_file(folder / name, part["algo"])
    except OSError as exc:
        return f"{name}: unreadable ({type(exc).__name__})"
    if record["digest"] != part["digest"]:
        found, recorded = record["digest"][:12], part["digest"][:12]
        return f"{name}: {record['algo']} {found}... != recorded {recorded}..."
    return None


# So that single-process code can read a multi-rank save without importing this module.
MANIFEST_KINDS[MANIFEST_SCHEMA] = ManifestKind(
    read=lambda folder: read_dcp_manifest(folder)[0],
    check=lambda manifest, where: check_dcp_manifest(manifest, where=where),
    check_part=check_dcp_part,
    marker=COMMIT_MARKER,
)
