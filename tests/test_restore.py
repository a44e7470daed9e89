"""A restore follows the run: when the save it reads vanishes, it lists the saves again and takes the newest.

Issue 31, why-item 3: an eval job restoring from a run that a trainer keeps
saving (``keep_last=1``) fell back only to *older* saves. When the trainer's
retention deleted the save being read, right after committing a newer one,
the restore reported that no save was usable. Both storages are tested with
the real components: a folder with a second manager in the same process, and
moto's S3 server with botocore's own ``before-send`` event holding the eval
job's download while the trainer moves on.
"""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import torch
from _s3_server import Bucket
from conftest import TinyRun, build_tiny_run

from ckpt_lesson.runs.manager import CheckpointManager
from ckpt_lesson.runs.report import RecoveryRecorder, read_recovery_log


def _same_weights(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    pairs = zip(a.state_dict().values(), b.state_dict().values(), strict=True)
    return all(torch.equal(x, y) for x, y in pairs)


def _save(mgr: CheckpointManager, run: TinyRun, step: int) -> None:
    run.train(until_step=step)
    mgr.save(run.model, run.optimizer, run.scheduler, run.state)


def _check_followed(mgr: CheckpointManager, state, trainer: TinyRun, fresh: TinyRun) -> None:
    assert state.step == 6 and _same_weights(fresh.model, trainer.model)
    [skipped] = mgr.last_restore["skipped"]
    assert skipped["step"] == 4 and skipped["relisted"] == [6]
    assert "newer step(s) [6] appeared" in skipped["reason"]


def test_a_folder_restore_whose_save_is_deleted_meanwhile_takes_the_newer_save(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    trainer_run = build_tiny_run(seed=6)
    trainer = CheckpointManager(run_dir, keep_last=1, every_steps=2, background_retention=False)
    for step in (2, 4):
        _save(trainer, trainer_run, step)

    def trainer_moves_on(name: str, info: dict) -> None:
        # The eval job has read step 4's manifest; now the trainer saves step 6 and deletes step 4.
        if name == "resume_contract" and info["step"] == 4:
            _save(trainer, trainer_run, 6)

    fresh = build_tiny_run(seed=99)
    with CheckpointManager(run_dir, every_steps=2, on_event=trainer_moves_on) as eval_job:
        state = eval_job.restore_latest(fresh.model, fresh.optimizer, fresh.scheduler)
        recorder = RecoveryRecorder(run_dir)
        recorder.restored(eval_job.last_restore)
        recorder.step_done(state.step + 1)
    trainer.close()
    _check_followed(eval_job, state, trainer_run, fresh)
    [record] = read_recovery_log(run_dir)
    assert record["chosen"]["step"] == 6
    assert record["skipped"][0]["relisted"] == [6] and "newer step(s) [6]" in record["skipped"][0]["reason"]


def test_a_bucket_restore_whose_save_is_deleted_meanwhile_takes_the_newer_save(
    s3_bucket: Bucket, tmp_path: Path
) -> None:
    url, options = s3_bucket.url(), s3_bucket.options
    trainer_run = build_tiny_run(seed=6)
    trainer = CheckpointManager(url, keep_last=1, every_steps=2, storage_options=options)
    for step in (2, 4):
        _save(trainer, trainer_run, step)
    go, done = threading.Event(), threading.Event()

    def trainer_loop() -> None:
        go.wait(timeout=120)
        try:
            _save(trainer, trainer_run, 6)  # commits step 6, then retention deletes step 4
        finally:
            done.set()

    async def hold_the_download(request, **_):  # the eval job's GET of step 4's part waits for the trainer
        if "/step-00000004/" in request.url and request.url.endswith("/checkpoint.pt") and not go.is_set():
            go.set()
            while not done.is_set():
                await asyncio.sleep(0.05)

    fresh = build_tiny_run(seed=99)
    thread = threading.Thread(target=trainer_loop)
    thread.start()
    try:
        with CheckpointManager(url, every_steps=2, storage_options=options) as eval_job:
            eval_job.storage.fs.s3.meta.events.register("before-send.s3.GetObject", hold_the_download)
            try:
                state = eval_job.restore_latest(fresh.model, fresh.optimizer, fresh.scheduler)
            finally:
                eval_job.storage.fs.s3.meta.events.unregister("before-send.s3.GetObject", hold_the_download)
            (tmp_path / "eval").mkdir()
            recorder = RecoveryRecorder(tmp_path / "eval", store=url, storage_options=options)
            recorder.restored(eval_job.last_restore)
            recorder.step_done(state.step + 1)
    finally:
        go.set()
        thread.join(timeout=120)
        trainer.close()
    assert go.is_set() and done.is_set()
    _check_followed(eval_job, state, trainer_run, fresh)
    [record] = read_recovery_log(url, options)
    assert record["chosen"]["step"] == 6 and record["skipped"][0]["relisted"] == [6]
