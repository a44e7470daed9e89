"""The commit protocol on an object store: upload, manifest, then a conditional marker.

On a local disk one ``rename`` publishes a whole save. An object store has no
rename (on S3 it is a copy and a delete) and no ``flock``, so the protocol is
built from the two things it does have: strong read-after-write consistency
and a conditional create (``If-None-Match: *``). The layout of one run::

    RUN/step-00000240/COMMIT                  <- written last, create-if-absent
    RUN/step-00000240/<save_id>/LEASE         <- "I am alive until T" (deleted after commit)
    RUN/step-00000240/<save_id>/checkpoint.pt
    RUN/step-00000240/<save_id>/manifest.json

1. write the ``LEASE`` (renewed by a thread while the parts upload; see
   :mod:`ckpt_lesson.runs.store_lease`, which the multi-rank writer uses too);
2. stream every part up, hashing it on the way; the digest must equal the one
   the local manifest recorded, so the bytes that arrived are the bytes described;
3. upload the manifest;
4. check the lease still runs (a writer stalled past it may have lost parts to a
   cleaner: it commits nothing and removes what it uploaded), then
   create ``COMMIT`` *only if absent*; it names the step, the ``save_id`` and
   the manifest's digest. Of two writers of one step (a zombie from a lost
   machine and its replacement) exactly one creates it; the other deletes its
   own upload and raises :class:`CommitConflictError`.

Each writer uploads under its own ``save_id``, so a zombie can never overwrite
the parts of a save that is already committed. A reader counts a step only
when ``COMMIT`` is there, names that step, and matches the manifest's digest.

A writer that died leaves an uncommitted ``<save_id>/`` prefix (and maybe an
unfinished multipart upload). Nobody can ask the kernel whether it is alive,
so its ``LEASE`` says until when it promised to finish; once that time has
passed, :func:`clean_uncommitted` removes the prefix. (This assumes the
writers' and the cleaner's clocks agree to well within the lease.)

Retention deletes ``COMMIT`` first, then the parts: a kill in between leaves
parts without a marker, which no reader counts and the next clean removes.
"""

from __future__ import annotations

import json
import os
import re
import socket
import time
from pathlib import Path
from typing import Any

from ckpt_lesson.errors import CheckpointError, CorruptCheckpointError, IncompleteCheckpointError
from ckpt_lesson.files.hashing import digest_bytes, part_digest
from ckpt_lesson.files.safe_read import MAX_RECORD_BYTES, parse_json_text
from ckpt_lesson.files.storage import Storage
from ckpt_lesson.runs.commit import log
from ckpt_lesson.runs.layout import MANIFEST_NAME, read_manifest, step_dir_name, step_of
from ckpt_lesson.runs.retention import RetentionPolicy
from ckpt_lesson.runs.store_lease import LEASE_NAME, LeaseRenewer

__all__ = [
    "COMMIT_NAME",
    "COMMIT_SCHEMA",
    "CommitConflictError",
    "apply_store_retention",
    "attempt_of",
    "clean_uncommitted",
    "commit_attempt",
    "commit_checks",
    "committed_steps",
    "delete_store_save",
    "read_commit",
    "upload_save",
]

COMMIT_NAME = "COMMIT"
COMMIT_SCHEMA = "ckpt_lesson.commit/1"
#: A marker is a few hundred bytes; anything much larger was not written by us.
MAX_MARKER_BYTES = 64 << 10


class CommitConflictError(CheckpointError):
    """Another writer committed this step first (the conditional marker refused this one)."""


#: ``step-XXXXXXXX/<save_id>/<file>``: the only keys cleanup and retention ever delete. A save_id is
#: a uuid4's hex; a file is a flat name (``checkpoint.pt``, ``LEASE``, ``__0_0.distcp``, ``.metadata``).
_OUR_KEY_RE = re.compile(r"^(step-[0-9]{8,})/([0-9a-f]{32})/(\.metadata|[A-Za-z0-9_][A-Za-z0-9_.=-]*)$")


def attempt_of(key: str) -> str | None:
    """``step-XXXXXXXX/<save_id>`` when ``key`` is fully recognized as an object of an upload, else ``None``.

    Anything else under the prefix (a stray file, a key another tool put there) is never deleted.

    Example:
        >>> attempt_of("step-00000040/" + "a" * 32 + "/checkpoint.pt") == "step-00000040/" + "a" * 32
        True
        >>> attempt_of("step-00000040/junk/x"), attempt_of("step-40/" + "a" * 32 + "/x")
        (None, None)
    """
    found = _OUR_KEY_RE.match(key)
    if not found or found.group(1) != step_dir_name(int(found.group(1)[5:])):
        return None  # also a non-canonical step folder (step-000000040): not one we wrote
    return f"{found.group(1)}/{found.group(2)}"


def _marker_key(step: int) -> str:
    return f"{step_dir_name(step)}/{COMMIT_NAME}"


