"""CheckpointManager on an object store: a real S3 API (moto server), s3fs over HTTP."""

from __future__ import annotations

import pytest
import torch

from ckpt_lesson.errors import CheckpointError, LoadEnvironmentError
from ckpt_lesson.files.checkpoint import TrainState
from ckpt_lesson.runs.manager import CheckpointManager
from ckpt_lesson.runs.store_manager import StoreCheckpointManager


def _save_steps(run, mgr, steps):
    for step in steps:
        run.train(until_step=step)
        mgr.save(run.model, run.optimizer, run.scheduler, run.state)


def test_a_url_builds_a_store_manager_that_saves_and_restores_bit_for_bit(tiny_run, s3_bucket):
    run = tiny_run(seed=1)
    with CheckpointManager(s3_bucket.url(), keep_last=2, every_steps=2, storage_options=s3_bucket.options) as mgr:
        assert isinstance(mgr, StoreCheckpointManager)
        _save_steps(run, mgr, [2, 4, 6])
        assert mgr.all_steps() == [4, 6]
        assert mgr.latest_step() == 6
    fresh = tiny_run(seed=99)
    with CheckpointManager(s3_bucket.url(), storage_options=s3_bucket.options, every_steps=2) as mgr:
        state = mgr.restore_latest(fresh.model, fresh.optimizer, fresh.scheduler)
        assert mgr.last_restore["path"] == s3_bucket.url() + "/step-00000006"
    assert isinstance(state, TrainState) and state.step == 6
    for a, b in zip(run.model.state_dict().values(), fresh.model.state_dict().values(), strict=True):
        assert torch.equal(a, b)


def test_an_empty_prefix_restores_nothing_and_a_missing_bucket_names_the_bucket(tiny_run, s3_bucket):
    run = tiny_run(seed=1)
    with CheckpointManager(s3_bucket.url("empty"), storage_options=s3_bucket.options, every_steps=2) as mgr:
        assert mgr.restore_latest(run.model, run.optimizer, run.scheduler) is None
    with pytest.raises(LoadEnvironmentError, match="no-such-bucket-23"):
        CheckpointManager("s3://no-such-bucket-23/run", storage_options=s3_bucket.options, every_steps=2)
