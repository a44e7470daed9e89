"""Reference solutions to the course's exercises, written the way a learner could.

``Exercise.solution()`` prints these functions' source, so each one is short,
self-contained (it uses only the imports at the top of this module, which the
notebooks import too) and commented in a teacher's voice. They are not the
package's implementations: those handle more cases and are shown separately,
after each exercise. ``tests/test_exercises.py`` grades every one of them.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from ckpt_lesson.errors import SchemaError

__all__ = ["keep_last_k", "migrate_v1_to_v2", "should_save", "verify_part"]


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