def upload_save(
    storage: Storage, local: Path, step: int, *, algo: str, lease_seconds: float
) -> dict[str, Any]:
    """Upload one locally staged save and commit it with a conditional marker.

    Args:
        storage: The run's store.
        local: A complete local save folder (parts and ``manifest.json``).
        step: Its step.
        algo: Hash of the manifest digest the marker records.
        lease_seconds: How long a silent writer counts as alive.

    Returns:
        The marker written.

    Raises:
        CommitConflictError: ``COMMIT`` for ``step`` already exists (another
            writer won); this writer's upload is deleted first.
        CheckpointError: The lease ran out before the commit (this writer was
            stalled past it); its upload is deleted and nothing is committed.
        CorruptCheckpointError: A part streamed up with other bytes than its
            manifest records (nothing is committed).
        LoadEnvironmentError: The store cannot be reached.

    Example:
        >>> upload_save(store, cache / "step-00000010", 10, algo="xxh3_128", lease_seconds=900)
        ... # doctest: +SKIP
        {'schema': 'ckpt_lesson.commit/1', 'step': 10, ...}
    """
    manifest = read_manifest(local)
    save_id = manifest["save_id"]
    attempt = f"{step_dir_name(step)}/{save_id}"
    lease = LeaseRenewer(storage, attempt, lease_seconds)  # renewed while the parts upload
    try:
        for part in manifest["parts"]:
            part_algo, want = part_digest(part)
            size, got = storage.put_file(f"{attempt}/{part['file']}", local / part["file"], algo=part_algo)
            if (size, got) != (part["bytes"], want):
                raise CorruptCheckpointError(
                    f"{storage.where(attempt)}/{part['file']}: uploaded {size} bytes hashing {got}, but the "
                    f"manifest records {part['bytes']} bytes {want}; the local copy changed. "
                    "Nothing was committed."
                )
        manifest_bytes = (local / MANIFEST_NAME).read_bytes()
        storage.put_bytes(f"{attempt}/{MANIFEST_NAME}", manifest_bytes)
    finally:
        lease.stop()
    try:
        lease.check()  # nothing commits after its lease expired: a cleaner may have removed parts
    except CheckpointError:
        storage.delete(storage.list_keys(attempt))  # what is left of it (the cleaner's or not)
        storage.abort_uploads(attempt + "/")
        raise
    return commit_attempt(storage, step, save_id, manifest_bytes, algo=algo)


def commit_attempt(
    storage: Storage, step: int, save_id: str, manifest_bytes: bytes, *, algo: str
) -> dict[str, Any]:
    """Create ``COMMIT`` for an upload whose parts and manifest are all in place; the last write of a save.

    Shared by :func:`upload_save` and the multi-rank manager's object-store writer.

    Args:
        storage: The run's store.
        step: The step.
        save_id: The upload's id: its objects live under ``step-XXXXXXXX/<save_id>/``.
        manifest_bytes: The exact bytes of the uploaded ``manifest.json``.
        algo: Hash of the manifest digest the marker records.

    Returns:
        The marker written.

    Raises:
        CommitConflictError: ``COMMIT`` for ``step`` already exists (another
            writer won); this writer's upload is deleted first.
        LoadEnvironmentError: The store cannot be reached.

    Example:
        >>> commit_attempt(store, 40, save_id, raw, algo="xxh3_128")  # doctest: +SKIP
        {'schema': 'ckpt_lesson.commit/1', 'step': 40, ...}
    """
    attempt = f"{step_dir_name(step)}/{save_id}"
    marker = {
        "schema": COMMIT_SCHEMA,
        "step": step,
        "save_id": save_id,
        "manifest": {
            "bytes": len(manifest_bytes),
            "algo": algo,
            "digest": digest_bytes(manifest_bytes, algo),
        },
        "writer": f"{socket.gethostname()}:{os.getpid()}",
        "created_at": time.time(),
    }
    if not storage.create_if_absent(_marker_key(step), json.dumps(marker, sort_keys=True).encode()):
        storage.delete([k for k in storage.list_keys(attempt) if attempt_of(k) == attempt])
        raise CommitConflictError(
            f"{storage.where(_marker_key(step))}: step {step} was already committed by another writer; "
            "this upload was removed. Two writers share this run (a zombie from a lost machine?): stop one."
        )
    storage.delete([f"{attempt}/{LEASE_NAME}"])  # committed: nobody needs to wait for this writer now
    return marker


def committed_steps(storage: Storage, keys: list[str] | None = None) -> list[int]:
    """Steps that have a ``COMMIT`` marker, ascending (markers are not read here)."""
    steps = set()
    for key in storage.list_keys() if keys is None else keys:
        head, _, name = key.partition("/")
        step = step_of(head)
        if name == COMMIT_NAME and step is not None and head == step_dir_name(step):
            steps.add(step)
    return sorted(steps)


