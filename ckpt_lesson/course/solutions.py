"""Reference solutions to the course's exercises, written the way a learner could.

``Exercise.solution()`` prints these functions' source, so each one is short,
self-contained (it uses only the imports at the top of this module, which the
notebooks import too) and commented in a teacher's voice. They are not the
package's implementations: those handle more cases and are shown separately,
after each exercise. ``tests/test_exercises.py`` grades every one of them.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import random
import uuid
from pathlib import Path

import numpy as np
import torch

from ckpt_lesson.errors import SchemaError
from ckpt_lesson.files.checkpoint import TrainState

__all__ = [
    "atomic_save",
    "capture_rng_state",
    "keep_last_k",
    "load_checkpoint",
    "migrate_v1_to_v2",
    "next_batch_ids",
    "plan_param_group",
    "restore_rng_state",
    "save_checkpoint",
    "should_save",
    "verify_part",
    "write_shards",
]


# ---------------------------------------------------------------- 06 keep the last K good checkpoints


def keep_last_k(steps, verified, k):
    ordered = sorted(steps)  # a directory listing comes in any order; sort numbers, not strings
    good = [s for s in ordered if s in verified]
    if len(good) < k:
        return []  # short of good saves: keep everything, damaged files are evidence
    oldest_kept = good[-k]
    # Everything older than the oldest kept save goes, verified or not; a damaged save newer
    # than it stays (it costs little and may explain what went wrong).
    return [s for s in ordered if s < oldest_kept]


# ---------------------------------------------------------------- 07 save cadence


def should_save(step, now, *, last_step, last_time, every_steps, every_seconds):
    if step == 0 or step == last_step:
        return False  # nothing to protect yet, or this exact state is already on disk
    if every_steps is not None and step % every_steps == 0:
        return True
    # The time rule counts from the last save, and needs a time to count from.
    if every_seconds is not None and last_time is not None:
        return now - last_time >= every_seconds
    return False


# ---------------------------------------------------------------- 08 verify one part of a checkpoint


def verify_part(path, *, size, sha256):
    path = Path(path)
    if not path.is_file():
        return "missing"  # a reason, not an exception: the scan must report every save
    actual = path.stat().st_size
    if actual != size:  # free to check, so check it before reading every byte
        return f"size {actual} != recorded {size}"
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):  # 1 MiB at a time: files may exceed memory
            digest.update(chunk)
    return None if digest.hexdigest() == sha256 else "sha256 differs from the record"


# ---------------------------------------------------------------- 09 migrate a v1 payload to v2


def migrate_v1_to_v2(payload):
    if not isinstance(payload, dict) or payload.get("schema") != "ckpt.v1":
        found = payload.get("schema") if isinstance(payload, dict) else type(payload).__name__
        raise SchemaError(f"migrate_v1_to_v2 expects a 'ckpt.v1' payload, got {found!r}")
    new = dict(payload)  # a new outer dict; the values are shared but never changed
    new["schema"] = "ckpt.v2"
    new["env"] = {"recorded": False}  # v1 never recorded it: say so, do not invent it
    new["data"] = {"recorded": False, "fingerprint": None, "order_seed": None}
    new.setdefault("extras", None)
    return new


# ---------------------------------------------------------------- 01 capture and restore every generator


def capture_rng_state():
    # NumPy's legacy state holds an ndarray, which torch.load(weights_only=True) refuses:
    # unpack it and keep the array as a plain list. Keep has_gauss and the cached Gaussian:
    # np.random.normal() draws in pairs and returns the second one from that cache.
    name, keys, pos, has_gauss, cached = np.random.get_state()
    return {
        "python": random.getstate(),  # tuples of ints (and the cached Gaussian): loads fine
        "numpy": (name, keys.tolist(), pos, has_gauss, cached),
        "torch_cpu": torch.get_rng_state(),  # a uint8 tensor (already a copy)
        "torch_cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
    }


def restore_rng_state(state):
    random.setstate(state["python"])  # a weights-only load gives the tuples back as tuples
    name, keys, *rest = state["numpy"]
    np.random.set_state((name, np.array(keys, dtype=np.uint32), *rest))  # the array NumPy wants back
    torch.set_rng_state(state["torch_cpu"])
    torch.cuda.set_rng_state_all(state["torch_cuda"])  # an empty list on a machine without CUDA


# ---------------------------------------------------------------- 04 a param-group shard plan


def plan_param_group(state_dict, num_shards):
    if num_shards < 2:
        raise ValueError(
            f"param-group sharding needs num_shards >= 2 (weights and the rest), got {num_shards}"
        )
    n_weights = (num_shards + 1) // 2  # weights are the bulk of the bytes: give them the larger half
    weights = [k for k in state_dict if k.endswith("weight")]
    others = [k for k in state_dict if not k.endswith("weight")]

    def balance(keys, n):
        # Largest tensor first, each into the currently lightest shard.
        shards, load = [[] for _ in range(n)], [0] * n
        nbytes = {k: state_dict[k].numel() * state_dict[k].element_size() for k in keys}
        for key in sorted(keys, key=lambda k: -nbytes[k]):
            lightest = load.index(min(load))
            shards[lightest].append(key)
            load[lightest] += nbytes[key]
        return shards

    return balance(weights, n_weights) + balance(others, num_shards - n_weights)


# ---------------------------------------------------------------- 04 shards, then the hashed index, last


def write_shards(shards, directory):
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    entries = []
    for name, tensors in shards.items():
        buffer = io.BytesIO()
        torch.save(tensors, buffer)
        data = buffer.getvalue()  # hash exactly the bytes we write: no second read of the file
        with open(directory / name, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())  # on disk before any index names it
        entries.append({"file": name, "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()})
    # Only now the index, the commit: a temp file beside it, fsync, then one atomic rename.
    tmp = directory / f".index.json.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump({"shards": entries}, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, directory / "index.json")
    fd = os.open(directory, os.O_RDONLY)  # make the rename itself durable
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# ---------------------------------------------------------------- 05 the O(1) mid-epoch position


def next_batch_ids(state, data, *, seed, batch_size):
    if state.batch_in_epoch >= len(data) // batch_size:  # epoch used up (a partial batch is dropped)
        state.epoch += 1
        state.batch_in_epoch = 0
    # The order of an epoch depends on (seed, epoch) only, from a private generator: no replay of
    # earlier batches or epochs, and the global generator (which a resume restores) is never touched.
    g = torch.Generator().manual_seed(seed * 1_000_003 + state.epoch)
    order = torch.randperm(len(data), generator=g)
    start = state.batch_in_epoch * batch_size
    return order[start : start + batch_size].tolist()


# ---------------------------------------------------------------- 02 an atomic, durable save


def atomic_save(payload, path):
    path = Path(path)
    # Same directory (a rename across file systems is a copy, not atomic); a unique name (two
    # writers never share a temp file); a leading dot so no "*.pt" glob picks it up.
    tmp = path.parent / f".{path.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        with open(tmp, "wb") as f:
            torch.save(payload, f)
            f.flush()  # Python's buffer -> the kernel
            os.fsync(f.fileno())  # the kernel -> the disk, before any name points at the bytes
        os.replace(tmp, path)  # atomic: readers see the old file or the new one, never a mix
    except BaseException:  # Ctrl-C included: never leave a temp file behind
        tmp.unlink(missing_ok=True)
        raise
    fd = os.open(path.parent, os.O_RDONLY)  # the rename lives in the directory: flush it too
    try:
        os.fsync(fd)
    finally:  # a failed fsync must not leak the descriptor
        os.close(fd)


# ---------------------------------------------------------------- 03 the full round trip


def save_checkpoint(model, optimizer, scheduler, state, path):
    payload = {
        "schema": "lesson.v1",  # read by the loader, never guessed from the keys present
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),  # AdamW's moments and step counts
        "scheduler": scheduler.state_dict(),  # where the learning-rate schedule is
        "state": vars(state),  # step, epoch, batch_in_epoch, losses: plain values
        "rng": capture_rng_state(),  # notebook 01's, or ckpt_lesson's
    }
    atomic_save(payload, path)  # notebook 02's, or ckpt_lesson's


def load_checkpoint(path, model, optimizer, scheduler):
    try:  # weights_only: build tensors and plain values, run no code from the file
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # cut short, not a zip, or asking for a forbidden global
        raise ValueError(f"{path}: unreadable ({type(exc).__name__}); use an older checkpoint") from exc
    schema = payload.get("schema") if isinstance(payload, dict) else type(payload).__name__
    if schema != "lesson.v1":
        raise ValueError(f"{path}: schema {schema!r} is not 'lesson.v1'; this code cannot read it")
    missing = [b for b in ("model", "optimizer", "scheduler", "state", "rng") if b not in payload]
    if missing:
        raise ValueError(f"{path}: lacks {missing}; a resume needs all five buckets")
    state = TrainState(**payload["state"])  # before any apply: a bad 'state' changes nothing
    # Everything checked: only now change the live objects (a refused file leaves them as they were).
    model.load_state_dict(payload["model"])
    optimizer.load_state_dict(payload["optimizer"])
    scheduler.load_state_dict(payload["scheduler"])
    restore_rng_state(payload["rng"])
    return state
