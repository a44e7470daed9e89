"""Large objects to and from a real S3 API (moto's server): parallel multipart up, concurrent ranges down."""

from __future__ import annotations

import os

import pytest

from ckpt_lesson.errors import CheckpointError
from ckpt_lesson.files import storage_fsspec
from ckpt_lesson.files.hashing import digest_bytes
from ckpt_lesson.files.storage_fsspec import FsspecStorage

MIB = 1 << 20


@pytest.fixture
def store(s3_bucket):
    return FsspecStorage(s3_bucket.url(), s3_bucket.options)


def _uploads(bucket):
    return bucket.fs().call_s3("list_multipart_uploads", Bucket=bucket.name).get("Uploads", [])


def test_a_large_part_goes_up_as_a_parallel_multipart_upload_hashing_the_bytes_sent(
    store, s3_bucket, tmp_path, monkeypatch
):
    monkeypatch.setattr(storage_fsspec, "SINGLE_PUT_BYTES", 8 * MIB)
    store.upload_block_bytes = 5 * MIB  # S3's smallest part: 12 MiB go up as 3 parts, in parallel
    data = os.urandom(12 * MIB + 123)
    (tmp_path / "big.pt").write_bytes(data)
    size, digest = store.put_file("step-00000001/abc/big.pt", tmp_path / "big.pt", algo="xxh3_128")
    assert (size, digest) == (len(data), digest_bytes(data, "xxh3_128"))
    fs = s3_bucket.fs()
    path = f"{s3_bucket.name}/run/step-00000001/abc/big.pt"
    assert fs.cat_file(path) == data
    assert fs.info(path)["ETag"].strip('"').endswith("-3")  # S3's mark of a 3-part upload
    assert _uploads(s3_bucket) == []


def test_a_multipart_upload_that_fails_is_aborted_and_leaves_no_object(
    store, s3_bucket, tmp_path, monkeypatch
):
    monkeypatch.setattr(storage_fsspec, "SINGLE_PUT_BYTES", 1 * MIB)
    store.upload_block_bytes = 1 * MIB  # below S3's 5 MiB minimum: completing the upload fails
    (tmp_path / "big.pt").write_bytes(os.urandom(3 * MIB))
    with pytest.raises(CheckpointError, match=s3_bucket.name):
        store.put_file("step-00000001/abc/big.pt", tmp_path / "big.pt")
    assert store.list_keys() == [] and _uploads(s3_bucket) == []


def test_concurrent_ranged_reads_hand_over_the_object_in_order(store, s3_bucket):
    data = os.urandom(10 * MIB + 7)
    s3_bucket.fs().pipe_file(f"{s3_bucket.name}/run/obj", data)
    blocks = list(store.iter_chunks("obj", chunk=1 * MIB, size=len(data)))
    assert b"".join(blocks) == data
    assert max(len(b) for b in blocks) <= MIB


def test_ranged_reads_show_an_object_longer_or_shorter_than_its_record(store, s3_bucket):
    data = os.urandom(3 * MIB)
    s3_bucket.fs().pipe_file(f"{s3_bucket.name}/run/obj", data)
    longer = b"".join(store.iter_chunks("obj", chunk=MIB, size=len(data) - 5))
    assert longer == data[: len(data) - 4]  # one byte past the record: enough to call it different
    # Recorded as 6 MiB: the ranges past the real end are not an error, the stream just stops.
    shorter = b"".join(store.iter_chunks("obj", chunk=MIB, size=6 * MIB))
    assert shorter == data


def test_a_missing_object_is_file_not_found_not_an_unreachable_store(store):
    with pytest.raises(FileNotFoundError):
        list(store.iter_chunks("nothing-here", chunk=MIB, size=3 * MIB))
