"""One lease for every store writer: renewed while a part uploads, and dead once it ran out.

Issue 31, why-item 2: a single-process writer stalled past its lease still
committed. Another manager cleaning the run (before issue 33, an eval job calling
``latest_step()`` was enough; now a writer's first save) removed the stalled writer's parts as abandoned;
the writer then woke, uploaded its manifest, created ``COMMIT``, and
retention (``keep_last=1``) deleted the previous good save. The tests run the
real stack: moto's S3 server, s3fs over HTTP, and botocore's own
``before-send`` event to hold a request (nothing of ours is replaced).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch
from _s3_server import Bucket
from conftest import build_tiny_run

from ckpt_lesson.files.storage_fsspec import FsspecStorage
from ckpt_lesson.runs.manager import CheckpointManager
from ckpt_lesson.runs.store_commit import clean_uncommitted, committed_steps

HERE = Path(__file__).resolve().parent


def _wait(ready, what: str, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        assert time.monotonic() < deadline, f"never happened: {what}"
        time.sleep(0.05)


def _stopped(pid: int) -> bool:
    stat = Path(f"/proc/{pid}/stat").read_text()
    return stat.rsplit(")", 1)[1].split()[0] == "T"


def _lease_expiry(store: FsspecStorage, step_dir: str) -> float:
    [key] = [k for k in store.list_keys(step_dir) if k.endswith("/LEASE")]
    return json.loads(store.read_bytes(key, limit=1 << 16))["expires_at"]


def _same_weights(a, b) -> bool:
    return all(
        torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values(), strict=True)
    )


def test_a_writer_stalled_past_its_lease_commits_nothing_and_the_previous_save_survives(
    s3_bucket: Bucket, tmp_path: Path
) -> None:
    lease = 2.0
    url = s3_bucket.url()
    env = {**os.environ, **s3_bucket.env(), "PYTHONPATH": os.getcwd()}
    writer = subprocess.Popen(
        [sys.executable, str(HERE / "_store_stalled_writer.py"), url, str(tmp_path), str(lease)], env=env
    )
    try:
        _wait(lambda: (tmp_path / "stalled").exists() and _stopped(writer.pid), "the writer froze")
        store = FsspecStorage(url, s3_bucket.options)
        uploaded = store.list_keys("step-00000004")
        assert any(k.endswith("model.shard-000.pt") for k in uploaded)  # its parts were up
        expires = _lease_expiry(store, "step-00000004")
        _wait(lambda: time.time() > expires + 0.2, "the frozen writer's lease ran out", timeout=lease + 30)
        # Another job opens the run (a reader writes nothing), then starts writing: before its first
        # save it cleans uploads whose lease ran out, so the frozen upload looks abandoned.
        with CheckpointManager(url, every_steps=2, storage_options=s3_bucket.options) as other:
            assert other.latest_step() == 2
        clean_uncommitted(store)
        assert store.list_keys("step-00000004") == []
    finally:
        writer.send_signal(signal.SIGCONT)
    assert writer.wait(timeout=120) == 0
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["error"] == "CheckpointError"
    assert "LEASE of this save expired" in result["message"] and "not committed" in result["message"]
    assert committed_steps(store) == [2]  # nothing committed; retention deleted nothing
    assert store.list_keys("step-00000004") == []  # the late manifest was removed by its writer
    want = build_tiny_run(seed=4)
    want.train(until_step=2)
    fresh = build_tiny_run(seed=99)
    with CheckpointManager(url, every_steps=2, storage_options=s3_bucket.options) as mgr:
        state = mgr.restore_latest(fresh.model, fresh.optimizer, fresh.scheduler)
    assert state.step == 2 and _same_weights(fresh.model, want.model)


def test_a_part_upload_longer_than_the_lease_is_renewed_so_a_sweeping_cleaner_leaves_it_and_it_commits(
    s3_bucket: Bucket, tmp_path: Path
) -> None:
    lease = 1.5
    run = build_tiny_run(seed=5)
    release, held = threading.Event(), threading.Event()

    async def hold_the_part(request, **_):  # holds one PUT; the event loop (and the renewals) go on
        if request.url.endswith("/checkpoint.pt") and not release.is_set():
            held.set()
            while not release.is_set():
                await asyncio.sleep(0.05)

    mgr = CheckpointManager(
        s3_bucket.url(), every_steps=1, keep_last=1, lease_seconds=lease, storage_options=s3_bucket.options
    )
    store = FsspecStorage(s3_bucket.url(), s3_bucket.options)
    run.train(until_step=1)
    mgr.save(run.model, run.optimizer, run.scheduler, run.state)
    mgr.storage.fs.s3.meta.events.register("before-send.s3.PutObject", hold_the_part)
    run.train(until_step=2)
    errors: list[BaseException] = []

    def save() -> None:
        try:
            mgr.save(run.model, run.optimizer, run.scheduler, run.state)
        except BaseException as exc:  # noqa: BLE001 (reported by the assertion below)
            errors.append(exc)

    saver = threading.Thread(target=save)
    saver.start()
    removed: list[str] = []
    try:
        _wait(held.is_set, "the part upload was held")
        start = time.time()
        while time.time() < start + 2.5 * lease:  # a cleaner keeps sweeping while the part is held
            removed += clean_uncommitted(store)
            time.sleep(0.1)
        renewed_to = _lease_expiry(store, "step-00000002")
    finally:
        release.set()
        saver.join(timeout=120)
        mgr.close()
    assert errors == [] and removed == []
    assert renewed_to > start + lease  # written while the part was held: renewed during the upload
    assert committed_steps(store) == [2]
    assert [k for k in store.list_keys("step-00000002") if k.endswith("/LEASE")] == []  # none came back
