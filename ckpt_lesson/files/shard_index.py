"""Reading a sharded checkpoint's ``index.json`` without trusting it.

:mod:`ckpt_lesson.files.sharded` writes a directory of shards plus ``meta.pt`` plus
``index.json``, the index last. Before a single byte of a shard is unpickled,
the reader here answers three questions from the index and the directory alone:

* **Did the save finish?** No ``index.json`` means the writer died before its
  commit point; a listed file that is missing means the copy is incomplete.
* **Is the index what the writer wrote?** Its structure, schema, shard count,
  sizes and digests (algorithm named, or sha256 in older indexes) are all
  checked, and no key may be listed twice; a damaged or hand-edited index is refused, naming what is wrong.
* **Can it only point inside the directory?** An index is data from disk, and
  a checkpoint may come from someone else. A name like ``../../.ssh/id_rsa``,
  an absolute path or a symlink leading out would make the loader read (and
  hash, and report on) a file that is not part of the checkpoint, so every
  name is resolved and must stay inside the checkpoint directory.

Then :func:`verify_sharded_checkpoint` hashes every file (``scan`` and the
manager rely on it), and :func:`read_sharded_payload` loads each only after its check.
"""

from __future__ import annotations

import os
import re
from pathlib import Path, PurePosixPath, PureWindowsPath
from typing import Any

from ckpt_lesson.errors import (
    CheckpointError,
    CorruptCheckpointError,
    IncompleteCheckpointError,
    SchemaError,
    StateMismatchError,
    UnsafeCheckpointError,
)
from ckpt_lesson.files.hashing import part_digest
from ckpt_lesson.files.integrity import FileDigest, verify_footer
from ckpt_lesson.files.loading import load_verified_file
from ckpt_lesson.files.payload import PARTS_SCHEMA
from ckpt_lesson.files.record_seal import verify_record_seal
from ckpt_lesson.files.safe_read import read_json_file
from ckpt_lesson.files.schema import KNOWN_SCHEMAS, migrate_payload
from ckpt_lesson.files.train_state import BUCKETS

__all__ = [
    "INDEX_NAME",
    "LAYOUTS",
    "META_NAME",
    "SHARDED_SCHEMA",
    "SHARDED_SCHEMAS",
    "TENSOR_REF",
    "push_tensors",
    "read_shard_index",
    "read_sharded_payload",
    "verify_sharded_checkpoint",
]

#: v2 (written now) keeps each parameter's optimizer state in its shard; v1 kept it in meta.pt.
SHARDED_SCHEMA = "ckpt.sharded.v2"
#: Every index schema this code reads.
SHARDED_SCHEMAS = ("ckpt.sharded.v1", SHARDED_SCHEMA)
INDEX_NAME = "index.json"
#: Every top-level key an index had before indexes carried their own checksum.
LEGACY_INDEX_KEYS = frozenset({"schema", "payload_schema", "num_shards", "layout", "shards", "meta"})
META_NAME = "meta.pt"
#: In a sharded state-API save's ``meta.pt``: ``{TENSOR_REF: key}`` stands where a shard's tensor was.
TENSOR_REF = "__shard_tensor__"
#: ``round_robin``: key i goes to shard i % N. ``param_group``: weights and
#: biases/buffers in separate groups of shards, balanced by bytes.
LAYOUTS = ("round_robin", "param_group")
# The names sharded._write_sharded gives; one present but not listed means the folder is not what was saved.
_SHARD_RE = re.compile(r"^model\.shard-\d{3,}\.pt$")


def _bad(ckpt_dir: Path, what: str) -> CorruptCheckpointError:
    return CorruptCheckpointError(
        f"{ckpt_dir / INDEX_NAME}: {what}; the index was damaged or edited after the save. "
        "Restore an older checkpoint."
    )


