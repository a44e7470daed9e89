"""Restores from an object store: every byte verified before unpickling, damage falls back.

A real S3 API (moto's server) reached over HTTP by s3fs; the damage is done to
the real objects in the bucket.
"""

from __future__ import annotations

import pytest
import torch

from ckpt_lesson.errors import CheckpointError, IncompleteCheckpointError
from ckpt_lesson.files.storage_fsspec import FsspecStorage
from ckpt_lesson.runs.manager import CheckpointManager
from ckpt_lesson.runs.store_commit import delete_store_save, read_commit
from ckpt_lesson.runs.store_restore import fetch_verified


def _saved_run(tiny_run, bucket, steps=(2, 4)):
    """Train and save ``steps`` into the bucket; returns the model weights at each step."""
    run = tiny_run(seed=3)
    weights = {}
    with CheckpointManager(bucket.url(), keep_last=5, every_steps=2, storage_options=bucket.options) as mgr:
        for step in steps:
            run.train(until_step=step)
            mgr.save(run.model, run.optimizer, run.scheduler, run.state)
            weights[step] = {k: v.clone() for k, v in run.model.state_dict().items()}
    return weights


def _part_path(bucket, step, name="checkpoint.pt"):
    store = FsspecStorage(bucket.url(), bucket.options)
    marker, _ = read_commit(store, step)
    return f"{bucket.name}/run/step-{step:08d}/{marker['save_id']}/{name}"


def _restore(tiny_run, bucket):
    fresh = tiny_run(seed=50)
    with CheckpointManager(bucket.url(), every_steps=2, storage_options=bucket.options) as mgr:
        state = mgr.restore_latest(fresh.model, fresh.optimizer, fresh.scheduler)
        skipped = mgr.last_restore["skipped"]
    return fresh, state, skipped


def _same(model, weights):
    return all(torch.equal(v, weights[k]) for k, v in model.state_dict().items())


