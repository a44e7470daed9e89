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
    index.json                                  which key lives where, plus sizes and digests

**The index is written last, and its presence is the commit.** Shards and
``meta.pt`` are written first, each atomically; only then does ``index.json``
appear (atomically too). A crash at any earlier moment leaves a directory
without an index, which the loader reports as a save that never finished. A
crash can never leave an index that points at files that are not all there.

**Hashes are computed while writing** (by :func:`~ckpt_lesson.files.atomic.atomic_save`),
so the index costs no second read (which would nearly double the save time).
Reading and checking it, every file *before* anything is applied, is
:mod:`ckpt_lesson.files.shard_index`.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ckpt_lesson.errors import CheckpointError
from ckpt_lesson.files.apply import apply_payload
from ckpt_lesson.files.atomic import atomic_save, atomic_write_json, make_dirs
from ckpt_lesson.files.hashing import DEFAULT_ALGO
from ckpt_lesson.files.integrity import FileDigest
from ckpt_lesson.files.payload import build_payload
from ckpt_lesson.files.record_seal import seal_record
from ckpt_lesson.files.shard_index import INDEX_NAME, META_NAME, SHARDED_SCHEMA, read_sharded_payload
from ckpt_lesson.files.shard_plan import _nbytes, plan_optimizer_shards, plan_shards, pull_tensors
from ckpt_lesson.files.train_state import TrainState
from ckpt_lesson.short_repr import short_repr

__all__ = [
    "SHARD_SCHEMA",
    "ShardedSaveResult",
    "load_sharded_checkpoint",
    "save_sharded_checkpoint",
    "write_state_payload",
]


#: The lesson's name for the schema of its sharded format. Ours has one
#: schema for the whole sharded checkpoint, recorded in ``index.json``; each shard
#: body holds the model tensors and optimizer states the index lists for it.
SHARD_SCHEMA = SHARDED_SCHEMA


@dataclass(frozen=True)
class ShardedSaveResult:
    """What :func:`save_sharded_checkpoint` wrote.

    Attributes:
        out_dir: The checkpoint directory.
        files: One ``{"name", "keys", "bytes", "algo", "digest"}`` dict per shard, in order.
        meta: ``{"name", "bytes", "algo", "digest"}`` of ``meta.pt``.
        index: Digest of ``index.json``; a manifest can record it to pin the whole save.
    """

    __repr__ = short_repr  # one short line: see ckpt_lesson/short_repr.py

    out_dir: Path
    files: list[dict[str, Any]]
    meta: dict[str, Any]
    index: FileDigest

    @property
    def shard_bytes(self) -> list[int]:
        """Size of each shard file, for comparing how evenly a layout balances."""
        return [f["bytes"] for f in self.files]