def read_commit(storage: Storage, step: int) -> tuple[dict[str, Any], bytes]:
    """Read and check the marker of ``step`` and the manifest it names.

    Returns:
        ``(marker, manifest_bytes)``; the bytes hash to the marker's digest.

    Raises:
        IncompleteCheckpointError: No marker, or the manifest it names is gone.
        CorruptCheckpointError: The marker is damaged, names another step (a
            stale copy), or the manifest's bytes differ from its digest.

    Example:
        >>> marker, raw = read_commit(store, 240)  # doctest: +SKIP
    """
    key = _marker_key(step)
    where = storage.where(key)
    try:
        marker = parse_json_text(storage.read_bytes(key, limit=MAX_MARKER_BYTES), where=where)
    except FileNotFoundError:
        raise IncompleteCheckpointError(
            f"{where}: no commit marker; step {step} was never committed."
        ) from None
    except CheckpointError as exc:
        if isinstance(exc, CorruptCheckpointError):
            raise
        raise CorruptCheckpointError(f"{where}: {exc}") from None
    save_id = marker.get("save_id") if isinstance(marker, dict) else None
    if not isinstance(marker, dict) or marker.get("schema") != COMMIT_SCHEMA:
        raise CorruptCheckpointError(f"{where}: not a commit marker of ours; restore an older save.")
    if marker.get("step") != step:
        raise CorruptCheckpointError(
            f"{where}: the marker names step {marker.get('step')!r}, not {step} (a stale copy); "
            "restore an older save."
        )
    if not isinstance(save_id, str) or not save_id.isalnum():
        raise CorruptCheckpointError(f"{where}: no valid save_id; restore an older save.")
    recorded = marker.get("manifest")
    if not isinstance(recorded, dict):
        raise CorruptCheckpointError(f"{where}: no manifest digest; restore an older save.")
    algo, digest = part_digest(recorded)
    manifest_key = f"{step_dir_name(step)}/{save_id}/{MANIFEST_NAME}"
    try:
        raw = storage.read_bytes(manifest_key, limit=MAX_RECORD_BYTES)
    except FileNotFoundError:
        raise IncompleteCheckpointError(
            f"{storage.where(manifest_key)}: missing, though step {step}'s marker names it; "
            "restore an older save."
        ) from None
    if digest_bytes(raw, algo) != digest:
        raise CorruptCheckpointError(
            f"{storage.where(manifest_key)}: does not match the digest in its commit marker; "
            "restore an older save."
        )
    return marker, raw


def commit_checks(storage: Storage, step: int) -> bool:
    """True when :func:`read_commit` accepts ``step``'s marker and manifest (no part is read)."""
    try:
        read_commit(storage, step)
    except (CorruptCheckpointError, IncompleteCheckpointError):
        return False
    return True


def delete_store_save(storage: Storage, step: int) -> None:
    """Delete one save: the marker first (no reader counts it after that), then every object."""
    storage.delete([_marker_key(step)])
    storage.delete([k for k in storage.list_keys(step_dir_name(step)) if attempt_of(k)])


def _lease_expired(storage: Storage, attempt: str, now: float) -> bool:
    try:
        lease = parse_json_text(
            storage.read_bytes(f"{attempt}/{LEASE_NAME}", limit=MAX_MARKER_BYTES), where=attempt
        )
    except (FileNotFoundError, CorruptCheckpointError):
        return True  # the lease is written before any part: no readable lease, no live writer
    expires = lease.get("expires_at") if isinstance(lease, dict) else None
    return not isinstance(expires, (int, float)) or expires < now


def clean_uncommitted(storage: Storage, *, now: float | None = None) -> list[str]:
    """Remove uploads no marker names whose writer's lease has expired; returns their prefixes.

    Also aborts unfinished multipart uploads under them. A prefix whose lease
    is still running is left alone: its writer may be alive and slow.

    Example:
        >>> clean_uncommitted(store)  # doctest: +SKIP
        ['step-00000280/5be0c1...']
    """
    now = time.time() if now is None else now
    keys = storage.list_keys()
    attempts: dict[str, list[str]] = {}
    for key in keys:
        attempt = attempt_of(key)  # only keys we fully recognize are ever deleted
        if attempt is not None:
            attempts.setdefault(attempt, []).append(key)
    committed = set(committed_steps(storage, keys))
    removed = []
    for attempt, found in sorted(attempts.items()):
        step = step_of(attempt.split("/")[0])
        if step in committed:
            try:
                if read_commit(storage, step)[0]["save_id"] == attempt.split("/")[1]:
                    continue
            except (CorruptCheckpointError, IncompleteCheckpointError):
                continue  # a damaged marker: leave the evidence for a human
        if not _lease_expired(storage, attempt, now):
            continue
        storage.delete(found)
        storage.abort_uploads(attempt + "/")
        log.info("removed %s: an upload nobody committed, its writer's lease expired", attempt)
        removed.append(attempt)
    return removed


def apply_store_retention(storage: Storage, policy: RetentionPolicy) -> list[int]:
    """Delete the committed saves ``policy`` lets go; a save whose marker does not check never counts as kept.

    Kept saves are checked by marker and manifest digest only (re-hashing the
    parts would download the whole run on every save); restores hash everything.
    """
    steps = committed_steps(storage)
    doomed = policy.to_delete(steps, {step for step in steps if commit_checks(storage, step)})
    for step in doomed:
        delete_store_save(storage, step)
        log.info("retention: deleted %s from %s", step_dir_name(step), storage.url)
    return sorted(doomed)
