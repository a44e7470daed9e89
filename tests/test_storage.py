"""The storage interface: the same verbs on a local folder and on S3 (moto server, s3fs over HTTP)."""

from __future__ import annotations

import pytest

from ckpt_lesson.errors import CheckpointError, UnsafeCheckpointError
from ckpt_lesson.files.hashing import digest_bytes
from ckpt_lesson.files.storage import LocalStorage, is_store_url, open_storage
from ckpt_lesson.files.storage_fsspec import FsspecStorage


@pytest.fixture(params=["local", "s3"])
def store(request, tmp_path):
    if request.param == "local":
        return LocalStorage(tmp_path / "store")
    bucket = request.getfixturevalue("s3_bucket")
    return open_storage(bucket.url("prefix"), bucket.options)


def test_put_file_streams_up_and_returns_the_digest_of_what_it_sent(store, tmp_path):
    data = bytes(range(256)) * 1000
    (tmp_path / "part.bin").write_bytes(data)
    size, digest = store.put_file("step-00000001/a/part.bin", tmp_path / "part.bin", algo="sha256")
    assert (size, digest) == (len(data), digest_bytes(data, "sha256"))
    assert b"".join(store.iter_chunks("step-00000001/a/part.bin", chunk=10_000)) == data
    assert store.read_bytes("step-00000001/a/part.bin", limit=len(data)) == data
    with pytest.raises(CheckpointError, match="100.byte|than 100 bytes"):
        store.read_bytes("step-00000001/a/part.bin", limit=100)


def test_create_if_absent_writes_once_and_then_refuses(store):
    assert store.create_if_absent("step-00000001/COMMIT", b"first") is True
    assert store.create_if_absent("step-00000001/COMMIT", b"second") is False
    assert store.read_bytes("step-00000001/COMMIT", limit=100) == b"first"
    store.check_conditional_writes()


def test_list_and_delete_see_every_key_under_a_prefix(store):
    for key in ("b/2", "a/1", "a/x/3"):
        store.put_bytes(key, b"x")
    assert store.list_keys() == ["a/1", "a/x/3", "b/2"]
    assert store.list_keys("a") == ["a/1", "a/x/3"]
    store.delete(["a/1", "a/x/3", "missing"])
    assert store.list_keys() == ["b/2"]
    with pytest.raises(FileNotFoundError):
        list(store.iter_chunks("a/1"))


def test_keys_that_would_leave_the_prefix_are_refused(store):
    for key in ("../escape", "/abs", "a//b", "a/./b"):
        with pytest.raises(UnsafeCheckpointError, match="leave the run's prefix"):
            store.put_bytes(key, b"x")


def test_only_real_urls_count_as_stores():
    assert is_store_url("s3://b/p") and is_store_url("gs://b/p")
    assert not is_store_url("runs/a") and not is_store_url("file:///tmp/a") and not is_store_url(None)


def test_a_url_without_a_bucket_is_refused_with_the_form_to_use():
    with pytest.raises(CheckpointError, match="memory://BUCKET/PREFIX"):
        FsspecStorage("memory://")


def test_a_listing_skips_keys_it_cannot_name_safely_and_warns_once_naming_them(s3_bucket, caplog):
    store = open_storage(s3_bucket.url("prefix"), s3_bucket.options)
    odd = ["prefix/step-5/junk/../x", "prefix/a//b", "prefix/a/./c", "prefix/trailing/"]
    for key in [*odd, "prefix/a/ok"]:
        s3_bucket.fs().call_s3("put_object", Bucket=s3_bucket.name, Key=key, Body=b"x")
    with caplog.at_level("WARNING", logger="ckpt_lesson.files.storage"):
        assert store.list_keys() == ["a/ok"]
        assert store.list_keys("a") == ["a/ok"]
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 1 and all(repr(k[len("prefix/") :]) in warned[0] for k in odd)