def test_a_flipped_byte_in_an_object_falls_back_to_the_previous_committed_save(tiny_run, s3_bucket):
    weights = _saved_run(tiny_run, s3_bucket)
    fs, path = s3_bucket.fs(), _part_path(s3_bucket, 4)
    data = bytearray(fs.cat_file(path))
    data[len(data) // 2] ^= 0x01
    fs.pipe_file(path, bytes(data))
    fresh, state, skipped = _restore(tiny_run, s3_bucket)
    assert state.step == 2 and _same(fresh.model, weights[2])
    assert [(s["step"], s["status"]) for s in skipped] == [(4, "corrupt")]
    assert "do not match the manifest" in skipped[0]["reason"]


def test_a_missing_part_is_incomplete_and_falls_back(tiny_run, s3_bucket):
    weights = _saved_run(tiny_run, s3_bucket)
    s3_bucket.fs().rm(_part_path(s3_bucket, 4))
    fresh, state, skipped = _restore(tiny_run, s3_bucket)
    assert state.step == 2 and _same(fresh.model, weights[2])
    assert [(s["step"], s["status"]) for s in skipped] == [(4, "incomplete")]


def test_a_stale_marker_copied_from_an_older_step_is_refused(tiny_run, s3_bucket):
    weights = _saved_run(tiny_run, s3_bucket)
    fs = s3_bucket.fs()
    fs.copy(f"{s3_bucket.name}/run/step-00000002/COMMIT", f"{s3_bucket.name}/run/step-00000006/COMMIT")
    fresh, state, skipped = _restore(tiny_run, s3_bucket)
    assert state.step == 4 and _same(fresh.model, weights[4])
    assert skipped[0]["step"] == 6 and "names step 2" in skipped[0]["reason"]


class _RetentionDuringRestore(FsspecStorage):
    """The real store, plus one real deletion of step 4 (as another writer's retention would)
    issued right after the restore has started downloading step 4's first part."""

    def iter_chunks(self, key, **kwargs):
        if key.startswith("step-00000004/") and not getattr(self, "_done", False):
            self._done = True
            delete_store_save(self, 4)
        yield from super().iter_chunks(key, **kwargs)


def test_a_deletion_during_a_restore_falls_back_to_the_previous_save(tiny_run, s3_bucket):
    weights = _saved_run(tiny_run, s3_bucket)
    fresh = tiny_run(seed=50)
    with CheckpointManager(s3_bucket.url(), every_steps=2, storage_options=s3_bucket.options) as mgr:
        mgr.store.storage = _RetentionDuringRestore(s3_bucket.url(), s3_bucket.options)
        state = mgr.restore_latest(fresh.model, fresh.optimizer, fresh.scheduler)
        assert [(s["step"], s["status"]) for s in mgr.last_restore["skipped"]] == [(4, "incomplete")]
    assert state.step == 2 and _same(fresh.model, weights[2])


def test_fetch_verified_removes_its_local_copy_when_a_part_is_missing(tiny_run, s3_bucket, tmp_path):
    _saved_run(tiny_run, s3_bucket, steps=(2,))
    s3_bucket.fs().rm(_part_path(s3_bucket, 2))
    with pytest.raises(IncompleteCheckpointError, match="step-00000002"):
        fetch_verified(FsspecStorage(s3_bucket.url(), s3_bucket.options), 2, tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_when_every_committed_save_is_damaged_the_restore_lists_each_reason(tiny_run, s3_bucket):
    _saved_run(tiny_run, s3_bucket)
    fs = s3_bucket.fs()
    for step in (2, 4):
        fs.rm(_part_path(s3_bucket, step))
    with pytest.raises(CheckpointError, match=r"2 committed save\(s\) found but none is usable"):
        _restore(tiny_run, s3_bucket)


def test_a_damaged_committed_save_does_not_block_saving_its_step_again(tiny_run, s3_bucket):
    _saved_run(tiny_run, s3_bucket)
    fs, path = s3_bucket.fs(), _part_path(s3_bucket, 4)
    data = bytearray(fs.cat_file(path))
    data[len(data) // 2] ^= 0x01
    fs.pipe_file(path, bytes(data))
    fresh, state, _ = _restore(tiny_run, s3_bucket)
    assert state.step == 2
    fresh.train(until_step=4)
    events = []
    with CheckpointManager(
        s3_bucket.url(),
        every_steps=2,
        storage_options=s3_bucket.options,
        on_event=lambda n, i: events.append(n),
    ) as mgr:
        # The damaged step-4 save's marker is removed (it fails verification), and this save commits.
        mgr.save(fresh.model, fresh.optimizer, fresh.scheduler, fresh.state)
        assert "quarantined" in events and mgr.latest_step() == 4
    again, state, skipped = _restore(tiny_run, s3_bucket)
    assert state.step == 4 and skipped == [] and _same(again.model, fresh.model.state_dict())


def test_a_whole_committed_save_still_refuses_a_second_writer_of_its_step(tiny_run, s3_bucket):
    from ckpt_lesson.runs.store_commit import CommitConflictError

    _saved_run(tiny_run, s3_bucket)
    other = tiny_run(seed=8)
    other.train(until_step=4)
    with CheckpointManager(s3_bucket.url(), every_steps=2, storage_options=s3_bucket.options) as mgr:
        with pytest.raises(CommitConflictError, match="already committed"):
            mgr.save(other.model, other.optimizer, other.scheduler, other.state)


def test_a_flipped_byte_falls_back_through_the_state_api_too_and_the_restore_reports_it(s3_bucket):
    url = s3_bucket.url("state-flip")
    model = torch.nn.Linear(3, 3)
    with CheckpointManager(url, keep_last=5, every_steps=1, storage_options=s3_bucket.options) as mgr:
        for step in (1, 2):
            with torch.no_grad():
                model.weight.fill_(float(step))
            mgr.save(step, {"model": model, "step_seen": step})
        marker, _ = read_commit(mgr.storage, 2)
    fs, path = s3_bucket.fs(), f"{s3_bucket.name}/state-flip/step-00000002/{marker['save_id']}/checkpoint.pt"
    data = bytearray(fs.cat_file(path))
    data[len(data) // 3] ^= 0x01
    fs.pipe_file(path, bytes(data))
    fresh = torch.nn.Linear(3, 3)
    with CheckpointManager(url, every_steps=1, storage_options=s3_bucket.options) as mgr:
        restored = mgr.restore_latest({"model": fresh, "step_seen": None})
    assert restored.step == 1 and restored.values["step_seen"] == 1
    assert torch.equal(fresh.weight, torch.ones(3, 3))
    assert [(s["step"], s["status"]) for s in restored.skipped] == [(2, "corrupt")]
    assert path.split("/", 1)[1] in restored.skipped[0]["reason"]  # the damaged object is named
