"""Sharded checkpoints: the model's weights split over several files plus an index.

Why shard at all? Three reasons that show up as models grow:

* **parallel writes**: each shard is an independent file, so several ranks (or
  threads) can write at once instead of queueing behind one big ``torch.save``;
* **partial loads**: a reader that needs a few tensors opens only their shards;
* **file-size limits**: some file systems, object stores and upload tools cap
  a single file's size; many medium files get through where one huge one fails.

A sharded checkpoint is a directory::

    model.shard-000.pt ... model.shard-NNN.pt   slices of model.state_dict()
    meta.pt                                     every other bucket of the payload
    index.json                                  which key lives where, plus sizes and sha256s

**The index is written last, and its presence is the commit.** Shards and
``meta.pt`` are written first, each atomically; only then does ``index.json``
appear (atomically too). A crash at any earlier moment leaves a directory
without an index, which the loader reports as a save that never finished. A
crash can never leave an index that points at files that are not all there.

**Hashes are computed while writing.** :func:`~ckpt_lesson.atomic.atomic_save`
hashes the bytes as ``torch.save`` streams them to disk, so the sha256 that
goes into the index costs no second read (which would nearly double the save
time) and describes exactly the bytes that were written. The loader checks
every file's size and sha256 against the index *before* anything is applied:
a refused checkpoint leaves the model exactly as it was.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path, PurePosixPath, PureWindowsPath
from typing import Any

import torch

from .atomic import atomic_save, atomic_write_json, fsync_dir
from .checkpoint import BUCKETS, TrainState, apply_payload, build_payload, load_verified_file
from .errors import (
    CheckpointError,
    CorruptCheckpointError,
    IncompleteCheckpointError,
    SchemaError,
    StateMismatchError,
    UnsafeCheckpointError,
)
from .integrity import FileDigest, verify_footer
from .schema import KNOWN_SCHEMAS, migrate_payload

__all__ = [
    "INDEX_NAME",
    "LAYOUTS",
    "META_NAME",
    "SHARDED_SCHEMA",
    "ShardedSaveResult",
    "load_sharded_checkpoint",
    "plan_shards",
    "read_shard_index",
    "save_sharded_checkpoint",
    "shard_keys_by_prefix",
    "verify_sharded_checkpoint",
]

SHARDED_SCHEMA = "ckpt.sharded.v1"
INDEX_NAME = "index.json"
META_NAME = "meta.pt"
#: ``round_robin``: key i goes to shard i % N. ``param_group``: weights and
#: biases/buffers in separate groups of shards, balanced by bytes.
LAYOUTS = ("round_robin", "param_group")
_SHARD_RE = re.compile(r"^model\.shard-\d{3,}\.pt$")
_SHA_RE = re.compile(r"^[0-9a-f]{64}$")


def _shard_name(i: int) -> str:
    return f"model.shard-{i:03d}.pt"


@dataclass(frozen=True)
class ShardedSaveResult:
    """What :func:`save_sharded_checkpoint` wrote.

    Attributes:
        out_dir: The checkpoint directory.
        files: One ``{"name", "keys", "bytes", "sha256"}`` dict per shard, in order.
        meta: ``{"name", "bytes", "sha256"}`` of ``meta.pt``.
        index: Digest of ``index.json``; a manifest can record it to pin the whole save.
    """

    out_dir: Path
    files: list[dict[str, Any]]
    meta: dict[str, Any]
    index: FileDigest

    @property
    def shard_bytes(self) -> list[int]:
        """Size of each shard file, for comparing how evenly a layout balances."""
        return [f["bytes"] for f in self.files]


def _check_plan_args(num_shards: Any, layout: Any) -> None:
    if isinstance(num_shards, bool) or not isinstance(num_shards, int) or num_shards < 1:
        raise CheckpointError(f"num_shards must be an int >= 1, got {num_shards!r}.")
    if layout not in LAYOUTS:
        raise CheckpointError(f"unknown shard layout {layout!r}; choose one of {LAYOUTS}.")
    if layout == "param_group" and num_shards < 2:
        raise CheckpointError(
            "layout 'param_group' puts weights and biases/buffers in separate shards, so it needs "
            f"num_shards >= 2 (got {num_shards}); pass more shards or use layout='round_robin'."
        )


def _nbytes(value: Any) -> int:
    return value.numel() * value.element_size() if isinstance(value, torch.Tensor) else 0


def _own_storage(value: Any) -> Any:
    # torch.save writes a tensor's *whole* storage. A view into a bigger buffer (a
    # slice, a flattened parameter) would drag all of that buffer into every shard
    # holding one of its views; a copy keeps each shard to its own bytes.
    if isinstance(value, torch.Tensor) and value.untyped_storage().nbytes() > _nbytes(value):
        return value.clone()
    return value


def _balance(keys: list[str], sizes: dict[str, int], n: int, order: dict[str, int]) -> list[list[str]]:
    # Greedy largest-first into the currently lightest shard: simple, and within
    # one largest tensor of the best split. Ties go to the lower shard index.
    shards: list[list[str]] = [[] for _ in range(n)]
    load = [0] * n
    for key in sorted(keys, key=lambda k: (-sizes[k], order[k])):
        lightest = min(range(n), key=lambda i: (load[i], i))
        shards[lightest].append(key)
        load[lightest] += sizes[key]
    return [sorted(s, key=order.__getitem__) for s in shards]


def plan_shards(state_dict: dict[str, Any], num_shards: int, layout: str = "round_robin") -> list[list[str]]:
    """Decide which keys go to which shard; pure, touches no disk.

    ``round_robin`` sends key ``i`` (in ``state_dict`` order) to shard
    ``i % num_shards``: trivial, but shard sizes follow whatever order the keys
    happen to be in. ``param_group`` gives weights (keys ending in ``weight``)
    the first ``ceil(num_shards / 2)`` shards and biases plus buffers the other
    ``floor(num_shards / 2)``, then balances each group by tensor bytes.

    Args:
        state_dict: Key -> tensor, e.g. ``model.state_dict()``.
        num_shards: How many shard files (some may be empty for a tiny model).
        layout: One of :data:`LAYOUTS`.

    Returns:
        ``num_shards`` lists of keys; every key appears exactly once, and within
        a shard keys keep their ``state_dict`` order.

    Raises:
        CheckpointError: Bad ``num_shards`` or ``layout``.

    Example:
        >>> plan_shards({"a.weight": torch.zeros(4), "a.bias": torch.zeros(1)}, 2, "param_group")
        [['a.weight'], ['a.bias']]
    """
    _check_plan_args(num_shards, layout)
    keys = list(state_dict)
    if layout == "round_robin":
        return [keys[i::num_shards] for i in range(num_shards)]
    order = {k: i for i, k in enumerate(keys)}
    sizes = {k: _nbytes(v) for k, v in state_dict.items()}
    weights = [k for k in keys if k.endswith("weight")]
    others = [k for k in keys if not k.endswith("weight")]
    n_weights = (num_shards + 1) // 2
    return _balance(weights, sizes, n_weights, order) + _balance(others, sizes, num_shards - n_weights, order)


def shard_keys_by_prefix(state_dict: dict[str, Any], num_shards: int) -> list[list[str]]:
    """The lesson's original helper: round robin over keys (key ``i`` to shard ``i % N``).

    The name is historical (the lesson kept it); it is ``plan_shards(..., "round_robin")``.

    Example:
        >>> shard_keys_by_prefix({"a": 0, "b": 0, "c": 0}, 2)
        [['a', 'c'], ['b']]
    """
    return plan_shards(state_dict, num_shards, "round_robin")


def _make_dir(out_dir: Path) -> None:
    # Make the directory and fsync each new entry's parent, so the directory
    # itself survives a power loss, not only the files inside it.
    missing = [p for p in (out_dir, *out_dir.parents) if not p.exists()]
    out_dir.mkdir(parents=True, exist_ok=True)
    for p in reversed(missing):
        fsync_dir(p.parent)


def save_sharded_checkpoint(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    state: TrainState,
    out_dir: str | os.PathLike[str],
    *,
    num_shards: int,
    layout: str = "round_robin",
    extras: dict[str, Any] | None = None,
    data: dict[str, Any] | None = None,
) -> ShardedSaveResult:
    """Save a resumable checkpoint as shards + ``meta.pt`` + ``index.json`` (last).

    Args:
        model, optimizer, scheduler, state, extras, data: As for
            :func:`~ckpt_lesson.checkpoint.save_checkpoint`.
        out_dir: A new directory (created with its parents). One that already
            holds an ``index.json`` is refused: a checkpoint is never rewritten
            in place. Leftover shards of an unfinished save (no index) are removed.
        num_shards: Number of shard files for the model's weights.
        layout: How keys are assigned; see :func:`plan_shards`.

    Returns:
        A :class:`ShardedSaveResult` with every file's size and sha256.

    Raises:
        CheckpointError: Bad ``num_shards``/``layout``, or ``out_dir`` already
            holds a finished checkpoint.

    Example:
        >>> save_sharded_checkpoint(model, opt, sched, state, "ckpt/step-12", num_shards=4)  # doctest: +SKIP
    """
    _check_plan_args(num_shards, layout)
    out_dir = Path(out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise CheckpointError(f"{out_dir}: is a file; a sharded checkpoint needs a directory of its own.")
    if (out_dir / INDEX_NAME).exists():
        raise CheckpointError(
            f"{out_dir}: already holds a finished checkpoint ({INDEX_NAME}); checkpoints are never "
            "overwritten in place. Choose a new directory, e.g. one per step."
        )
    payload = build_payload(model, optimizer, scheduler, state, extras=extras, data=data)
    model_sd = payload.pop("model")  # what is left is meta.pt: every other bucket
    plan = plan_shards(model_sd, num_shards, layout)
    _make_dir(out_dir)
    names = {_shard_name(i) for i in range(num_shards)}
    for stale in out_dir.glob("model.shard-*.pt"):
        if stale.name not in names:  # no index here, so nothing in this directory was ever committed
            stale.unlink()
    files = []
    for i, keys in enumerate(plan):
        digest = atomic_save({k: _own_storage(model_sd[k]) for k in keys}, out_dir / _shard_name(i))
        files.append({"name": _shard_name(i), "keys": keys, "bytes": digest.size, "sha256": digest.sha256})
    meta_digest = atomic_save(payload, out_dir / META_NAME)
    meta = {"name": META_NAME, "bytes": meta_digest.size, "sha256": meta_digest.sha256}
    index = {
        "schema": SHARDED_SCHEMA,
        "payload_schema": payload["schema"],
        "num_shards": num_shards,
        "layout": layout,
        "shards": [
            {"file": f["name"], "keys": f["keys"], "bytes": f["bytes"], "sha256": f["sha256"]} for f in files
        ],
        "meta": {"file": META_NAME, "bytes": meta["bytes"], "sha256": meta["sha256"]},
    }
    index_digest = atomic_write_json(index, out_dir / INDEX_NAME)  # the commit point
    return ShardedSaveResult(out_dir=out_dir, files=files, meta=meta, index=index_digest)


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
    if not isinstance(entry.get("sha256"), str) or not _SHA_RE.match(entry["sha256"]):
        raise _bad(ckpt_dir, f"{where} has no valid 'sha256'")
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
        SchemaError: Not a ``ckpt.sharded.v1`` index.

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
        index = json.loads(index_path.read_bytes().decode("utf-8"))
    except (ValueError, UnicodeDecodeError) as exc:
        raise _bad(root, f"not valid JSON ({exc})") from exc
    if not isinstance(index, dict):
        raise _bad(root, "not a JSON object")
    if index.get("schema") != SHARDED_SCHEMA:
        raise SchemaError(
            f"{index_path}: schema {index.get('schema')!r} is not {SHARDED_SCHEMA!r}; "
            "this is not a sharded checkpoint this code can read."
        )
    if index.get("payload_schema") not in KNOWN_SCHEMAS:
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
    _check_entry(root, index.get("meta"), "'meta'", with_keys=False)
    seen: dict[str, int] = {}
    for i, entry in enumerate(shards):
        for key in entry["keys"]:
            if key in seen:
                raise _bad(root, f"key {key!r} is listed in shard {seen[key]} and shard {i}")
            seen[key] = i
    _files(root, index)
    listed = {e["file"] for e in shards}
    unlisted = sorted(p.name for p in root.iterdir() if _SHARD_RE.match(p.name) and p.name not in listed)
    if unlisted:
        raise _bad(root, f"the directory holds shard files the index does not list: {unlisted[:5]}")
    return index


def verify_sharded_checkpoint(ckpt_dir: str | os.PathLike[str]) -> list[FileDigest]:
    """Check every file's size and sha256 against the index, loading nothing.

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
            digest = verify_footer(f, name=path)
        if digest.sha256 != entry["sha256"]:
            raise CorruptCheckpointError(
                f"{path}: sha256 {digest.sha256[:12]}... differs from the index's {entry['sha256'][:12]}...; "
                "the file changed after the save. Restore an older checkpoint."
            )
        digests.append(digest)
    return digests


