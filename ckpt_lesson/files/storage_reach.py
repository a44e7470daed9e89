"""How the object-store backend meets its store: the fsspec client, and errors that are not damage.

Every failure that is about reaching the store (wrong credentials, a missing
bucket, a dropped connection, a store that stopped answering within our own
deadline) becomes a :class:`LoadEnvironmentError` naming the bucket: an older
save would fail the same way, so it is never "damaged". A missing *object*
stays a ``FileNotFoundError`` for the caller to judge, and S3's 412 (a
conditional write refused) a ``FileExistsError``.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from ckpt_lesson.errors import CheckpointError, LoadEnvironmentError
from ckpt_lesson.files.storage_transfer import TIMEOUTS

__all__ = ["INSTALL_HINT", "no_bucket", "open_filesystem", "reaching"]

INSTALL_HINT = "pip install ckpt_lesson[s3]"


def open_filesystem(url: str, options: Mapping[str, Any]) -> tuple[Any, str]:
    """``(filesystem, root path)`` for ``url``, or a one-line error naming the extra to install."""
    protocol = url.split("://", 1)[0].lower()
    try:
        import fsspec

        fs = fsspec.filesystem(protocol, **dict(options))
    except ImportError as exc:
        raise CheckpointError(
            f"{url}: the {protocol}:// client is not installed ({exc}); `{INSTALL_HINT}` "
            "(s3fs; gcsfs or adlfs for gs:// and az://)."
        ) from None
    except ValueError as exc:  # fsspec: "Protocol not known"
        raise CheckpointError(
            f"{url}: fsspec does not know {protocol}:// ({exc}); use s3://, gs:// or az://."
        ) from None
    root = fs._strip_protocol(url).rstrip("/")
    if not root:
        raise CheckpointError(f"{url}: no bucket in the URL; write it as {protocol}://BUCKET/PREFIX.")
    return fs, root


def _precondition_failed(exc: BaseException) -> bool:
    """True when s3fs's error came from S3's 412 PreconditionFailed (it arrives as a plain OSError)."""
    response = getattr(exc.__cause__, "response", None) or {}
    return response.get("Error", {}).get("Code") in ("PreconditionFailed", "412")


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
        if _precondition_failed(exc):  # If-Match / If-None-Match refused: the object is not as expected
            raise FileExistsError(f"{url}/: precondition failed while {what}") from None
        raise _unreachable(url, bucket, what, exc) from None
    except Exception as exc:  # botocore / aiohttp: the network or the service, not the save
        raise _unreachable(url, bucket, what, exc) from None
