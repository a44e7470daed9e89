"""The object-store backend of DistributedCheckpointManager: 2 gloo ranks against a real S3 API (moto server).

One launch of 2 ranks trains an FSDP2 run and saves steps 2, 4 (asynchronously)
and 6 (state API) to a bucket, restoring 4 and 6 into fresh objects; the first
checks read what it recorded and what it left in the bucket. The LEASE of a
save is tested with rank 0's multipart upload held after its first part (see
:func:`_store_lease_workers.hold_uploads`), which makes the save as long as the
test wants: longer than the lease, or until the test SIGKILLs the job. Nothing
is mocked: s3fs speaks HTTP to moto, DCP's fsspec writer and reader do the I/O.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from _distributed_workers import launch, make_run, train_step
from _s3_server import Bucket, options_for, read_only_options
from _store_dcp_workers import w_open, w_restore, w_save_and_restore, w_zombie
from _store_lease_workers import w_replacement, w_slow_save, w_victim

from ckpt_lesson import CheckpointError
from ckpt_lesson.distributed import DistributedCheckpointManager
from ckpt_lesson.errors import LoadEnvironmentError
from ckpt_lesson.files.storage_fsspec import FsspecStorage
from ckpt_lesson.runs.store_commit import clean_uncommitted
from ckpt_lesson.runs.store_lease import LeaseRenewer

#: Short, so the lease tests wait seconds for a lease to run out; renewed every third of it.
LEASE = 3.0


@pytest.fixture(scope="module")
def stored(s3_endpoint: str, tmp_path_factory: pytest.TempPathFactory) -> tuple[Bucket, Path]:
    bucket = Bucket(f"t-{uuid.uuid4().hex[:20]}", s3_endpoint, options_for(s3_endpoint))
    bucket.fs().call_s3("create_bucket", Bucket=bucket.name)
    out = tmp_path_factory.mktemp("dcp_store")
    assert launch(w_save_and_restore, 2, out, bucket.url(), bucket.options, str(out), limit=240) == [0, 0]
    return bucket, out


def _reports(out: Path, name: str) -> list[dict[str, Any]]:
    return [json.loads((out / f"{name}-rank{rank}.json").read_text()) for rank in (0, 1)]


def _attempt_files(store: FsspecStorage, step_dir: str) -> dict[str, list[str]]:
    """``{save_id or "": [names]}`` of every object under one step."""
    found: dict[str, list[str]] = {}
    for key in store.list_keys(step_dir):
        parts = key.split("/")
        found.setdefault(parts[1] if len(parts) == 3 else "", []).append(parts[-1])
    return {k: sorted(v) for k, v in found.items()}


def _attempts(store: FsspecStorage, step_dir: str) -> dict[str, list[str]]:
    """``{save_id: [names]}`` of every upload under one step (the marker is left out)."""
    return {k: v for k, v in _attempt_files(store, step_dir).items() if k}


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


def _unfinished_uploads(bucket: Bucket, step_dir: str) -> list[str]:
    listed = bucket.fs().call_s3("list_multipart_uploads", Bucket=bucket.name, Prefix=f"run/{step_dir}/")
    return sorted(up["Key"] for up in listed.get("Uploads", []))


def _lease(store: FsspecStorage, step_dir: str, save_id: str) -> dict[str, Any]:
    return json.loads(store.read_bytes(f"{step_dir}/{save_id}/LEASE", limit=1 << 16))


def test_two_ranks_save_to_a_bucket_and_restore_bit_for_bit_in_both_api_forms(
    stored: tuple[Bucket, Path],
) -> None:
    bucket, out = stored
    for rank, report in enumerate(_reports(out, "round")):
        assert report["first"] == f"{bucket.url()}/step-00000002"
        assert (report["step"], report["batches"]) == (4, 4)  # the asynchronous save, this rank's data
        assert report["path"] == f"{bucket.url()}/step-00000004"
        assert report["differences"] == []
        assert "file_written" in report["events"]  # every rank uploads its own files
        assert ("published" in report["events"]) is (rank == 0)  # the commit is rank 0's
        api = report["state_api"]
        assert (api["step"], api["note"], api["differences"], api["scheduler"]) == (
            6,
            {"rank": rank},
            [],
            True,
        )
        assert report["saved6"] == f"{bucket.url()}/step-00000006"
    assert _reports(out, "round")[0]["tensors"] > 10  # weights, biases, both AdamW moments, step counters
    store = FsspecStorage(bucket.url(), bucket.options)
    layout = _attempt_files(store, "step-00000006")
    [(save_id, names)] = [(k, v) for k, v in layout.items() if k]
    assert layout[""] == ["COMMIT"]  # written last; the LEASE went after it, no .metadata.tmp is left
    assert names == [".metadata", "__0_0.distcp", "__1_0.distcp", "manifest.json"]
    marker = json.loads(store.read_bytes("step-00000006/COMMIT", limit=1 << 16))
    assert (marker["step"], marker["save_id"]) == (6, save_id)


def test_a_flipped_byte_falls_back_on_both_ranks_and_a_step_without_its_marker_is_never_seen(
    stored: tuple[Bucket, Path], tmp_path: Path
) -> None:
    bucket, _ = stored
    store = FsspecStorage(bucket.url(), bucket.options)
    [save_id] = [k for k in _attempt_files(store, "step-00000006") if k]
    victim = f"step-00000006/{save_id}/__1_0.distcp"  # rank 1 hashes this one; rank 0 must agree anyway
    data = bytearray(store.read_bytes(victim, limit=1 << 30))
    data[len(data) // 2] ^= 0x01
    store.put_bytes(victim, bytes(data))
    store.delete(["step-00000004/COMMIT"])  # the state a kill between manifest and marker leaves
    assert launch(w_restore, 2, tmp_path, bucket.url(), bucket.options, str(tmp_path), "fallback") == [0, 0]
    for report in _reports(tmp_path, "fallback"):
        assert report["error"] is None
        assert report["step"] == 2
        assert report["committed"] == [2, 6]
        [skipped] = report["skipped"]  # step 4 is not even a candidate
        assert (skipped["step"], skipped["status"]) == (6, "corrupt")
        assert "__1_0.distcp" in skipped["reason"]


def test_a_zombie_writer_stalled_before_its_marker_is_refused_on_both_ranks_and_its_upload_removed(
    s3_bucket: Bucket, tmp_path: Path
) -> None:
    url, options = s3_bucket.url(), s3_bucket.options
    codes: list[list[int]] = []
    zombie = threading.Thread(
        target=lambda: codes.append(launch(w_zombie, 2, tmp_path, url, options, str(tmp_path)))
    )
    zombie.start()
    deadline = time.monotonic() + 180
    while not (tmp_path / "paused").exists() and zombie.is_alive() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert (tmp_path / "paused").exists(), "the zombie never reached its marker"
    # Its replacement (one process here) commits the same step while the zombie is stalled.
    model, opt, sched, sampler = make_run("plain", 1, 0)
    for _ in range(2):  # not the zombie's weights (it trained one step)
        train_step(model, opt, sched, sampler)
    with DistributedCheckpointManager(url, storage_options=options, keep_last=5, every_steps=2) as mgr:
        mgr.save(8, {"model": model, "optimizer": opt})
    (tmp_path / "go").touch()
    zombie.join(timeout=240)
    assert codes == [[0, 0]]
    for report in _reports(tmp_path, "zombie"):
        assert report["error"]["type"] == "CommitConflictError"
        assert "already committed by another writer" in report["error"]["message"]
    store = FsspecStorage(url, options)
    fresh, fresh_opt, _, _ = make_run("plain", 1, 0)
    with DistributedCheckpointManager(url, storage_options=options, every_steps=2) as mgr:
        restored = mgr.restore_latest({"model": fresh, "optimizer": fresh_opt})
    assert restored.step == 8
    # The marker and one upload, the replacement's; the zombie deleted its own.
    assert sorted(_attempt_files(store, "step-00000008")) == ["", restored.save_id]
    for a, b in zip(model.state_dict().values(), fresh.state_dict().values(), strict=True):
        assert torch.equal(a, b)


def test_publish_by_rename_is_refused_for_a_url(s3_bucket: Bucket) -> None:
    options = s3_bucket.options
    with pytest.raises(CheckpointError, match=r"publish='rename' needs a POSIX file system"):
        DistributedCheckpointManager(run_dir=s3_bucket.url(), storage_options=options, publish="rename")


def test_a_missing_bucket_is_a_load_environment_error_naming_it(s3_bucket: Bucket) -> None:
    with pytest.raises(LoadEnvironmentError, match="no-such-bucket-23"):
        DistributedCheckpointManager(
            "s3://no-such-bucket-23/run", storage_options=s3_bucket.options, every_steps=2
        )


def test_wrong_credentials_are_the_same_load_environment_error_on_both_ranks_naming_the_bucket(
    s3_bucket: Bucket, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import moto.settings

    # moto checks signatures only when asked to; then an unknown access key is refused like on S3.
    monkeypatch.setattr(moto.settings, "INITIAL_NO_AUTH_ACTION_COUNT", 0)
    bad = options_for(s3_bucket.endpoint, key="AKIAWRONGWRONGWRONG0", secret="wrong")
    assert launch(w_open, 2, tmp_path, s3_bucket.url(), bad, str(tmp_path)) == [0, 0]
    for report in _reports(tmp_path, "open"):
        assert report["error"]["type"] == "LoadEnvironmentError"  # rank 1 gets rank 0's error, type and all
        assert f"bucket '{s3_bucket.name}'" in report["error"]["message"]
        assert "damaged" not in report["error"]["message"]


def test_a_url_without_the_s3_extra_is_one_line_naming_the_extra() -> None:
    code = (
        "import sys; sys.modules['s3fs'] = None\n"
        "from ckpt_lesson.distributed import DistributedCheckpointManager\n"
        "DistributedCheckpointManager('s3://bucket/run', every_steps=1)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    last = done.stderr.strip().splitlines()[-1]
    assert done.returncode != 0 and "pip install ckpt_lesson[s3]" in last
    assert last.startswith("ckpt_lesson.errors.CheckpointError: s3://bucket/run:")


def test_retention_on_the_store_keeps_the_newest_and_leaves_nothing_of_a_dropped_save(
    s3_bucket: Bucket,
) -> None:
    # One process (a world of one) is enough here: retention runs on rank 0 alone, after the commit.
    events: list[tuple[str, Any]] = []
    model, opt, sched, sampler = make_run("plain", 1, 0)
    mgr = DistributedCheckpointManager(
        s3_bucket.url(),
        storage_options=s3_bucket.options,
        keep_last=2,
        every_steps=2,
        on_event=lambda name, info: events.append((name, info.get("step"))),
    )
    with mgr:
        for step in (2, 4, 6):
            train_step(model, opt, sched, sampler)
            mgr.save(step, {"model": model, "optimizer": opt})
    store = FsspecStorage(s3_bucket.url(), s3_bucket.options)
    assert [k.split("/")[0] for k in store.list_keys() if k.endswith("/COMMIT")] == [
        "step-00000004",
        "step-00000006",
    ]
    assert store.list_keys("step-00000002") == []
    assert ("retention_delete", 2) in events


def test_read_only_credentials_restore_a_multi_rank_run_and_write_nothing(
    s3_bucket: Bucket, monkeypatch: pytest.MonkeyPatch
) -> None:
    import moto.settings

    # One process is enough: opening, probing and cleaning are rank 0's; the restore is every rank's.
    model, opt, sched, sampler = make_run("plain", 1, 0)
    with DistributedCheckpointManager(
        s3_bucket.url(), storage_options=s3_bucket.options, every_steps=2
    ) as mgr:
        train_step(model, opt, sched, sampler)
        mgr.save(2, {"model": model, "optimizer": opt})
    dead = "run/step-00000004/" + "d" * 32 + "/__0_0.distcp"  # no LEASE: any cleanup would delete it
    s3_bucket.fs().call_s3("put_object", Bucket=s3_bucket.name, Key=dead, Body=b"partial")
    reader = read_only_options(s3_bucket)

    def objects() -> set[tuple[str, str]]:
        listed = s3_bucket.fs().call_s3("list_objects_v2", Bucket=s3_bucket.name).get("Contents", [])
        return {(o["Key"], o["ETag"]) for o in listed}

    before = objects()
    monkeypatch.setattr(moto.settings, "INITIAL_NO_AUTH_ACTION_COUNT", 0)  # IAM policies enforced from here
    fresh, fresh_opt, _, _ = make_run("plain", 1, 0)
    with DistributedCheckpointManager(s3_bucket.url(), storage_options=reader, every_steps=2) as mgr:
        assert mgr.restore_latest({"model": fresh, "optimizer": fresh_opt}).step == 2
    monkeypatch.setattr(moto.settings, "INITIAL_NO_AUTH_ACTION_COUNT", float("inf"))
    assert objects() == before
    for a, b in zip(model.state_dict().values(), fresh.state_dict().values(), strict=True):
        assert torch.equal(a, b)


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


def test_a_url_gives_the_one_manager_the_store_backend_and_a_folder_the_folder_backend(
    s3_bucket: Bucket, tmp_path: Path
) -> None:
    from ckpt_lesson.distributed.saving import FolderSaves
    from ckpt_lesson.distributed.store_saves import StoreSaves

    on_bucket = DistributedCheckpointManager(
        s3_bucket.url(), storage_options=s3_bucket.options, every_steps=1
    )
    in_folder = DistributedCheckpointManager(tmp_path / "run", every_steps=1)
    try:
        assert isinstance(on_bucket.saves, StoreSaves) and on_bucket.publish == "marker"
        assert isinstance(in_folder.saves, FolderSaves) and in_folder.publish == "rename"
        assert on_bucket.step_dir(4) == f"{s3_bucket.url()}/step-00000004"
        assert in_folder.step_dir(4) == tmp_path / "run" / "step-00000004"
    finally:
        on_bucket.close()
        in_folder.close()


def test_a_restore_takes_the_newer_save_when_the_trainers_retention_deletes_the_one_it_reads(
    s3_bucket: Bucket, monkeypatch: pytest.MonkeyPatch
) -> None:
    from ckpt_lesson.distributed.store_saves import StoreSaves

    # One process is enough: the listing is rank 0's, and the restore's relisting is what is tested.
    model, opt, sched, sampler = make_run("plain", 1, 0)
    url, options = s3_bucket.url(), s3_bucket.options
    trainer = DistributedCheckpointManager(url, storage_options=options, keep_last=1, every_steps=2)
    for step in (2, 4):
        train_step(model, opt, sched, sampler)
        trainer.save(step, {"model": model, "optimizer": opt})
    real = StoreSaves.source

    def trainer_moves_on(saves: StoreSaves, step: int) -> Any:
        if step == 4 and 6 not in trainer.saves.published():
            # While the eval job reads step 4, the trainer commits 6 and its keep_last=1 deletes 4.
            train_step(model, opt, sched, sampler)
            trainer.save(6, {"model": model, "optimizer": opt})
        return real(saves, step)

    monkeypatch.setattr(StoreSaves, "source", trainer_moves_on)
    fresh, fresh_opt, _, _ = make_run("plain", 1, 0)
    with DistributedCheckpointManager(url, storage_options=options, every_steps=2) as reader:
        restored = reader.restore_latest({"model": fresh, "optimizer": fresh_opt})
    trainer.close()
    assert restored.step == 6
    assert [s["step"] for s in restored.skipped] == [4]
    for a, b in zip(model.state_dict().values(), fresh.state_dict().values(), strict=True):
        assert torch.equal(a, b)