def _own_storage(value: Any) -> Any:
    # torch.save writes a tensor's *whole* storage. A view into a bigger buffer (a
    # slice, a flattened parameter) would drag all of that buffer into every shard
    # holding one of its views; a copy keeps each shard to its own bytes.
    if isinstance(value, torch.Tensor) and value.untyped_storage().nbytes() > _nbytes(value):
        return value.clone()
    return value


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
    workers: int | None = None,
    zip_crc32: bool = False,
) -> ShardedSaveResult:
    """Save a resumable checkpoint as shards + ``meta.pt`` + ``index.json`` (last).

    Each shard holds a slice of the model's weights and the optimizer state of
    exactly those parameters (AdamW's moments are two thirds of the bytes), so
    the shards carry almost all the data and are written in parallel.

    Args:
        model: As for :func:`~ckpt_lesson.files.checkpoint.save_checkpoint`.
        optimizer: As for :func:`~ckpt_lesson.files.checkpoint.save_checkpoint`.
        scheduler: As for :func:`~ckpt_lesson.files.checkpoint.save_checkpoint`.
        state: As for :func:`~ckpt_lesson.files.checkpoint.save_checkpoint`.
        extras: As for :func:`~ckpt_lesson.files.checkpoint.save_checkpoint`.
        data: As for :func:`~ckpt_lesson.files.checkpoint.save_checkpoint`.
        rng: As for :func:`~ckpt_lesson.files.checkpoint.save_checkpoint`.
        out_dir: A new directory (created with its parents). One that already
            holds an ``index.json`` is refused: a checkpoint is never rewritten
            in place. Leftover shards of an unfinished save (no index) are removed.
        num_shards: Number of shard files for the model's weights.
        layout: How keys are assigned; see :func:`~ckpt_lesson.files.shard_plan.plan_shards`.
        algo: Integrity hash of every file and index entry.
        zip_crc32: Keep the zip CRC32s in every file (see ``atomic_save``).
        workers: Writer threads (default: one per CPU core, at most one per
            file); ``1`` writes the files one after another.

    Returns:
        A :class:`ShardedSaveResult` with every file's size and digest.

    Raises:
        CheckpointError: Bad ``num_shards``/``layout``/``workers``, or ``out_dir``
            already holds a finished checkpoint.

    Example:
        >>> save_sharded_checkpoint(model, opt, sched, state, "ckpt/step-12", num_shards=4)  # doctest: +SKIP
    """
    if workers is not None and (isinstance(workers, bool) or not isinstance(workers, int) or workers < 1):
        raise CheckpointError(f"workers must be an int >= 1 (or None for one per core), got {workers!r}.")
    out_dir = _unfinished_dir(out_dir)
    payload = build_payload(
        model, optimizer, scheduler, state, extras=extras, data=data, rng=rng, where=f"{out_dir}: "
    )
    model_sd = payload.pop("model")  # what is left is meta.pt: every other bucket
    plan = plan_shards(model_sd, num_shards, layout)  # checks num_shards and layout, before any write
    opt_sd = payload["optimizer"]
    opt_plan = plan_optimizer_shards(opt_sd, plan)
    moved = {pid for pids in opt_plan for pid in pids}
    payload["optimizer"] = {**opt_sd, "state": {k: v for k, v in opt_sd["state"].items() if k not in moved}}
    shards = [
        ({k: model_sd[k] for k in keys}, {pid: opt_sd["state"][pid] for pid in pids})
        for keys, pids in zip(plan, opt_plan, strict=True)
    ]
    return _write_sharded(out_dir, payload, shards, layout, workers=workers, algo=algo, zip_crc32=zip_crc32)


def write_state_payload(
    payload: dict[str, Any],
    path: str | os.PathLike[str],
    *,
    num_shards: int | None = None,
    layout: str = "param_group",
    algo: str = DEFAULT_ALGO,
    zip_crc32: bool = False,
) -> FileDigest | ShardedSaveResult:
    """Write a payload from ``build_state_payload`` (or an async snapshot of one) as a file or shards.

    Sharded, every tensor of every part goes to a shard, balanced by bytes,
    and ``meta.pt`` holds the rest of the payload with a small
    ``{"__shard_tensor__": key}`` placeholder where each tensor was.
    ``index.json`` is written last and is the commit, exactly as for
    :func:`save_sharded_checkpoint`, so ``scan`` and the verifiers read both.

    Raises:
        CheckpointError: Bad ``num_shards``/``layout``, or ``path`` already holds a finished sharded save.
    """
    if num_shards is None:
        return atomic_save(payload, path, algo=algo, zip_crc32=zip_crc32)
    out_dir = _unfinished_dir(path)
    tensors: dict[str, torch.Tensor] = {}
    meta = pull_tensors(payload, tensors)
    plan = plan_shards(tensors, num_shards, layout)
    shards = [({k: tensors[k] for k in keys}, {}) for keys in plan]
    return _write_sharded(out_dir, meta, shards, layout, workers=None, algo=algo, zip_crc32=zip_crc32)


