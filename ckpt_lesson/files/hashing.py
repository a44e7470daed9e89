"""Hash algorithms for integrity records, named so that every record says which one it used.

Every record this package writes (the footer inside a ``.pt``, a shard index
entry, a manifest part) names its algorithm, so the default can change without
breaking old files: records from before the name was stored carry only a
``"sha256"`` key and read as sha256. A part record looks like ``{"file": ...,
"bytes": ..., "algo": "xxh3_128", "digest": "9f0c..."}``; the single-process
and the multi-rank manifests build and check theirs with the same functions
here (:func:`hash_bytes`, :func:`hash_file`, :func:`check_hash_record`).

Also here: :func:`zip_crc32_off`, which switches off the CRC32s that
``torch.save`` computes for its zip archive while one of our saves runs.
"""

from __future__ import annotations

import hashlib
import importlib
import os
import threading
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any, BinaryIO

from ckpt_lesson.errors import CheckpointError, CorruptCheckpointError
from ckpt_lesson.files.safe_read import open_regular_file

__all__ = [
    "ALGORITHMS",
    "DEFAULT_ALGO",
    "check_algo",
    "check_hash_record",
    "digest_bytes",
    "hash_bytes",
    "hash_chunks",
    "hash_file",
    "new_hasher",
    "part_digest",
    "record_fields",
    "zip_crc32_off",
]

_HEX = frozenset("0123456789abcdef")
_CHUNK = 4 << 20

#: The integrity hash new records use. xxh3-128 runs at about 33 GB/s here
#: (sha256: 1.8 GB/s), so hashing costs a few percent of a save instead of half.
#: It detects damage, not tampering: the record sits beside the data, and
#: anyone who can rewrite one can rewrite the other.
DEFAULT_ALGO = "xxh3_128"

#: Every algorithm a record may name, with the length of its hex digest.
#: ``sha256`` and ``blake3`` are cryptographic: pick one when a digest is
#: pinned somewhere trusted (a release note, a registry) and checked from there.
ALGORITHMS: dict[str, int] = {"blake3": 64, "sha256": 64, "xxh3_128": 32}


def check_algo(name: Any) -> str:
    """Return ``name`` if it is a known algorithm, else raise.

    Raises:
        CheckpointError: ``name`` is not one of :data:`ALGORITHMS`.

    Example:
        >>> check_algo("sha256")
        'sha256'
    """
    if not isinstance(name, str) or name not in ALGORITHMS:
        raise CheckpointError(
            f"unknown integrity algorithm {name!r}; choose one of {sorted(ALGORITHMS)} "
            "(or upgrade ckpt_lesson if a newer version wrote this record)."
        )
    return name


def new_hasher(algo: str = DEFAULT_ALGO) -> Any:
    """A fresh incremental hasher (``update``, ``hexdigest``, ``copy``) for ``algo``.

    Options name their algorithm through :func:`check_algo` first; an unknown
    name that reaches this far came from a record read back from disk, so it
    is *damage* here, refused as a ``CorruptCheckpointError``.

    Raises:
        CorruptCheckpointError: ``algo`` is not one of :data:`ALGORITHMS`.
        CheckpointError: ``xxh3_128`` or ``blake3`` without its package.

    Example:
        >>> h = new_hasher("sha256"); h.update(b"abc"); h.hexdigest()[:8]
        'ba7816bf'
    """
    if not isinstance(algo, str) or algo not in ALGORITHMS:
        raise CorruptCheckpointError(
            f"unknown hash algorithm {algo!r}; this code knows {sorted(ALGORITHMS)}. "
            "Upgrade ckpt_lesson to read saves hashed with it."
        )
    if algo == "sha256":
        return hashlib.sha256()
    package = "xxhash" if algo == "xxh3_128" else "blake3"
    try:  # imported here: only the algorithms in use need their package
        module = importlib.import_module(package)
    except ImportError as exc:
        raise CheckpointError(
            f"{algo} is selected but its package is missing; `pip install {package}`, or use sha256."
        ) from exc
    return module.xxh3_128() if algo == "xxh3_128" else module.blake3(max_threads=module.blake3.AUTO)


def digest_bytes(data: bytes | bytearray | memoryview, algo: str = DEFAULT_ALGO) -> str:
    """Hex digest of ``data`` with ``algo``.

    Example:
        >>> len(digest_bytes(b"abc"))  # xxh3-128: 32 hex characters
        32
    """
    h = new_hasher(algo)
    h.update(data)
    return h.hexdigest()


def hash_bytes(data: bytes | bytearray | memoryview, algo: str = DEFAULT_ALGO) -> dict[str, str]:
    """The tagged record ``{"algo", "digest"}`` of ``data``.

    Example:
        >>> hash_bytes(b"abc", "sha256")["digest"][:8]
        'ba7816bf'
    """
    return {"algo": algo, "digest": digest_bytes(data, algo)}


def hash_file(path: str | os.PathLike[str], algo: str = DEFAULT_ALGO) -> tuple[int, dict[str, str]]:
    """Size and tagged record of a regular file, read once in chunks.

    Args:
        path: The file; a symlink or anything but a regular file is refused.
        algo: Hash algorithm name.

    Returns:
        ``(size_in_bytes, {"algo": ..., "digest": ...})``.

    Raises:
        CorruptCheckpointError: Not a regular file.
        OSError: The file cannot be opened or read.

    Example:
        >>> size, record = hash_file("step-00000004/__0_0.distcp")  # doctest: +SKIP
    """
    # lstat, then a no-follow, non-blocking open and fstat: a symlink or FIFO swapped in between
    # is refused too, never followed or waited on.
    with open_regular_file(path) as f:
        size, digest = hash_chunks(iter(lambda: f.read(_CHUNK), b""), algo)
    return size, {"algo": algo, "digest": digest}


