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

**Hashes are computed while writing.** :func:`~ckpt_lesson.files.atomic.atomic_save`
hashes the bytes as ``torch.save`` streams them to disk, so the sha256 that
goes into the index costs no second read (which would nearly double the save
time) and describes exactly the bytes that were written. The loader checks
every file's size and sha256 against the index *before* anything is applied:
a refused checkpoint leaves the model exactly as it was.

This module plans, saves and loads; reading and validating the index (and
keeping every file name inside the directory) is :mod:`ckpt_lesson.files.shard_index`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ckpt_lesson.errors import CheckpointError, StateMismatchError
from ckpt_lesson.files.atomic import atomic_save, atomic_write_json, make_dirs
from ckpt_lesson.files.checkpoint import BUCKETS, TrainState, apply_payload, build_payload, load_verified_file
from ckpt_lesson.files.hashing import DEFAULT_ALGO
from ckpt_lesson.files.integrity import FileDigest, part_digest
from ckpt_lesson.files.record_seal import seal_record
from ckpt_lesson.files.schema import migrate_payload

# The read side (index validation, path safety, hashing against the index) lives in
# shard_index; its names are re-exported here, where callers have always imported them.
from ckpt_lesson.files.shard_index import (
    _SHA_RE,  # noqa: F401
    _SHARD_RE,  # noqa: F401
    INDEX_NAME,
    LAYOUTS,
    META_NAME,
    SHARDED_SCHEMA,
    _bad,
    _check_entry,  # noqa: F401
    _files,
    _safe_path,  # noqa: F401
    read_shard_index,
    verify_sharded_checkpoint,
)

__all__ = [
    "INDEX_NAME",
    "LAYOUTS",
    "META_NAME",
    "SHARDED_SCHEMA",
    "SHARD_SCHEMA",
    "ShardedSaveResult",
    "load_sharded_checkpoint",
    "plan_shards",
    "read_shard_index",
    "save_sharded_checkpoint",
    "shard_keys_by_prefix",
    "verify_sharded_checkpoint",
]


#: The lesson's name for the schema of its sharded format. Ours has one
#: schema for the whole sharded checkpoint, recorded in ``index.json``; shard
#: bodies are plain ``{key: tensor}`` dicts whose keys the index lists.
SHARD_SCHEMA = SHARDED_SCHEMA


def _shard_name(i: int) -> str:
    # shard_index._SHARD_RE recognises exactly these names; change both together.
    return f"model.shard-{i:03d}.pt"


@dataclass(frozen=True)
class ShardedSaveResult:
    """What :func:`save_sharded_checkpoint` wrote.

    Attributes:
        out_dir: The checkpoint directory.
        files: One ``{"name", "keys", "bytes", "algo", "digest"}`` dict per shard, in order.
        meta: ``{"name", "bytes", "algo", "digest"}`` of ``meta.pt``.
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


def shard_keys_by_prefix(state_dict: dict[str, Any], num_shards: int) -> dict[int, list[str]]:
    """The lesson's layout helper: ``{shard: [keys]}``, round robin over the *sorted* keys.

    Key ``j`` of ``sorted(state_dict)`` goes to shard ``j % num_shards``, so
    shard sizes (in keys) differ by at most one and the answer does not depend
    on the order the model registered its parameters. Every shard index from
    ``0`` to ``num_shards - 1`` is present, possibly with an empty list. (The
    name is the lesson's; :func:`plan_shards` is the layout engine
    :func:`save_sharded_checkpoint` uses, in ``state_dict`` order.)

    Args:
        state_dict: Key -> value, e.g. ``model.state_dict()``.
        num_shards: How many shards, an int >= 1.

    Returns:
        A dict from shard index to that shard's keys, in ascending key order.

    Raises:
        CheckpointError: ``num_shards`` is not an int >= 1 (a ``ValueError``, as in the lesson).

    Example:
        >>> shard_keys_by_prefix({"c": 0, "a": 0, "b": 0}, 2)
        {0: ['a', 'c'], 1: ['b']}
    """
    _check_plan_args(num_shards, "round_robin")
    keys = sorted(state_dict)
    return {i: keys[i::num_shards] for i in range(num_shards)}


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
    rng: dict[str, Any] | None = None,
    algo: str = DEFAULT_ALGO,
) -> ShardedSaveResult:
    """Save a resumable checkpoint as shards + ``meta.pt`` + ``index.json`` (last).

    Args:
        model, optimizer, scheduler, state, extras, data, rng: As for
            :func:`~ckpt_lesson.files.checkpoint.save_checkpoint`.
        out_dir: A new directory (created with its parents). One that already
            holds an ``index.json`` is refused: a checkpoint is never rewritten
            in place. Leftover shards of an unfinished save (no index) are removed.
        num_shards: Number of shard files for the model's weights.
        layout: How keys are assigned; see :func:`plan_shards`.
        algo: Integrity hash of every file and index entry.

    Returns:
        A :class:`ShardedSaveResult` with every file's size and digest.

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
    payload = build_payload(model, optimizer, scheduler, state, extras=extras, data=data, rng=rng)
    model_sd = payload.pop("model")  # what is left is meta.pt: every other bucket
    plan = plan_shards(model_sd, num_shards, layout)
    make_dirs(out_dir)  # durably: the directory must survive a power loss, not only its files
    names = {_shard_name(i) for i in range(num_shards)}
    for stale in out_dir.glob("model.shard-*.pt"):
        if stale.name not in names:  # no index here, so nothing in this directory was ever committed
            stale.unlink()
    files = []
    for i, keys in enumerate(plan):
        body = {k: _own_storage(model_sd[k]) for k in keys}
        digest = atomic_save(body, out_dir / _shard_name(i), algo=algo)
        files.append({"name": _shard_name(i), "keys": keys, **digest.record()})
    meta_digest = atomic_save(payload, out_dir / META_NAME, algo=algo)
    meta = {"name": META_NAME, **meta_digest.record()}
    index = {
        "schema": SHARDED_SCHEMA,
        "payload_schema": payload["schema"],
        "num_shards": num_shards,
        "layout": layout,
        "shards": [{"file": f["name"], **{k: v for k, v in f.items() if k != "name"}} for f in files],
        "meta": {"file": META_NAME, **{k: v for k, v in meta.items() if k != "name"}},
    }
    index_digest = atomic_write_json(seal_record(index), out_dir / INDEX_NAME, algo=algo)  # the commit point
    return ShardedSaveResult(out_dir=out_dir, files=files, meta=meta, index=index_digest)


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
        The saved :class:`~ckpt_lesson.files.checkpoint.TrainState`.

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
        algo, want = part_digest(entry)
        obj, _ = load_verified_file(
            path, map_location=map_location, expected_digest=want, algo=algo, expected_size=entry["bytes"]
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
