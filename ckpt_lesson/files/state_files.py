"""The state API on disk: one file, or shards plus an index, for any mapping of parts.

:func:`save_state` and :func:`load_state` are the state API's single-file
pair (``save_checkpoint`` / ``load_checkpoint`` remain for the positional
``model, optimizer, scheduler, TrainState`` form). With ``num_shards`` they
write the sharded layout of :mod:`ckpt_lesson.files.sharded` instead: every
tensor of every part goes to one of the shard files (balanced by bytes), and
``meta.pt`` holds the rest of the payload with a small ``{"__shard_tensor__":
key}`` placeholder where each tensor was. ``index.json`` is written last and is
the commit, exactly as for the positional sharded saves, so ``scan`` and the
verifiers read both.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from ckpt_lesson.errors import CheckpointError
from ckpt_lesson.files.atomic import atomic_save, atomic_write_json, make_dirs
from ckpt_lesson.files.fresh_memory import FreshMemory
from ckpt_lesson.files.hashing import DEFAULT_ALGO
from ckpt_lesson.files.integrity import FileDigest, part_digest
from ckpt_lesson.files.loading import load_verified_file
from ckpt_lesson.files.mapped_restore import copy_out, keep_no_mapped_extra_state, load_with_private_copies
from ckpt_lesson.files.record_seal import seal_record
from ckpt_lesson.files.shard_index import (
    INDEX_NAME,
    META_NAME,
    SHARDED_SCHEMA,
    _bad,
    _files,
    read_shard_index,
)
from ckpt_lesson.files.shard_plan import _check_plan_args, plan_shards
from ckpt_lesson.files.sharded import (
    ShardedSaveResult,
    _default_workers,
    _own_storage,
    _shard_name,
    _write_all,
)
from ckpt_lesson.files.state_apply import apply_state_payload
from ckpt_lesson.files.state_payload import PARTS_SCHEMA, Restored, build_state_payload
from ckpt_lesson.files.verified_bytes import VerifiedBytes

__all__ = ["load_state", "read_state_payload", "save_state", "write_state_payload"]

_REF = "__shard_tensor__"


def save_state(
    path: str | os.PathLike[str],
    step: int,
    state: Mapping[str, Any],
    *,
    rng: bool | dict[str, Any] | None = True,
    num_shards: int | None = None,
    algo: str = DEFAULT_ALGO,
    zip_crc32: bool = False,
) -> FileDigest | ShardedSaveResult:
    """Save ``state`` (a mapping of named parts) at ``step``, atomically and with its integrity record.

    Args:
        path: The file (or, with ``num_shards``, a new directory).
        step: The global step.
        state: ``{name: object with state_dict()/load_state_dict(), or plain value}``.
        rng: ``True`` captures the generators now, ``False`` saves none, or a
            dict from ``capture_rng_state()`` taken earlier.
        num_shards: ``None`` for one file; else the sharded layout with that many shard files.
        algo: Integrity hash.
        zip_crc32: Keep the zip CRC32s ``torch.save`` writes (off: ``torch.load`` never checks them).

    Returns:
        The file's digest, or the sharded save's :class:`ShardedSaveResult`.

    Raises:
        CheckpointError: Bad parts or step (see ``build_state_payload``), named before anything is written.

    Example:
        >>> save_state("ckpt/last.pt", 120, {"model": model, "best": 0.31})  # doctest: +SKIP
    """
    payload = build_state_payload(step, state, rng=rng)
    return write_state_payload(payload, path, num_shards=num_shards, algo=algo, zip_crc32=zip_crc32)


def write_state_payload(
    payload: dict[str, Any],
    path: str | os.PathLike[str],
    *,
    num_shards: int | None = None,
    layout: str = "param_group",
    algo: str = DEFAULT_ALGO,
    zip_crc32: bool = False,
) -> FileDigest | ShardedSaveResult:
    """Write a payload from ``build_state_payload`` (or an async snapshot of one); see :func:`save_state`.

    ``zip_crc32=True`` keeps the zip CRC32s for tools that check them (see ``atomic_save``).
    """
    if num_shards is None:
        return atomic_save(payload, path, algo=algo, zip_crc32=zip_crc32)
    _check_plan_args(num_shards, layout)
    out_dir = Path(path)
    if (out_dir / INDEX_NAME).exists():
        raise CheckpointError(
            f"{out_dir}: already holds a finished checkpoint ({INDEX_NAME}); choose a new one."
        )
    tensors: dict[str, torch.Tensor] = {}
    meta = _pull_tensors(payload, tensors)
    plan = plan_shards(tensors, num_shards, layout)
    make_dirs(out_dir)
    jobs: list[tuple[Any, Path]] = [(meta, out_dir / META_NAME)]
    for i, keys in enumerate(plan):
        body = {"model": {k: _own_storage(tensors[k]) for k in keys}, "optimizer_state": {}}
        jobs.append((body, out_dir / _shard_name(i)))
    meta_digest, *digests = _write_all(
        jobs, workers=_default_workers(len(jobs)), algo=algo, zip_crc32=zip_crc32
    )
    files = [
        {"name": _shard_name(i), "keys": keys, "optimizer_state": [], **d.record()}
        for i, (keys, d) in enumerate(zip(plan, digests, strict=True))
    ]
    index = {
        "schema": SHARDED_SCHEMA,
        "payload_schema": PARTS_SCHEMA,
        "num_shards": num_shards,
        "layout": layout,
        "shards": [{"file": f["name"], **{k: v for k, v in f.items() if k != "name"}} for f in files],
        "meta": {"file": META_NAME, **meta_digest.record()},
    }
    index_digest = atomic_write_json(seal_record(index), out_dir / INDEX_NAME, algo=algo)  # the commit
    return ShardedSaveResult(out_dir=out_dir, files=files, meta={"name": META_NAME, **meta_digest.record()},
                             index=index_digest)  # fmt: skip


def _pull_tensors(tree: Any, out: dict[str, torch.Tensor]) -> Any:
    """``tree`` with every tensor moved into ``out`` under a fresh key and a placeholder left behind."""
    if isinstance(tree, torch.Tensor):
        key = f"t{len(out):06d}"
        out[key] = tree
        return {_REF: key}
    if isinstance(tree, dict):
        copy = type(tree)() if type(tree) is not dict else {}
        for k, v in tree.items():
            copy[k] = _pull_tensors(v, out)
        return copy
    if isinstance(tree, (list, tuple)):
        items = [_pull_tensors(v, out) for v in tree]
        return items if isinstance(tree, list) else tuple(items)
    return tree


def _push_tensors(tree: Any, tensors: dict[str, torch.Tensor], used: set[str], where: Path) -> Any:
    if isinstance(tree, dict):
        if set(tree) == {_REF}:
            key = tree[_REF]
            if key not in tensors or key in used:
                raise _bad(where, f"{META_NAME} refers to tensor {key!r}, which no shard holds once")
            used.add(key)
            return tensors[key]
        return type(tree)((k, _push_tensors(v, tensors, used, where)) for k, v in tree.items())
    if isinstance(tree, (list, tuple)):
        items = [_push_tensors(v, tensors, used, where) for v in tree]
        return items if isinstance(tree, list) else tuple(items)
    return tree


def read_state_payload(
    path: str | os.PathLike[str] | VerifiedBytes,
    *,
    map_location: Any = "cpu",
    expected_digest: str | None = None,
    algo: str | None = None,
    mmap: bool = False,
) -> dict[str, Any]:
    """Verify and load (weights-only) a state-API save: one file, or a sharded directory.

    Every file is checked against its integrity record (and the index) before
    anything is unpickled; the payload is returned, nothing applied.

    Raises:
        CheckpointError: Missing, damaged (``CorruptCheckpointError``), or unsafe files.
    """
    if isinstance(path, VerifiedBytes) or not Path(path).is_dir():
        payload, _ = load_with_private_copies(
            path,
            _private_except_modules,
            mmap=mmap,
            map_location=map_location,
            expected_digest=expected_digest,
            algo=algo,
        )
        return payload
    root = Path(path).resolve()
    index = read_shard_index(root)
    tensors: dict[str, torch.Tensor] = {}
    meta: Any = None
    for file, entry in _files(root, index):
        want_algo, want = part_digest(entry)
        obj, _ = load_verified_file(
            file,
            map_location=map_location,
            expected_digest=want,
            algo=want_algo,
            expected_size=entry["bytes"],
        )
        if entry is index["meta"]:
            meta = obj
        elif (
            isinstance(obj, dict)
            and isinstance(obj.get("model"), dict)
            and set(obj["model"]) == set(entry["keys"])
        ):
            tensors.update(obj["model"])
        else:
            raise _bad(root, f"{file.name} does not hold the tensors {INDEX_NAME} lists for it")
    if not isinstance(meta, dict) or meta.get("schema") != PARTS_SCHEMA:
        raise _bad(root, f"{META_NAME} is not a {PARTS_SCHEMA} payload")
    used: set[str] = set()
    payload = _push_tensors(meta, tensors, used, root)
    if used != set(tensors):
        raise _bad(root, f"the shards hold {len(tensors) - len(used)} tensor(s) that {META_NAME} never uses")
    return payload


def _private_except_modules(payload: Any, fresh: FreshMemory) -> Any:
    """Copy every mapped tensor out of the mapping except module parts' (``load_state_dict`` copies those).

    Optimizer moments, plain values and the RNG would otherwise stay mapped after the restore (an
    optimizer keeps a state tensor that already has its parameter's dtype and device). The copies
    go into ``fresh``'s buffers where one of the right size is ready.
    """
    if not isinstance(payload, dict) or not isinstance(payload.get("objects"), dict):
        return copy_out(payload, fresh=fresh)
    modules = payload.get("modules")
    modules = {m for m in modules if isinstance(m, str)} if isinstance(modules, list) else set()
    objects = {
        # A module's extra state is handed to set_extra_state, which may keep it: copied out too.
        k: keep_no_mapped_extra_state({"model": v})["model"] if k in modules else copy_out(v, fresh=fresh)
        for k, v in payload["objects"].items()
    }
    rest = {k: copy_out(v, fresh=fresh) for k, v in payload.items() if k != "objects"}
    return {**rest, "objects": objects}


def load_state(
    path: str | os.PathLike[str],
    state: Mapping[str, Any],
    *,
    strict: bool = True,
    map_location: Any = "cpu",
    allow_dtype_cast: bool = False,
) -> Restored:
    """Verify a save from :func:`save_state` (or a positional ``save_checkpoint`` file) and restore it.

    Args:
        path: The file or sharded directory.
        state: The live ``{name: part}`` mapping; objects are restored in place.
        strict: Refuse parts present on one side only (default); ``False`` ignores them.
        map_location: As for ``torch.load``.
        allow_dtype_cast: Accept module tensors saved in another dtype.

    Returns:
        A :class:`~ckpt_lesson.files.state_payload.Restored`: ``step``, ``values``, ``rng``, ``path``.

    Raises:
        CheckpointError: Damaged or unsafe files; ``StateMismatchError`` naming
            the part that does not fit (nothing is changed then).

    Example:
        >>> restored = load_state("ckpt/last.pt", {"model": model, "best": None})  # doctest: +SKIP
        >>> start, best = restored.step + 1, restored.values["best"]  # doctest: +SKIP
    """
    payload = read_state_payload(path, map_location=map_location)
    restored = apply_state_payload(
        payload, state, source=str(path), strict=strict, allow_dtype_cast=allow_dtype_cast
    )
    restored.path = Path(path)
    return restored
