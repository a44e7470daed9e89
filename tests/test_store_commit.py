"""The object-store commit protocol: conditional marker, leases, retention order, long listings."""

from __future__ import annotations

import json
import threading

import pytest
import torch

from ckpt_lesson.files.storage_fsspec import FsspecStorage
from ckpt_lesson.runs.manager import CheckpointManager
from ckpt_lesson.runs.store_commit import (
    CommitConflictError,
    clean_uncommitted,
    committed_steps,
    delete_store_save,
    read_commit,
)


def _manager(bucket, **kwargs):
    return CheckpointManager(bucket.url(), every_steps=2, storage_options=bucket.options, **kwargs)


def test_a_zombie_writer_cannot_commit_a_step_its_replacement_already_committed(tiny_run, s3_bucket):
    zombie, replacement = tiny_run(seed=1), tiny_run(seed=2)
    for run in (zombie, replacement):
        run.train(until_step=4)
    with _manager(s3_bucket) as new_mgr, _manager(s3_bucket) as old_mgr:
        new_mgr.save(replacement.model, replacement.optimizer, replacement.scheduler, replacement.state)
        with pytest.raises(CommitConflictError, match="already committed by another writer"):
            old_mgr.save(zombie.model, zombie.optimizer, zombie.scheduler, zombie.state)
    store = FsspecStorage(s3_bucket.url(), s3_bucket.options)
    marker, _ = read_commit(store, 4)
    # Only the winner's upload remains: the zombie removed its own, and never touched the winner's.
    assert {k.split("/")[1] for k in store.list_keys("step-00000004") if k.count("/") == 2} == {
        marker["save_id"]
    }
    fresh = tiny_run(seed=9)
    with _manager(s3_bucket) as mgr:
        assert mgr.restore_latest(fresh.model, fresh.optimizer, fresh.scheduler).step == 4
    for a, b in zip(replacement.model.state_dict().values(), fresh.model.state_dict().values(), strict=True):
        assert torch.equal(a, b)


def test_an_uncommitted_upload_is_kept_while_its_lease_runs_and_removed_after(s3_bucket):
    store = FsspecStorage(s3_bucket.url(), s3_bucket.options)
    attempt = "step-00000008/" + "ab" * 16
    store.put_bytes(f"{attempt}/LEASE", json.dumps({"writer": "h:1", "expires_at": 1000.0}).encode())
    store.put_bytes(f"{attempt}/checkpoint.pt", b"half a save")
    assert clean_uncommitted(store, now=999.0) == []
    assert committed_steps(store) == []
    assert clean_uncommitted(store, now=1001.0) == [attempt]
    assert store.list_keys() == []


def test_retention_deletes_the_marker_first_so_a_half_deleted_save_is_never_counted(tiny_run, s3_bucket):
    run = tiny_run(seed=1)
    with _manager(s3_bucket, keep_last=2) as mgr:
        for step in (2, 4, 6):
            run.train(until_step=step)
            mgr.save(run.model, run.optimizer, run.scheduler, run.state)
        assert mgr.all_steps() == [4, 6]
    store = FsspecStorage(s3_bucket.url(), s3_bucket.options)
    assert store.list_keys("step-00000002") == []
    # A kill between the two deletions leaves parts without a marker: invisible, then cleaned.
    marker, _ = read_commit(store, 4)
    store.delete(["step-00000004/COMMIT"])
    assert committed_steps(store) == [6]
    assert clean_uncommitted(store) == ["step-00000004/" + marker["save_id"]]
    delete_store_save(store, 6)
    assert store.list_keys() == []


def test_listings_past_1000_keys_find_every_committed_save(tiny_run, s3_bucket):
    fs = s3_bucket.fs()
    # 1,050 leftover objects sort before the real save: one listing page (1,000 keys) is not enough.
    fs.pipe({f"{s3_bucket.name}/run/step-00000001/{'cd' * 16}/f{i:04d}": b"x" for i in range(1050)})
    run = tiny_run(seed=1)
    run.train(until_step=2)
    with _manager(s3_bucket) as mgr:
        mgr.save(run.model, run.optimizer, run.scheduler, run.state)
        assert mgr.all_steps() == [2]
    store = FsspecStorage(s3_bucket.url(), s3_bucket.options)
    # The leftovers had no lease: the clean after the save removed all 1,050 (deletes go 1,000 a request).
    names = sorted(k.rsplit("/", 1)[-1] for k in store.list_keys())
    assert names == ["COMMIT", "checkpoint.pt", "manifest.json"]


def test_two_writers_racing_for_one_step_leave_exactly_one_whole_save(tiny_run, s3_bucket):
    runs = [tiny_run(seed=s) for s in (1, 2)]
    for run in runs:
        run.train(until_step=4)
    managers = [_manager(s3_bucket) for _ in runs]
    barrier, outcome = threading.Barrier(2), {}

    def write(i):
        barrier.wait()
        try:
            managers[i].save(runs[i].model, runs[i].optimizer, runs[i].scheduler, runs[i].state)
            outcome[i] = "committed"
        except CommitConflictError:
            outcome[i] = "refused"

    threads = [threading.Thread(target=write, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    # Real S3 serialises the two conditional creates: one commits, one is refused. moto's check is
    # not atomic across its threads, so there both may pass; either way each upload has its own
    # prefix, so the marker always names one whole save and the restore is one writer's model.
    assert "committed" in outcome.values()
    fresh = tiny_run(seed=9)
    with _manager(s3_bucket) as mgr:
        assert mgr.restore_latest(fresh.model, fresh.optimizer, fresh.scheduler).step == 4
    got = list(fresh.model.state_dict().values())
    matches = [
        all(torch.equal(a, b) for a, b in zip(r.model.state_dict().values(), got, strict=True)) for r in runs
    ]
    assert matches.count(True) == 1


def test_cleaning_aborts_the_unfinished_multipart_upload_of_a_dead_writer(s3_bucket):
    store = FsspecStorage(s3_bucket.url(), s3_bucket.options)
    fs = s3_bucket.fs()
    key = "run/step-00000002/" + "ef" * 16 + "/checkpoint.pt"
    fs.call_s3("create_multipart_upload", Bucket=s3_bucket.name, Key=key)
    store.put_bytes("step-00000002/" + "ef" * 16 + "/LEASE", b'{"expires_at": 0}')
    assert clean_uncommitted(store) == ["step-00000002/" + "ef" * 16]
    assert fs.call_s3("list_multipart_uploads", Bucket=s3_bucket.name).get("Uploads", []) == []