def _check_entry(ckpt_dir: Path, entry: Any, where: str, *, with_keys: bool) -> None:
    if not isinstance(entry, dict):
        raise _bad(ckpt_dir, f"{where} is not an object")
    if not isinstance(entry.get("file"), str):
        raise _bad(ckpt_dir, f"{where} has no 'file' name")
    size = entry.get("bytes")
    if isinstance(size, bool) or not isinstance(size, int) or size < 0:
        raise _bad(ckpt_dir, f"{where} has no valid 'bytes' (got {size!r})")
    try:
        part_digest(entry)  # {"algo", "digest"}, or {"sha256"} in indexes from earlier versions
    except CorruptCheckpointError:
        raise _bad(ckpt_dir, f"{where} has no valid 'algo' and 'digest' (or 'sha256')") from None
    if with_keys:
        keys = entry.get("keys")
        if not isinstance(keys, list) or not all(isinstance(k, str) for k in keys):
            raise _bad(ckpt_dir, f"{where} has no 'keys' list of strings")


def _safe_path(root: Path, name: str) -> Path:
    """Resolve an index entry's file name, refusing anything that could leave ``root``."""
    parts = re.split(r"[/\\]", name)
    if (
        PurePosixPath(name).is_absolute()
        or PureWindowsPath(name).is_absolute()
        or PureWindowsPath(name).drive
        or "\\" in name
        or "\x00" in name
        or any(p in ("", ".", "..") for p in parts)
    ):
        raise UnsafeCheckpointError(
            f"{root / INDEX_NAME}: file name {name!r} is not a plain relative path inside the "
            "checkpoint directory. Do not load it; an index from an untrusted source can point anywhere."
        )
    try:
        path = (root / name).resolve()
    except (OSError, RuntimeError) as exc:  # a symlink loop: nothing trustworthy at the end of it
        raise UnsafeCheckpointError(
            f"{root / name}: cannot be resolved ({exc}); refusing to read it."
        ) from exc
    try:
        path.relative_to(root)
    except ValueError:
        raise UnsafeCheckpointError(
            f"{root / name}: resolves to {path}, outside the checkpoint directory {root} (a symlink "
            "leaving it). Refusing to read it; copy the real files into the directory instead."
        ) from None
    return path


def _files(ckpt_dir: Path, index: dict[str, Any]) -> list[tuple[Path, dict[str, Any]]]:
    """Every (path, entry) of the index, shards first then meta, each checked to exist."""
    out = []
    for entry in [*index["shards"], index["meta"]]:
        path = _safe_path(ckpt_dir, entry["file"])
        if not path.is_file():
            raise IncompleteCheckpointError(
                f"{ckpt_dir / entry['file']}: listed in {INDEX_NAME} but missing; the checkpoint is "
                "incomplete (a file was deleted or never copied). Restore an older checkpoint."
            )
        out.append((path, entry))
    if len({p for p, _ in out}) != len(out):
        raise _bad(ckpt_dir, "two entries name the same file")
    return out


