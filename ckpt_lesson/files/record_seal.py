"""A checksum for the commit records themselves (``manifest.json``, ``index.json``).

A manifest pins every part's bytes, but nothing pinned the manifest. One
flipped bit in it (``"rng"`` to ``"rnf"``, a digit of a version string) then
reads as a *verified* statement that the save covers fewer buckets or came
from another environment, and the resume is refused outright instead of the
save being treated as damaged and the older good save used.

So a record carries its own digest under one key, computed over the record's
canonical JSON *without* that key (sorted keys, no spaces, ASCII)::

    "record_digest": {"algo": "sha256", "digest": "9f86d0..."}

The algorithm's name travels with the digest, so a reader verifies whatever
algorithm the writer used. Two outcomes matter to callers:

* **sealed and matching**: the record is exactly what was written; a field
  that disagrees with the current run is a real contract refusal;
* **unverifiable** (digest mismatch, unknown algorithm, damaged seal): the
  record is damaged, and a restore falls back to an older save.

Records written before seals existed have no key and only the fields old code
wrote; they are accepted as *legacy* and verified by their parts as before. A
record with no seal but a field old code never wrote (say, the seal's own key
with one flipped bit) cannot be legacy: it is damaged.
"""

from __future__ import annotations

import json
from collections.abc import Collection
from typing import Any

from ckpt_lesson.errors import CorruptCheckpointError
from ckpt_lesson.files.hashing import ALGORITHMS, DEFAULT_ALGO, digest_bytes

__all__ = ["SEAL_KEY", "seal_record", "verify_record_seal"]

#: The key under which a record stores its own digest.
SEAL_KEY = "record_digest"


def _canonical(record: dict[str, Any]) -> bytes:
    body = {k: v for k, v in record.items() if k != SEAL_KEY}
    text = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False)
    return text.encode()


def seal_record(record: dict[str, Any]) -> dict[str, Any]:
    """Return a copy of ``record`` with its seal added (any old seal replaced).

    Example:
        >>> sealed = seal_record({"step": 3})
        >>> sorted(sealed[SEAL_KEY])
        ['algo', 'digest']
    """
    body = {k: v for k, v in record.items() if k != SEAL_KEY}
    return {**body, SEAL_KEY: {"algo": DEFAULT_ALGO, "digest": digest_bytes(_canonical(body), DEFAULT_ALGO)}}


def verify_record_seal(record: dict[str, Any], *, where: str, legacy_keys: Collection[str]) -> bool:
    """Check a parsed record against its seal.

    Args:
        record: The parsed JSON object.
        where: Names the record in messages (``step-00000240/manifest.json``).
        legacy_keys: Every top-level key that writers before seals produced.

    Returns:
        ``True`` for a sealed record whose digest matches, ``False`` for a
        legacy record (no seal, only legacy keys).

    Raises:
        CorruptCheckpointError: The digest does not match, the seal is
            malformed or names an unknown algorithm, or an unsealed record has
            keys no legacy writer produced.

    Example:
        >>> verify_record_seal(seal_record({"step": 3}), where="m", legacy_keys=())
        True
    """
    seal = record.get(SEAL_KEY)
    if seal is None:
        unknown = sorted(set(record) - set(legacy_keys))
        if unknown:
            raise CorruptCheckpointError(
                f"{where}: has no checksum but fields old writers never wrote ({unknown[:3]}); it was "
                "damaged after it was written (perhaps in its checksum's own name). Restore an older save."
            )
        return False
    if not isinstance(seal, dict) or not isinstance(seal.get("digest"), str):
        raise CorruptCheckpointError(f"{where}: its checksum field is damaged; restore an older save.")
    algo = seal.get("algo")
    if not isinstance(algo, str) or algo not in ALGORITHMS:
        raise CorruptCheckpointError(
            f"{where}: checksum algorithm {algo!r} is unknown here; the record is damaged "
            "or a newer ckpt_lesson wrote it. Restore an older save or upgrade."
        )
    try:
        found = digest_bytes(_canonical(record), algo)
    except (TypeError, ValueError):  # NaN or odd values cannot come from our writer
        found = ""
    if found != seal["digest"].lower():
        raise CorruptCheckpointError(
            f"{where}: its checksum does not match its contents; the record was damaged after it was "
            "written, so nothing in it can be trusted. Restore an older save."
        )
    return True
