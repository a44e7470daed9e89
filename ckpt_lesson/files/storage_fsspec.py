"""The object-store backend of :mod:`ckpt_lesson.files.storage`, through fsspec.

What this code assumes of the store, and checks where it can:

* **strong read-after-write consistency**: a listing made after a put shows
  it, and a get after a put returns the new bytes (S3 since December 2020,
  GCS and Azure Blob always);
* **conditional create** (``If-None-Match: *``): of two writers creating the
  same key, exactly one wins (S3 since August 2024). fsspec spells it
  ``pipe_file(..., mode="create")``. :meth:`FsspecStorage.check_conditional_writes`
  proves it once per manager by creating a probe object twice: a store that
  lets the second write through is refused, because a commit marker that two
  writers can both write fences nothing.

Renames are *not* assumed: on S3 a rename is a copy and a delete, never atomic.
Every request runs under :func:`~ckpt_lesson.files.storage_transfer.reaching`.
"""

from __future__ import annotations

import inspect
import logging
import os
import uuid
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from ckpt_lesson.errors import CheckpointError
from ckpt_lesson.files.hashing import DEFAULT_ALGO, digest_bytes, hash_chunks
from ckpt_lesson.files.storage_base import CHUNK_BYTES, Storage, check_key, is_plain_key
from ckpt_lesson.files.storage_transfer import (
    DEFAULT_TIMEOUT,
    DOWNLOAD_CONCURRENCY,
    UPLOAD_BLOCK_BYTES,
    UPLOAD_CONCURRENCY,
    check_timeout,
    is_async,
    iter_ranges,
    multipart_upload,
    no_bucket,
    reaching,
)

__all__ = ["FsspecStorage", "INSTALL_HINT"]

log = logging.getLogger("ckpt_lesson.files.storage")

#: Parts below this size go up in one PUT, as s3fs's own put_file does (below 2 x 50 MiB);
#: larger ones as a parallel multipart upload (files/storage_transfer.py).
SINGLE_PUT_BYTES = 100 << 20
INSTALL_HINT = "pip install ckpt_lesson[s3]"