def read_shard_index(ckpt_dir: str | os.PathLike[str]) -> dict[str, Any]:
    """Read and validate ``index.json`` and the directory around it, reading no shard.

    Checks the structure, that no file name can leave the directory (absolute
    paths, ``..``, escaping symlinks), that no key is listed twice, that the
    shard count agrees with ``num_shards`` and with the shard files present,
    and that every listed file exists.

    Returns:
        The index as parsed from JSON.

    Raises:
        IncompleteCheckpointError: No index (the save never finished) or a listed file is missing.
        CorruptCheckpointError: Unreadable or inconsistent index, or unlisted shard files.
        UnsafeCheckpointError: A file name or symlink leads outside ``ckpt_dir``.
        SchemaError: Not a ``ckpt.sharded.v1`` or ``v2`` index.

    Example:
        >>> read_shard_index("ckpt/step-12")["num_shards"]  # doctest: +SKIP
        4
    """
    root = Path(ckpt_dir).resolve()
    if not root.is_dir():
        raise CheckpointError(f"{ckpt_dir}: no such checkpoint directory; check the path.")
    if not (root / INDEX_NAME).exists():
        raise IncompleteCheckpointError(
            f"{ckpt_dir}: no {INDEX_NAME}; the save never finished (the index is written last). "
            "Resume from an older checkpoint."
        )
    index_path = _safe_path(root, INDEX_NAME)
    try:
        index = read_json_file(index_path, what="index")  # regular file, size cap, any parse failure = damage
    except OSError as exc:
        raise _bad(root, f"unreadable ({exc.strerror or exc})") from exc
    if not isinstance(index, dict):
        raise _bad(root, "not a JSON object")
    verify_record_seal(index, where=str(index_path), legacy_keys=LEGACY_INDEX_KEYS)
    if index.get("schema") not in SHARDED_SCHEMAS:
        raise SchemaError(
            f"{index_path}: schema {index.get('schema')!r} is not one of {SHARDED_SCHEMAS}; "
            "this is not a sharded checkpoint this code can read."
        )
    if index.get("payload_schema") not in (*KNOWN_SCHEMAS, "ckpt.parts.v1"):  # parts: the state API
        # Refused before reading a single shard: the payload inside is a layout this code cannot restore.
        raise SchemaError(
            f"{index_path}: payload schema {index.get('payload_schema')!r} is not one of {KNOWN_SCHEMAS}; "
            "a newer ckpt_lesson wrote it, or it is not a ckpt_lesson checkpoint. Upgrade to read it."
        )
    if index.get("layout") not in LAYOUTS:
        raise _bad(root, f"unknown layout {index.get('layout')!r}")
    n, shards = index.get("num_shards"), index.get("shards")
    if isinstance(n, bool) or not isinstance(n, int) or n < 1 or not isinstance(shards, list):
        raise _bad(root, "'num_shards' or 'shards' is missing or invalid")
    if len(shards) != n:
        raise _bad(root, f"'num_shards' is {n} but {len(shards)} shards are listed")
    for i, entry in enumerate(shards):
        _check_entry(root, entry, f"shard {i}", with_keys=True)
        if index["schema"] != "ckpt.sharded.v1":
            pids = entry.get("optimizer_state")
            if not isinstance(pids, list) or not all(type(p) is int for p in pids):
                raise _bad(root, f"shard {i} has no 'optimizer_state' list of parameter ids")
    _check_entry(root, index.get("meta"), "'meta'", with_keys=False)
    for field, what in (("keys", "key"), ("optimizer_state", "optimizer state")):
        owner: dict[Any, int] = {}
        for i, entry in enumerate(shards):
            for item in entry.get(field, []):
                if item in owner:
                    raise _bad(root, f"{what} {item!r} is listed in shard {owner[item]} and shard {i}")
                owner[item] = i
    _files(root, index)
    listed = {e["file"] for e in shards}
    unlisted = sorted(p.name for p in root.iterdir() if _SHARD_RE.match(p.name) and p.name not in listed)
    if unlisted:
        raise _bad(root, f"the directory holds shard files the index does not list: {unlisted[:5]}")
    return index


def verify_sharded_checkpoint(ckpt_dir: str | os.PathLike[str]) -> list[FileDigest]:
    """Check every file's size and digest against the index, loading nothing.

    Returns:
        One digest per shard (index order), then one for ``meta.pt``.

    Raises:
        CheckpointError: As :func:`read_shard_index`; ``CorruptCheckpointError``
            for a size or hash mismatch.

    Example:
        >>> [d.size for d in verify_sharded_checkpoint("ckpt/step-12")]  # doctest: +SKIP
    """
    root = Path(ckpt_dir).resolve()
    digests = []
    for path, entry in _files(root, read_shard_index(root)):
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size != entry["bytes"]:
                raise CorruptCheckpointError(
                    f"{path}: {size} bytes on disk but {entry['bytes']} in the index; truncated or "
                    "replaced after the save. Restore an older checkpoint."
                )
            algo, want = part_digest(entry)
            digest = verify_footer(f, name=path, algo=algo)
        if digest.digest != want:
            raise CorruptCheckpointError(
                f"{path}: {algo} {digest.digest[:12]}... differs from the index's {want[:12]}...; "
                "the file changed after the save. Restore an older checkpoint."
            )
        digests.append(digest)
    return digests


def push_tensors(tree: Any, tensors: dict[str, Any], used: set[str], where: Path) -> Any:
    """``tree`` with each placeholder of ``shard_plan.pull_tensors`` made its tensor again."""
    if isinstance(tree, dict):
        if set(tree) == {TENSOR_REF}:
            key = tree[TENSOR_REF]
            if key not in tensors or key in used:
                raise _bad(where, f"{META_NAME} refers to tensor {key!r}, which no shard holds once")
            used.add(key)
            return tensors[key]
        return type(tree)((k, push_tensors(v, tensors, used, where)) for k, v in tree.items())
    if isinstance(tree, (list, tuple)):
        items = [push_tensors(v, tensors, used, where) for v in tree]
        return items if isinstance(tree, list) else tuple(items)
    return tree


