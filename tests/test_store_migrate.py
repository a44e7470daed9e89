"""``migrate`` of an object in a bucket (a real S3 API: moto's server, s3fs over HTTP).

The original bytes must survive every outcome: kept as a backup object that is
never overwritten, and the object replaced only while nobody else changed it.
"""

from __future__ import annotations

import pytest

from ckpt_lesson import cli
from ckpt_lesson.course.training import make_model, make_optimizer_and_scheduler, seed_everything
from ckpt_lesson.errors import CheckpointError
from ckpt_lesson.files import schema, store_migrate
from ckpt_lesson.files.checkpoint import TrainState, load_verified_file
from ckpt_lesson.files.migrate import write_legacy_v1_checkpoint
from ckpt_lesson.files.store_migrate import migrate_store_object


@pytest.fixture
def old_object(s3_bucket, tmp_path):
    """A v1 checkpoint (the lesson's original format) uploaded as ``s3://BUCKET/old/last.pt``."""
    seed_everything(3)
    model = make_model()
    optimizer, scheduler = make_optimizer_and_scheduler(model, total_steps=10)
    path = write_legacy_v1_checkpoint(model, optimizer, scheduler, TrainState(step=5), tmp_path / "last.pt")
    original = path.read_bytes()
    s3_bucket.fs().pipe_file(f"{s3_bucket.name}/old/last.pt", original)
    return f"s3://{s3_bucket.name}/old/last.pt", original


def _get(bucket, key):
    return bucket.fs().cat_file(f"{bucket.name}/{key}")


def _load(data, tmp_path):
    (tmp_path / "check.pt").write_bytes(data)
    return load_verified_file(tmp_path / "check.pt")


def test_migrating_an_object_keeps_the_original_as_a_backup_object_and_writes_a_verified_current_file(
    s3_bucket, old_object, tmp_path
):
    url, original = old_object
    result = migrate_store_object(url, storage_options=s3_bucket.options)
    assert result.changed and result.backup == url + ".v1.bak"
    assert (result.from_schema, result.to_schema) == (schema.SCHEMA_V1, schema.CURRENT_SCHEMA)
    assert _get(s3_bucket, "old/last.pt.v1.bak") == original
    payload, digest = _load(_get(s3_bucket, "old/last.pt"), tmp_path)
    assert payload["schema"] == schema.CURRENT_SCHEMA and digest.has_footer
    again = migrate_store_object(url, storage_options=s3_bucket.options)
    assert not again.changed and _get(s3_bucket, "old/last.pt.v1.bak") == original


def test_the_migrate_command_takes_a_bucket_url_from_the_environment(
    s3_bucket, old_object, monkeypatch, capsys
):
    url, original = old_object
    for name, value in s3_bucket.env().items():
        monkeypatch.setenv(name, value)
    assert cli.main(["migrate", url]) == 0
    assert f"original kept as {url}.v1.bak" in capsys.readouterr().out
    assert _get(s3_bucket, "old/last.pt.v1.bak") == original


def test_a_backup_object_with_other_bytes_is_never_overwritten(s3_bucket, old_object):
    url, original = old_object
    s3_bucket.fs().pipe_file(f"{s3_bucket.name}/old/last.pt.v1.bak", b"someone else's file")
    with pytest.raises(CheckpointError, match="already exists with other bytes"):
        migrate_store_object(url, storage_options=s3_bucket.options)
    assert _get(s3_bucket, "old/last.pt.v1.bak") == b"someone else's file"
    assert _get(s3_bucket, "old/last.pt") == original


def test_a_run_killed_after_the_backup_is_finished_by_running_migrate_again(s3_bucket, old_object, tmp_path):
    url, original = old_object
    s3_bucket.fs().pipe_file(f"{s3_bucket.name}/old/last.pt.v1.bak", original)  # what the killed run left
    assert migrate_store_object(url, storage_options=s3_bucket.options).changed
    assert _get(s3_bucket, "old/last.pt.v1.bak") == original
    assert _load(_get(s3_bucket, "old/last.pt"), tmp_path)[0]["schema"] == schema.CURRENT_SCHEMA


def test_an_object_rewritten_during_the_migration_is_not_replaced(s3_bucket, old_object, monkeypatch):
    url, original = old_object
    real = store_migrate.migrate_file

    def another_writer_meanwhile(path, **kwargs):
        result = real(path, **kwargs)
        s3_bucket.fs().pipe_file(f"{s3_bucket.name}/old/last.pt", b"a newer file")  # a real PUT
        return result

    monkeypatch.setattr(store_migrate, "migrate_file", another_writer_meanwhile)
    with pytest.raises(CheckpointError, match="changed while it was being migrated"):
        migrate_store_object(url, storage_options=s3_bucket.options)
    assert _get(s3_bucket, "old/last.pt") == b"a newer file"  # If-Match refused our overwrite
    assert _get(s3_bucket, "old/last.pt.v1.bak") == original


def test_a_part_of_a_committed_save_is_refused(s3_bucket, old_object):
    url, original = old_object
    s3_bucket.fs().pipe_file(f"{s3_bucket.name}/old/manifest.json", b"{}")
    with pytest.raises(CheckpointError, match="one part of a save recorded in manifest.json"):
        migrate_store_object(url, storage_options=s3_bucket.options)
    assert _get(s3_bucket, "old/last.pt") == original
