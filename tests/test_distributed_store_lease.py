"""The LEASE of a multi-rank save on an object store: renewed while it uploads, honoured by cleaners.

Two gloo ranks save to moto's S3 server through the real stack (DCP's fsspec
writer, s3fs over HTTP). Rank 0's multipart upload is held after its first part
(see :func:`_store_lease_workers.hold_uploads`), which makes the save as long as
the test wants: longer than the lease, or until the test SIGKILLs the job.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from _distributed_workers import launch
from _s3_server import Bucket
from _store_lease_workers import w_replacement, w_slow_save, w_victim

from ckpt_lesson import CheckpointError
from ckpt_lesson.files.storage_fsspec import FsspecStorage
from ckpt_lesson.runs.store_commit import clean_uncommitted
from ckpt_lesson.runs.store_lease import LeaseRenewer

#: Short, so the tests wait seconds for a lease to run out; renewed every third of it.
LEASE = 3.0


def _options(bucket: Bucket) -> dict[str, Any]:
    # s3fs's smallest write block: the ranks' 6 MiB objects go up as multipart uploads.
    return {**bucket.options, "default_block_size": 5 << 20}


def _in_background(job: Callable[[], list[int]]) -> tuple[threading.Thread, list[list[int]]]:
    codes: list[list[int]] = []
    thread = threading.Thread(target=lambda: codes.append(job()))
    thread.start()
    return thread, codes


def _wait_for(ready: Callable[[], bool], job: threading.Thread, what: str) -> None:
    deadline = time.monotonic() + 120
    while not ready() and job.is_alive() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert ready(), f"the job never reached this point: {what}"


def _attempts(store: FsspecStorage, step_dir: str) -> dict[str, list[str]]:
    """``{save_id: [names]}`` of every upload under one step (the marker is left out)."""
    found: dict[str, list[str]] = {}
    for key in store.list_keys(step_dir):
        parts = key.split("/")
        if len(parts) == 3:
            found.setdefault(parts[1], []).append(parts[2])
    return {k: sorted(v) for k, v in found.items()}


def _unfinished_uploads(bucket: Bucket, step_dir: str) -> list[str]:
    listed = bucket.fs().call_s3("list_multipart_uploads", Bucket=bucket.name, Prefix=f"run/{step_dir}/")
    return sorted(up["Key"] for up in listed.get("Uploads", []))


def _lease(store: FsspecStorage, step_dir: str, save_id: str) -> dict[str, Any]:
    return json.loads(store.read_bytes(f"{step_dir}/{save_id}/LEASE", limit=1 << 16))


def _reports(out: Path, name: str) -> list[dict[str, Any]]:
    return [json.loads((out / f"{name}-rank{rank}.json").read_text()) for rank in (0, 1)]


def test_a_save_held_longer_than_its_lease_is_renewed_so_a_concurrent_cleaner_leaves_it_and_it_commits(
    s3_bucket: Bucket, tmp_path: Path
) -> None:
    url, options = s3_bucket.url(), _options(s3_bucket)
    store = FsspecStorage(url, options)
    job, codes = _in_background(lambda: launch(w_slow_save, 2, tmp_path, url, options, str(tmp_path), LEASE))
    try:
        _wait_for(lambda: (tmp_path / "holding-rank0").exists(), job, "rank 0's upload held")
        held = time.time()  # every LEASE written before this moment has run out by held + LEASE
        [save_id] = _attempts(store, "step-00000002")
        removed: list[str] = []
        while time.time() < held + LEASE + 1:  # a cleaner (another job opening the run) keeps sweeping
            removed += clean_uncommitted(store)
            time.sleep(0.2)
        left = _attempts(store, "step-00000002").get(save_id, [])
        lease = _lease(store, "step-00000002", save_id) if "LEASE" in left else {}
        uploads = _unfinished_uploads(s3_bucket, "step-00000002")
    finally:
        (tmp_path / "go").touch()
        job.join(timeout=120)

    assert removed == []
    assert lease.get("expires_at", 0) > held + LEASE  # written after the hold began: rank 0 renewed it
    assert uploads == [f"run/step-00000002/{save_id}/__0_0.distcp"]  # the held upload was left running
    assert codes == [[0, 0]]
    for report in _reports(tmp_path, "slow"):
        assert report["error"] is None
        assert report["saved"] == f"{url}/step-00000002"
        restored = report["restored"]
        assert restored["step"] == 2
        assert (restored["state"], restored["blob"]) == (report["want"]["state"], report["want"]["blob"])
    marker = json.loads(store.read_bytes("step-00000002/COMMIT", limit=1 << 16))
    assert marker["save_id"] == save_id
    # Committed: the LEASE is gone and no renewal brought it back.
    assert _attempts(store, "step-00000002") == {
        save_id: [".metadata", "__0_0.distcp", "__1_0.distcp", "manifest.json"]
    }
    assert _unfinished_uploads(s3_bucket, "step-00000002") == []


def test_a_writer_killed_mid_upload_leaves_no_marker_and_its_replacement_restores_cleans_and_commits_the_step(
    s3_bucket: Bucket, tmp_path: Path
) -> None:
    url, options = s3_bucket.url(), _options(s3_bucket)
    store = FsspecStorage(url, options)
    first, second = tmp_path / "victim", tmp_path / "replacement"
    first.mkdir()
    second.mkdir()
    job, codes = _in_background(lambda: launch(w_victim, 2, first, url, options, str(first), LEASE))

    def mid_upload() -> bool:  # rank 1's object is up, rank 0's multipart upload is half done
        if not (first / "holding-rank0").exists():
            return False
        return any("__1_0.distcp" in names for names in _attempts(store, "step-00000004").values())

    _wait_for(mid_upload, job, "step 4 half uploaded")
    for rank in (0, 1):  # the whole job dies at once, as when its machine is lost
        os.kill(int((first / f"pid-rank{rank}").read_text()), signal.SIGKILL)
    job.join(timeout=60)
    assert codes == [[-9, -9]]

    assert "step-00000004/COMMIT" not in store.list_keys("step-00000004")
    [(dead, names)] = _attempts(store, "step-00000004").items()
    assert "LEASE" in names and "__1_0.distcp" in names and "manifest.json" not in names
    assert _unfinished_uploads(s3_bucket, "step-00000004") == [f"run/step-00000004/{dead}/__0_0.distcp"]
    expires = _lease(store, "step-00000004", dead)["expires_at"]
    assert clean_uncommitted(store, now=expires - 0.5) == []  # before it expires, nobody may clean it
    assert list(_attempts(store, "step-00000004")) == [dead]
    while time.time() <= expires:  # the replacement machine comes up after the lease ran out
        time.sleep(0.1)

    assert launch(w_replacement, 2, second, url, options, str(second), LEASE) == [0, 0]
    for rank, report in enumerate(_reports(second, "replacement")):
        want = json.loads((first / f"victim-rank{rank}.json").read_text())
        assert report["error"] is None
        assert report["restored"]["step"] == 2  # the previous committed save, bit for bit
        assert (report["restored"]["state"], report["restored"]["blob"]) == (want["state"], want["blob"])
        assert report["saved"] == f"{url}/step-00000004"
    marker = json.loads(store.read_bytes("step-00000004/COMMIT", limit=1 << 16))
    assert list(_attempts(store, "step-00000004")) == [marker["save_id"]] != [dead]
    assert _unfinished_uploads(s3_bucket, "step-00000004") == []
    assert not list(first.glob("victim-survived-*"))


def test_a_stopped_renewer_never_brings_its_lease_back_and_an_expired_lease_refuses_the_commit(
    s3_bucket: Bucket,
) -> None:
    store = FsspecStorage(s3_bucket.url(), s3_bucket.options)
    lease = LeaseRenewer(store, "step-00000002/abc123", 0.3)  # renewed every 0.1 s
    first = lease.expires_at
    while lease.expires_at == first:  # at least one renewal landed
        time.sleep(0.02)
    lease.stop()
    lease.stop()  # idempotent: the writer stops it before COMMIT, the manager again at the end
    last = lease.expires_at
    store.delete(["step-00000002/abc123/LEASE"])  # what commit_attempt does next
    while time.time() <= last + 0.3:  # three renewal periods, and past the lease
        time.sleep(0.05)
    assert store.list_keys("step-00000002") == []
    with pytest.raises(CheckpointError, match=r"step-00000002/abc123: the LEASE of this save expired"):
        lease.check()