def _shard_parts(
    root: Path, index: dict[str, Any], entry: dict[str, Any], path: Path, obj: Any
) -> tuple[dict[str, Any], dict[Any, Any]]:
    """``(model tensors, optimizer states)`` of one loaded shard, checked against its index entry."""
    if index["schema"] == "ckpt.sharded.v1":  # a plain {key: tensor} dict; the moments sit in meta.pt
        body, opt = obj, {}
    elif isinstance(obj, dict) and set(obj) == {"model", "optimizer_state"}:
        body, opt = obj["model"], obj["optimizer_state"]
    else:
        raise _bad(root, f"{path.name} is not a {index['schema']} shard (model and optimizer_state)")
    if not isinstance(body, dict) or set(body) != set(entry["keys"]) or len(body) != len(entry["keys"]):
        have = sorted(body) if isinstance(body, dict) else type(body).__name__
        raise _bad(root, f"{path.name} holds keys {str(have)[:200]}, not the listed {entry['keys'][:5]}")
    listed = entry.get("optimizer_state", [])
    if not isinstance(opt, dict) or set(opt) != set(listed) or len(opt) != len(listed):
        raise _bad(root, f"{path.name} holds optimizer states of other parameters than {listed[:5]}")
    return body, opt


def read_sharded_payload(ckpt_dir: str | os.PathLike[str], *, map_location: Any = "cpu") -> dict[str, Any]:
    """Verify every file of a sharded save, then merge them into its payload, applying nothing.

    Nothing is unpickled until its file has passed its size and hash check,
    and every shard must hold exactly the keys the index says. Reads both
    index layouts (``ckpt.sharded.v2``: optimizer state inside the shards;
    ``v1``: in ``meta.pt``) and both payloads: the positional form's (migrated
    to the current schema, every bucket present) and the state API's.

    Raises:
        CheckpointError: As :func:`read_shard_index`; ``CorruptCheckpointError``
            for a size/hash mismatch or a shard whose keys differ from the index;
            ``StateMismatchError`` for a positional payload that lacks a bucket.
    """
    root = Path(ckpt_dir).resolve()
    index = read_shard_index(root)
    loaded = []
    for path, entry in _files(root, index):  # verify (and load) every file before merging any
        algo, want = part_digest(entry)
        obj, _ = load_verified_file(
            path, map_location=map_location, expected_digest=want, algo=algo, expected_size=entry["bytes"]
        )
        loaded.append((path, entry, obj))
    *shards, (meta_path, _, meta) = loaded
    if not isinstance(meta, dict) or "model" in meta or meta.get("schema") != index["payload_schema"]:
        raise _bad(root, f"{meta_path.name} is not the meta part of a {index['payload_schema']} payload")
    merged: dict[str, Any] = {}
    opt_state: dict[Any, Any] = {}
    for path, entry, obj in shards:
        body, opt = _shard_parts(root, index, entry, path, obj)
        merged.update(body)
        opt_state.update(opt)
    if meta["schema"] == PARTS_SCHEMA:
        used: set[str] = set()
        payload = push_tensors(meta, merged, used, root)
        if used != set(merged) or opt_state:
            raise _bad(
                root, f"the shards hold {len(merged) - len(used)} tensor(s) that {META_NAME} never uses"
            )
        return payload
    opt_sd = meta.get("optimizer")
    if opt_state:
        if not isinstance(opt_sd, dict) or not isinstance(opt_sd.get("state"), dict):
            raise _bad(root, f"{meta_path.name} has no optimizer state_dict to merge the shards' states into")
        if set(opt_sd["state"]) & set(opt_state):
            raise _bad(root, f"{meta_path.name} and a shard both hold the state of one parameter")
        whole = {**opt_sd["state"], **opt_state}
        # Back in parameter-id order (every id is an int here: only then are states sharded).
        meta = {**meta, "optimizer": {**opt_sd, "state": {k: whole[k] for k in sorted(whole)}}}
    payload = migrate_payload({**meta, "model": merged}, source=str(root))
    missing = [b for b in BUCKETS if b not in payload]
    if missing:
        raise StateMismatchError(f"{root}: checkpoint lacks {missing}; a resume needs every bucket.")
    return payload