def hash_chunks(
    chunks: Iterable[bytes], algo: str = DEFAULT_ALGO, *, into: BinaryIO | None = None
) -> tuple[int, str]:
    """``(bytes, hex digest)`` of a stream of chunks, each also written to ``into`` when given.

    The one hash-while-copying loop: a file hashed in place, an upload or a
    download hashed on the way, so the digest describes exactly the bytes moved.

    Example:
        >>> hash_chunks([b"ab", b"c"], "sha256")[1][:8]
        'ba7816bf'
    """
    h, total = new_hasher(algo), 0
    for chunk in chunks:
        h.update(chunk)
        if into is not None:
            into.write(chunk)
        total += len(chunk)
    return total, h.hexdigest()


def part_digest(record: Mapping[str, Any]) -> tuple[str, str]:
    """``(algo, hex digest)`` of a part record, old or new.

    New records carry ``{"algo": ..., "digest": ...}``; records written before
    the algorithm was recorded carry only ``{"sha256": ...}`` and still read.

    Raises:
        CorruptCheckpointError: Neither form is present, the algorithm is
            unknown, or the digest is not lowercase hex of the right length.

    Example:
        >>> part_digest({"file": "a.pt", "bytes": 1, "sha256": "0" * 64})
        ('sha256', '0000000000000000000000000000000000000000000000000000000000000000')
    """
    if "algo" in record or "digest" in record:
        algo, digest = record.get("algo"), record.get("digest")
    else:
        algo, digest = "sha256", record.get("sha256")
    if not isinstance(algo, str) or algo not in ALGORITHMS:
        raise CorruptCheckpointError(f"record {dict(record)!r}: unknown integrity algorithm {algo!r}.")
    if not isinstance(digest, str) or len(digest) != ALGORITHMS[algo] or not set(digest) <= _HEX:
        raise CorruptCheckpointError(f"record names algorithm {algo!r} but has no valid digest.")
    return algo, digest


def check_hash_record(record: Any, *, where: str) -> dict[str, str]:
    """Validate the digest fields of a record read from a manifest; return just those two.

    Unlike :func:`part_digest`, the legacy ``{"sha256": ...}`` form is refused:
    the manifests checked here named their algorithm from the start.

    Raises:
        CorruptCheckpointError: Not a mapping with ``"algo"`` (a known name) and
            ``"digest"`` (lowercase hex of that algorithm's length), named by ``where``.

    Example:
        >>> check_hash_record({"file": "a", "algo": "sha256", "digest": "0" * 64}, where="m")["algo"]
        'sha256'
    """
    if not isinstance(record, dict) or "algo" not in record or "digest" not in record:
        raise CorruptCheckpointError(f"{where}: a hash record needs 'algo' and 'digest' fields.")
    try:
        algo, digest = part_digest(record)
    except CorruptCheckpointError as exc:
        raise CorruptCheckpointError(f"{where}: {exc}") from None
    return {"algo": algo, "digest": digest}


def record_fields(algo: str, digest: str) -> dict[str, str]:
    """The digest fields of a new record: ``{"algo": algo, "digest": digest}``.

    Example:
        >>> record_fields("sha256", "ab" * 32)["algo"]
        'sha256'
    """
    return {"algo": check_algo(algo), "digest": digest}


_crc_lock = threading.Lock()
_crc_users = 0
_crc_saved = True


@contextmanager
def zip_crc32_off() -> Iterator[None]:
    """Inside the block, ``torch.save`` writes zip entries without CRC32s.

    ``torch.save`` computes a CRC32 of every tensor (about 0.026 s per 128 MB
    here) that ``torch.load`` never checks; our digest already covers those
    bytes, so inside our saves it is wasted time. The cost of switching it off:
    zip tools (``unzip -t``, Python's ``zipfile`` when it reads a member)
    report CRC errors on these files. ``torch.load`` reads them normally.

    Where the setting lives depends on the torch version. Newer torch keeps
    a user's config change per thread (a ``ContextVar``: torch 2.13's
    ``torch/utils/_config_module.py``), so each saving thread, a shard writer
    or the async writer, turns it off for itself and puts its own value back.
    Older torch has one process-wide flag: then a counter under a lock turns it
    off when the first of our saves begins and restores it when the last one
    ends (a plain ``torch.save`` another thread starts in that window also skips
    its CRCs: harmless for ``torch.load``, visible to zip tools).
    """
    global _crc_users, _crc_saved
    from torch.utils.serialization import config

    if _config_is_per_thread(config):
        saved = config.save.compute_crc32
        config.save.compute_crc32 = False
        try:
            yield
        finally:
            config.save.compute_crc32 = saved
        return
    with _crc_lock:
        if _crc_users == 0:
            _crc_saved = config.save.compute_crc32
            config.save.compute_crc32 = False
        _crc_users += 1
    try:
        yield
    finally:
        with _crc_lock:
            _crc_users -= 1
            if _crc_users == 0:
                config.save.compute_crc32 = _crc_saved


def _config_is_per_thread(config: Any) -> bool:
    """True where torch stores config overrides per thread (a ``ContextVar`` per entry)."""
    entry = getattr(config, "_config", {}).get("save.compute_crc32")
    return isinstance(getattr(entry, "user_override", None), ContextVar)