def _unfinished_dir(out_dir: str | os.PathLike[str]) -> Path:
    out_dir = Path(out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise CheckpointError(f"{out_dir}: is a file; a sharded checkpoint needs a directory of its own.")
    if (out_dir / INDEX_NAME).exists():
        raise CheckpointError(
            f"{out_dir}: already holds a finished checkpoint ({INDEX_NAME}); checkpoints are never "
            "overwritten in place. Choose a new directory, e.g. one per step."
        )
    return out_dir


def _write_sharded(
    out_dir: Path,
    meta: dict[str, Any],
    shards: list[tuple[dict[str, Any], dict[Any, Any]]],
    layout: str,
    *,
    workers: int | None,
    algo: str,
    zip_crc32: bool,
) -> ShardedSaveResult:
    """Write ``meta.pt`` and a file per ``(model tensors, optimizer states)``, then the index (the commit)."""
    make_dirs(out_dir)  # durably: the directory must survive a power loss, not only its files
    names = [f"model.shard-{i:03d}.pt" for i in range(len(shards))]  # what shard_index._SHARD_RE matches
    for stale in out_dir.glob("model.shard-*.pt"):
        if stale.name not in names:  # no index here, so nothing in this directory was ever committed
            stale.unlink()
    # meta.pt goes first: it is often the largest single file left, so it should not start last.
    jobs: list[tuple[Any, Path]] = [(meta, out_dir / META_NAME)]
    for name, (tensors, opt_state) in zip(names, shards, strict=True):
        body = {"model": {k: _own_storage(v) for k, v in tensors.items()}, "optimizer_state": opt_state}
        jobs.append((body, out_dir / name))
    # Writers spend their time in calls that release the GIL (the file write, the xxh3 update,
    # fsync), so threads overlap for real. One per core keeps the disk and the hashing busy.
    workers = workers or max(1, min(len(jobs), os.cpu_count() or 1))
    if workers == 1:
        written = [atomic_save(body, path, algo=algo, zip_crc32=zip_crc32) for body, path in jobs]
    else:
        with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="ckpt-shard") as pool:
            futures = [
                pool.submit(atomic_save, body, path, algo=algo, zip_crc32=zip_crc32) for body, path in jobs
            ]
            # result() re-raises a writer's error here, in the caller's thread; leaving
            # the with-block first waits for the other writers, so none outlives the call.
            written = [f.result() for f in futures]
    meta_digest, *digests = written
    files = [
        {"name": name, "keys": list(tensors), "optimizer_state": list(opt_state), **d.record()}
        for name, (tensors, opt_state), d in zip(names, shards, digests, strict=True)
    ]
    index = {
        "schema": SHARDED_SCHEMA,
        "payload_schema": meta["schema"],
        "num_shards": len(shards),
        "layout": layout,
        "shards": [{"file": f["name"], **{k: v for k, v in f.items() if k != "name"}} for f in files],
        "meta": {"file": META_NAME, **meta_digest.record()},
    }
    index_digest = atomic_write_json(seal_record(index), out_dir / INDEX_NAME, algo=algo)  # the commit point
    meta_record = {"name": META_NAME, **meta_digest.record()}
    return ShardedSaveResult(out_dir=out_dir, files=files, meta=meta_record, index=index_digest)


def load_sharded_checkpoint(
    ckpt_dir: str | os.PathLike[str],
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    *,
    map_location: str | torch.device = "cpu",
) -> TrainState:
    """Verify every file of a sharded checkpoint, then merge and restore all buckets.

    Nothing is applied until every file has passed its check (see
    :func:`read_sharded_payload`); then :func:`~ckpt_lesson.files.apply.apply_payload`
    checks that it fits and changes everything or nothing.

    Returns:
        The saved :class:`~ckpt_lesson.files.train_state.TrainState`.

    Raises:
        CheckpointError: As :func:`read_sharded_payload`; ``StateMismatchError``
            when the state does not fit the live objects.

    Example:
        >>> state = load_sharded_checkpoint("ckpt/step-12", model, opt, sched)  # doctest: +SKIP
    """
    root = Path(ckpt_dir).resolve()
    payload = read_sharded_payload(root, map_location=map_location)
    return apply_payload(payload, model, optimizer, scheduler, source=str(root))