class FsspecStorage(Storage):
    """A prefix in an object store, reached through fsspec.

    Args:
        url: ``s3://bucket/prefix`` (or any fsspec URL).
        storage_options: fsspec options (``key``, ``secret``, ``client_kwargs``);
            ``None`` takes credentials and endpoint from the environment
            (``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``, ...), as boto3 does.
        timeout: Seconds any one request may wait for the store (default 300); then a
            ``LoadEnvironmentError`` names the bucket and what was waiting.

    Raises:
        CheckpointError: The client package is missing or the URL has no bucket.

    Example:
        >>> store = FsspecStorage("s3://my-bucket/runs/exp1")  # doctest: +SKIP
        >>> store.list_keys("step-00000010")  # doctest: +SKIP
        ['step-00000010/COMMIT', ...]
    """

    def __init__(
        self, url: str, storage_options: Mapping[str, Any] | None = None, *, timeout: float | None = None
    ) -> None:
        self.url = url.rstrip("/")
        #: Our own deadline for every request (seconds): botocore's and s3fs's timeouts and
        #: retries stack to many minutes against a silent store; this cuts any one wait short.
        self.timeout = DEFAULT_TIMEOUT if timeout is None else check_timeout(timeout)
        protocol = url.split("://", 1)[0].lower()
        try:
            import fsspec

            self.fs = fsspec.filesystem(protocol, **dict(storage_options or {}))
        except ImportError as exc:
            raise CheckpointError(
                f"{url}: the {protocol}:// client is not installed ({exc}); `{INSTALL_HINT}` "
                "(s3fs; gcsfs or adlfs for gs:// and az://)."
            ) from None
        except ValueError as exc:  # fsspec: "Protocol not known"
            raise CheckpointError(
                f"{url}: fsspec does not know {protocol}:// ({exc}); use s3://, gs:// or az://."
            ) from None
        self.root = self.fs._strip_protocol(url).rstrip("/")
        if not self.root:
            raise CheckpointError(f"{url}: no bucket in the URL; write it as {protocol}://BUCKET/PREFIX.")
        self.bucket = self.root.split("/", 1)[0]
        #: Multipart block for large parts (S3's minimum is 5 MiB); tests lower it.
        self.upload_block_bytes = UPLOAD_BLOCK_BYTES
        self._warned: set[str] = set()  # odd keys already named in a warning (once each)

    def __repr__(self) -> str:
        return f"FsspecStorage({self.url!r})"

    def _path(self, key: str) -> str:
        return f"{self.root}/{check_key(key)}"

    def _io(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """``self.fs.<method>(...)`` under our deadline (fsspec's sync layer cancels the request)."""
        if is_async(self.fs):
            kwargs["timeout"] = self.timeout
        return getattr(self.fs, method)(*args, **kwargs)

    def put_file(
        self, key: str, local: Path, *, algo: str = DEFAULT_ALGO, condition: dict[str, str] | None = None
    ) -> tuple[int, str]:
        """Upload ``local``; ``condition`` (``IfMatch``/``IfNoneMatch``) rides on the publishing request."""
        path = self._path(key)
        with reaching(self, f"uploading {key}", writing=True), open(local, "rb") as src:
            size = os.fstat(src.fileno()).st_size
            if size >= SINGLE_PUT_BYTES and getattr(self.fs, "call_s3", None) and is_async(self.fs):
                # Large: a parallel multipart upload, hashed block by block in order; the object
                # appears only when the upload completes, never half an object.
                bucket, _, object_key = path.partition("/")
                return multipart_upload(
                    self.fs, bucket, object_key, local, algo=algo, block=self.upload_block_bytes,
                    concurrency=UPLOAD_CONCURRENCY, condition=condition, timeout=self.timeout,
                )  # fmt: skip
            if size >= SINGLE_PUT_BYTES and condition is None:
                with self.fs.open(path, "wb", block_size=self.upload_block_bytes) as dst:
                    chunks = iter(lambda: src.read(self.upload_block_bytes), b"")
                    return hash_chunks(chunks, algo, into=dst)
            # One PUT, as plain s3fs does: the bytes hashed are exactly the bytes sent.
            data = src.read()
            extra = {"mode": "create"} if condition == {"IfNoneMatch": "*"} else dict(condition or {})
            self._io("pipe_file", path, data, **extra)
            return len(data), digest_bytes(data, algo)

    def exists(self, key: str) -> bool:
        """True when ``key`` is an object in the store now."""
        try:
            self.stat(key)
        except FileNotFoundError:
            return False
        return True

    def stat(self, key: str) -> tuple[int, str]:
        """``(size, etag)`` of ``key``, fresh from the store. ``FileNotFoundError`` if missing."""
        with reaching(self, f"reading {key}"):
            self.fs.invalidate_cache(self._path(key))
            info = self._io("info", self._path(key))
        return int(info["size"]), str(info.get("ETag") or info.get("etag") or "").strip('"')

    def put_bytes(self, key: str, data: bytes) -> None:
        with reaching(self, f"writing {key}", writing=True):
            self._io("pipe_file", self._path(key), data)

    def create_if_absent(self, key: str, data: bytes) -> bool:
        if "mode" not in inspect.signature(self.fs.pipe_file).parameters:
            raise CheckpointError(
                f"{self.url}: this fsspec backend ({type(self.fs).__name__}) has no conditional create "
                "(pipe_file mode='create'); a commit marker cannot fence writers there. Upgrade it "
                "(s3fs >= 2024.10) or use a store that supports If-None-Match."
            )
        try:
            with reaching(self, f"creating {key}", writing=True):
                self._io("pipe_file", self._path(key), data, mode="create")
        except FileExistsError:
            return False
        return True

    def check_conditional_writes(self) -> None:
        probe = f".ckpt-lesson-probe-{uuid.uuid4().hex}"
        first = self.create_if_absent(probe, b"probe")
        try:
            second = self.create_if_absent(probe, b"probe")
        finally:
            self.delete([probe])
        if not first or second:
            raise CheckpointError(
                f"{self.url}: the store let a conditional create (If-None-Match: *) overwrite an existing "
                "object; its commit marker would not stop two writers. Use S3 (since August 2024) or a "
                "store with conditional writes."
            )

    def read_bytes(self, key: str, *, limit: int) -> bytes:
        with reaching(self, f"reading {key}"):
            # One ranged GET for at most limit + 1 bytes: a larger object shows itself without a HEAD.
            data = self._io("cat_file", self._path(key), start=0, end=limit + 1)
        if len(data) > limit:
            raise CheckpointError(f"{self.where(key)}: over the {limit}-byte cap for a record.")
        return data

    def iter_chunks(self, key: str, *, chunk: int = CHUNK_BYTES, size: int | None = None) -> Iterator[bytes]:
        size = self.stat(key)[0] if size is None else size
        if is_async(self.fs):
            # Concurrent ranged GETs, handed over in order: the caller hashes block i while
            # the next ones are on the wire. A deletion mid-way is a FileNotFoundError.
            blocks = iter_ranges(
                self.fs, self._path(key), size, chunk=chunk, concurrency=DOWNLOAD_CONCURRENCY,
                timeout=self.timeout,
            )  # fmt: skip
            try:
                while True:
                    with reaching(self, f"reading {key}"):
                        block = next(blocks, None)
                    if block is None:
                        return
                    yield block
            finally:
                blocks.close()  # a caller that stops early cancels the GETs still in flight
        end = size + 1  # + 1: a longer object shows itself
        for start in range(0, end, chunk):
            with reaching(self, f"reading {key}"):
                block = self._io("cat_file", self._path(key), start=start, end=min(start + chunk, end))
            if not block:
                return
            yield block
            if len(block) < min(chunk, end - start):
                return  # the object ended early (shorter than expected)

    def list_keys(self, prefix: str = "") -> list[str]:
        base = f"{self.root}/{prefix}".rstrip("/")
        try:
            with reaching(self, "listing the run"):
                # Other writers (other processes) change the store: never answer from a cached listing.
                self.fs.invalidate_cache()
                found = self._io("find", base)
        except FileNotFoundError:
            if prefix:
                return []
            raise no_bucket(self.url, self.bucket) from None
        if not prefix and not found:
            self._check_bucket()
        cut = len(self.root) + 1
        keys = {p[cut:] for p in found if p.startswith(self.root + "/")} - {""}  # "" : a folder marker
        odd = sorted(k for k in keys if not is_plain_key(k))
        if odd:
            # Anyone who can write to the bucket can put any key there: one we cannot even name
            # safely (``..``, ``//``, ``/./``) is skipped and never read, deleted or counted.
            new = [k for k in odd if k not in self._warned]
            self._warned.update(new)
            if new:
                log.warning(
                    "%s: skipped %d key(s) this package never writes and will not touch: %s",
                    self.url, len(new), ", ".join(repr(k) for k in new[:10]),
                )  # fmt: skip
        return sorted(keys.difference(odd))

    def check_reachable(self) -> None:
        if getattr(self.fs, "call_s3", None) is None:
            return self._check_bucket()
        # S3: one key of the run's own prefix, which a policy scoped to that prefix allows
        # (HeadBucket, what fs.exists asks, needs rights on the whole bucket).
        prefix = self.root.partition("/")[2]
        try:
            with reaching(self, "listing the run"):
                self._io(
                    "call_s3",
                    "list_objects_v2",
                    Bucket=self.bucket,
                    Prefix=f"{prefix}/" if prefix else "",
                    MaxKeys=1,
                )
        except FileNotFoundError:  # NoSuchBucket
            raise no_bucket(self.url, self.bucket) from None

    def _check_bucket(self) -> None:
        """An empty listing from a missing bucket must not read as "no saves yet"."""
        with reaching(self, "checking the bucket"):
            exists = self._io("exists", self.bucket)
        if not exists:
            raise no_bucket(self.url, self.bucket)

    def delete(self, keys: list[str]) -> None:
        if not keys:
            return
        paths = [self._path(k) for k in keys]
        with reaching(self, "deleting"):
            try:
                self._io("rm", paths)
            except FileNotFoundError:
                pass

    def delete_if_match(self, key: str, etag: str) -> bool:
        """Delete ``key`` only while its ETag is ``etag`` (S3 ``If-Match``); False if it changed meanwhile.

        Outside S3 the delete is unconditional (fsspec has no conditional delete).
        """
        if getattr(self.fs, "call_s3", None) is None:
            self.delete([key])
            return True
        try:
            with reaching(self, f"deleting {key}"):
                self._io(
                    "call_s3",
                    "delete_object",
                    Bucket=self.bucket,
                    Key=self._path(key).split("/", 1)[1],
                    IfMatch=etag,
                )
        except (FileExistsError, FileNotFoundError):
            return False
        self.fs.invalidate_cache(self._path(key))
        return True

    def abort_uploads(self, prefix: str) -> int:
        if getattr(self.fs, "call_s3", None) is None:  # not S3: the backend cleans its own unfinished uploads
            return 0
        key_prefix = f"{self.root}/{prefix}".split("/", 1)[1]
        with reaching(self, "listing unfinished uploads"):
            listed = self._io("call_s3", "list_multipart_uploads", Bucket=self.bucket, Prefix=key_prefix)
            root_key = self.root.partition("/")[2]
            uploads = [  # an upload whose key we cannot name safely is someone else's: never aborted
                up for up in listed.get("Uploads", [])
                if is_plain_key(up["Key"][len(root_key) + 1 :] if root_key else up["Key"])
            ]  # fmt: skip
            for up in uploads:
                self._io(
                    "call_s3",
                    "abort_multipart_upload",
                    Bucket=self.bucket,
                    Key=up["Key"],
                    UploadId=up["UploadId"],
                )
        return len(uploads)
