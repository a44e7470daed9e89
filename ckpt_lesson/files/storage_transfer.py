"""How the object-store backend talks to its store: deadlines, errors that are not damage, large transfers.

:class:`~ckpt_lesson.files.storage_fsspec.FsspecStorage` runs every request
under :func:`reaching`: not reaching the store is never "damage", because an
older save would fail the same way.

The bytes of large parts go through s3fs here too, and the rules of the
package stay the same on both paths:

* **up**: the local file is read once, in order; each block is hashed *before*
  it is handed to the network, so the digest returned is the digest of the
  bytes sent. Up to :data:`UPLOAD_CONCURRENCY` blocks are in flight at once
  (``upload_part`` requests running on fsspec's event loop), so the memory held
  is bounded by ``concurrency x block``. The object appears only when
  ``complete_multipart_upload`` succeeds; any error aborts the upload first.
  A writer killed in between leaves an unfinished upload, which
  :func:`~ckpt_lesson.runs.store_commit.clean_uncommitted` aborts.
* **down**: ranged GETs for consecutive blocks go out concurrently, and the
  caller receives the blocks *in order*, so it can hash (and write) block i
  while blocks i + 1 ... are still on the wire. The last range asks for one
  byte more than expected: an object longer than its record shows itself
  without an extra request, and one shorter ends the stream early.

Both sides need an asynchronous fsspec backend (s3fs, gcsfs, adlfs are); the
multipart calls are S3's. Elsewhere the callers fall back to fsspec's own
streaming.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import math
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from ckpt_lesson.errors import CheckpointError, LoadEnvironmentError
from ckpt_lesson.files.hashing import new_hasher

__all__ = [
    "DEFAULT_TIMEOUT",
    "DOWNLOAD_CONCURRENCY",
    "TIMEOUTS",
    "RANGE_BYTES",
    "UPLOAD_BLOCK_BYTES",
    "UPLOAD_CONCURRENCY",
    "check_timeout",
    "iter_ranges",
    "multipart_upload",
    "no_bucket",
    "reaching",
]

#: Multipart block (s3fs's default is 50 MiB too); grown for huge files so they fit in 10,000 parts.
UPLOAD_BLOCK_BYTES = 50 << 20
#: Blocks in flight while uploading (memory: this many blocks; s3fs's put_file sends up to 10).
UPLOAD_CONCURRENCY = 8
#: One ranged GET: s3fs's concurrent cat_file uses its 50 MiB block size too. Measured on moto,
#: 16 MiB ranges were slower for 256 MiB (moto builds the whole object for every ranged GET).
RANGE_BYTES = 50 << 20
#: Ranged GETs in flight while downloading (memory: this many ranges).
DOWNLOAD_CONCURRENCY = 8
_MAX_PARTS = 10_000
#: Seconds any one request may wait for the store before we give up on it: a silent store
#: (a paused server, a black-holed route) is named within 5 minutes, not after stacked retries.
DEFAULT_TIMEOUT = 300.0
#: What a missed deadline raises: fsspec's FSTimeoutError, a future's TimeoutError (not the
#: builtin before Python 3.11).
TIMEOUTS = (TimeoutError, asyncio.TimeoutError, concurrent.futures.TimeoutError)


def check_timeout(timeout: object) -> float:
    """``timeout`` as seconds > 0, or a one-line ``CheckpointError``.

    Example:
        >>> check_timeout(30)
        30.0
    """
    ok = isinstance(timeout, (int, float)) and not isinstance(timeout, bool) and 0 < timeout < math.inf
    if not ok:
        raise CheckpointError(
            f"timeout must be a number of seconds > 0 (how long one store request may wait), got {timeout!r}."
        )
    return float(timeout)


def no_bucket(url: str, bucket: str) -> LoadEnvironmentError:
    """The error for a bucket that is not there (or not visible with these credentials)."""
    return LoadEnvironmentError(
        f"{url}: bucket '{bucket}' does not exist (or is not visible with these "
        "credentials); create it or fix the URL."
    )


def _unreachable(url: str, bucket: str, what: str, exc: BaseException) -> LoadEnvironmentError:
    return LoadEnvironmentError(
        f"{url}: could not reach bucket '{bucket}' while {what} "
        f"({type(exc).__name__}: {exc}); check AWS_ENDPOINT_URL, the network and the bucket name."
    )


@contextmanager
def reaching(storage: Any, what: str, *, writing: bool = False) -> Iterator[None]:
    """Turn "cannot reach the store" into one LoadEnvironmentError naming the bucket.

    Args:
        storage: The :class:`~ckpt_lesson.files.storage_fsspec.FsspecStorage` (its
            ``url``, ``bucket`` and ``timeout`` go into the messages).
        what: What was being done, for the message ("reading step-00000010/COMMIT").
        writing: A missing object then means a missing bucket.

    Raises:
        LoadEnvironmentError: The store could not be reached, refused the
            credentials, or gave no answer within ``storage.timeout`` seconds.
        FileNotFoundError: A read missed its object. FileExistsError: a condition failed.

    Example:
        >>> with reaching(store, "listing the run"):  # doctest: +SKIP
        ...     keys = store.fs.find(store.root)
    """
    url, bucket = storage.url, storage.bucket
    try:
        yield
    except FileNotFoundError:
        if writing:  # a write cannot miss its object: what is missing is the bucket
            raise no_bucket(url, bucket) from None
        raise
    except (FileExistsError, CheckpointError):
        raise
    except TIMEOUTS:  # our own deadline (before OSError: a TimeoutError is one)
        raise LoadEnvironmentError(
            f"{url}: bucket '{bucket}' gave no answer within {storage.timeout:g} s while {what}; "
            "the store is stalled or unreachable. Check AWS_ENDPOINT_URL and the network, or raise "
            "timeout= (seconds) if it is only slow."
        ) from None
    except PermissionError as exc:
        raise LoadEnvironmentError(
            f"{url}: access to bucket '{bucket}' denied while {what} ({exc}); check the "
            "credentials (AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY or storage_options)."
        ) from None
    except OSError as exc:
        # S3's 412 PreconditionFailed (If-Match / If-None-Match refused) arrives from s3fs as a plain
        # OSError: the object is not as expected, which is not about reaching the store.
        response = getattr(exc.__cause__, "response", None) or {}
        if response.get("Error", {}).get("Code") in ("PreconditionFailed", "412"):
            raise FileExistsError(f"{url}/: precondition failed while {what}") from None
        raise _unreachable(url, bucket, what, exc) from None
    except Exception as exc:  # botocore / aiohttp: the network or the service, not the save
        raise _unreachable(url, bucket, what, exc) from None


def is_async(fs: Any) -> bool:
    """True when ``fs`` runs its requests on an event loop we can submit coroutines to."""
    return bool(getattr(fs, "async_impl", False)) and getattr(fs, "loop", None) is not None


def _submit(fs: Any, coro: Any) -> concurrent.futures.Future[Any]:
    return asyncio.run_coroutine_threadsafe(coro, fs.loop)


def multipart_upload(
    fs: Any,
    bucket: str,
    key: str,
    local: Path,
    *,
    algo: str,
    block: int = UPLOAD_BLOCK_BYTES,
    concurrency: int = UPLOAD_CONCURRENCY,
    condition: dict[str, str] | None = None,
    timeout: float | None = None,
) -> tuple[int, str]:
    """Upload ``local`` to ``bucket/key`` as a parallel multipart upload; returns ``(bytes, digest)``.

    Args:
        fs: An ``s3fs.S3FileSystem``.
        bucket: The bucket.
        key: The object key inside it.
        local: The file to send; read once, in order.
        algo: Hash algorithm of the digest returned.
        block: Part size (S3 needs at least 5 MiB for every part but the last); grown to fit 10,000 parts.
        concurrency: Parts in flight at once.
        condition: Extra arguments of ``complete_multipart_upload``
            (``{"IfNoneMatch": "*"}`` or ``{"IfMatch": etag}``).
        timeout: Seconds any one request may wait (``None``: no deadline).

    Returns:
        ``(size, hex digest)`` of the bytes sent.

    Raises:
        TimeoutError: A request waited longer than ``timeout``.
        Whatever s3fs raises; the upload is aborted first (best effort).

    Example:
        >>> multipart_upload(fs, "bucket", "run/big.pt", Path("big.pt"), algo="xxh3_128")  # doctest: +SKIP
        (1073741824, '5f1c...')
    """
    size = local.stat().st_size
    block = max(block, math.ceil(size / _MAX_PARTS))  # larger for huge files: S3 allows 10,000 parts
    created = _wait(_submit(fs, fs._call_s3("create_multipart_upload", Bucket=bucket, Key=key)), timeout)
    upload_id = created["UploadId"]
    hasher, total, number = new_hasher(algo), 0, 0
    in_flight: deque[tuple[int, concurrent.futures.Future[Any]]] = deque()
    done: list[dict[str, Any]] = []
    try:
        with open(local, "rb") as src:
            while chunk := src.read(block):
                hasher.update(chunk)  # hashed before it leaves: the digest is of the bytes sent
                total += len(chunk)
                number += 1
                call = fs._call_s3(
                    "upload_part", Bucket=bucket, Key=key, UploadId=upload_id, PartNumber=number, Body=chunk
                )
                in_flight.append((number, _submit(fs, call)))
                while len(in_flight) >= concurrency:
                    n, fut = in_flight.popleft()
                    done.append({"PartNumber": n, "ETag": _wait(fut, timeout)["ETag"]})
        while in_flight:
            n, fut = in_flight.popleft()
            done.append({"PartNumber": n, "ETag": _wait(fut, timeout)["ETag"]})
        _complete(fs, bucket, key, upload_id, done, condition, timeout=timeout)
    except BaseException:
        for _, fut in in_flight:
            fut.cancel()
        try:
            abort = fs._call_s3("abort_multipart_upload", Bucket=bucket, Key=key, UploadId=upload_id)
            _wait(_submit(fs, abort), min(60.0, timeout or 60.0))
        except Exception:  # noqa: S110 - the first error is the one to report; a lease cleans up later
            pass
        raise
    fs.invalidate_cache(f"{bucket}/{key}")
    return total, hasher.hexdigest()


def _complete(
    fs: Any,
    bucket: str,
    key: str,
    upload_id: str,
    parts: list[dict[str, Any]],
    condition: dict[str, str] | None,
    *,
    timeout: float | None = None,
) -> None:
    """The one request that makes a multipart upload an object (the chaos harness kills just before it)."""
    call = fs._call_s3(
        "complete_multipart_upload",
        Bucket=bucket,
        Key=key,
        UploadId=upload_id,
        MultipartUpload={"Parts": parts},
        **(condition or {}),
    )
    _wait(_submit(fs, call), timeout)


def iter_ranges(
    fs: Any,
    path: str,
    size: int,
    *,
    chunk: int = RANGE_BYTES,
    concurrency: int = DOWNLOAD_CONCURRENCY,
    timeout: float | None = None,
) -> Iterator[bytes]:
    """Yield ``path``'s bytes in order, fetched as concurrent ranged GETs; at most ``size + 1`` bytes.

    A range past the real end of a shorter object just ends the stream (the caller compares the count).

    Args:
        fs: An asynchronous fsspec filesystem.
        path: The object's path (``bucket/key``).
        size: Its expected size.
        chunk: Bytes per ranged GET.
        concurrency: GETs in flight.
        timeout: Seconds to wait for each block (``None``: no deadline).

    Raises:
        FileNotFoundError: The object is missing (or was deleted part-way).
        TimeoutError: A block took longer than ``timeout``; every GET in flight is cancelled.
        Whatever else the filesystem raises for the first range that failed.

    Example:
        >>> sum(len(b) for b in iter_ranges(fs, "bucket/run/a.pt", 1 << 30))  # doctest: +SKIP
        1073741824
    """
    end = size + 1  # one byte more: a longer object shows itself
    starts = iter(range(0, end, chunk))
    in_flight: deque[tuple[int, concurrent.futures.Future[Any]]] = deque()

    def top_up() -> None:
        while len(in_flight) < concurrency:
            start = next(starts, None)
            if start is None:
                return
            in_flight.append(
                (start, _submit(fs, fs._cat_file(path, start=start, end=min(start + chunk, end))))
            )

    try:
        top_up()
        while in_flight:
            start, fut = in_flight.popleft()
            try:
                block = _wait(fut, timeout)
            except (FileNotFoundError, *TIMEOUTS):
                raise  # (a TimeoutError is an OSError too: not "the object ended early")
            except OSError:
                if start > 0:  # S3 answers a range past the end with 416: did the object end early?
                    fs.invalidate_cache(path)  # (FileNotFoundError when it vanished meanwhile)
                    if int(fs.info(path, timeout=timeout)["size"]) <= start:
                        return
                raise
            top_up()
            if block:
                yield block
            if len(block) < min(chunk, end - start):
                return  # ended early: later ranges (if any) are past the end
    finally:
        for _, fut in in_flight:
            fut.cancel()


def _wait(fut: concurrent.futures.Future[Any], timeout: float | None) -> Any:
    """``fut.result(timeout)``; a missed deadline cancels the request on fsspec's loop first."""
    try:
        return fut.result(timeout=timeout)
    except TIMEOUTS:
        fut.cancel()
        raise