def load_sharded_checkpoint(
    ckpt_dir: str | os.PathLike[str],
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    *,
    map_location: str | torch.device = "cpu",
) -> TrainState:
    """Verify every file of a sharded checkpoint, then merge and restore all buckets.

    Nothing is applied until every file has passed its size and hash check
    and every shard holds exactly the keys the index says.

    Returns:
        The saved :class:`~ckpt_lesson.checkpoint.TrainState`.

    Raises:
        CheckpointError: As :func:`read_shard_index`; ``CorruptCheckpointError``
            for a size/hash mismatch or a shard whose keys differ from the index;
            ``StateMismatchError`` when the keys do not fit ``model``.

    Example:
        >>> state = load_sharded_checkpoint("ckpt/step-12", model, opt, sched)  # doctest: +SKIP
    """
    root = Path(ckpt_dir).resolve()
    index = read_shard_index(root)
    loaded = []
    for path, entry in _files(root, index):  # verify (and load) every file before merging any
        obj, _ = load_verified_file(
            path, map_location=map_location, expected_sha256=entry["sha256"], expected_size=entry["bytes"]
        )
        loaded.append((path, entry, obj))
    *shards, (meta_path, _, meta) = loaded
    merged: dict[str, Any] = {}
    for path, entry, obj in shards:
        if not isinstance(obj, dict) or set(obj) != set(entry["keys"]) or len(obj) != len(entry["keys"]):
            have = sorted(obj) if isinstance(obj, dict) else type(obj).__name__
            raise _bad(root, f"{path.name} holds keys {str(have)[:200]}, not the listed {entry['keys'][:5]}")
        merged.update(obj)
    if not isinstance(meta, dict) or "model" in meta or meta.get("schema") != index["payload_schema"]:
        raise _bad(root, f"{meta_path.name} is not the meta part of a {index['payload_schema']} payload")
    payload = migrate_payload({**meta, "model": merged}, source=str(root))
    missing = [b for b in BUCKETS if b not in payload]
    if missing:
        raise StateMismatchError(f"{root}: checkpoint lacks {missing}; a resume needs every bucket.")
    return apply_payload(payload, model, optimizer, scheduler, source=str(root))
