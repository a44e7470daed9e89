"""``scan`` and ``report`` of a bucket that holds multi-rank saves (2 gloo ranks against the moto server).

One launch of 2 ranks saves steps 2 and 4 to a bucket with
``DistributedCheckpointManager``, then restores in a second manager and trains
one step. The tests read that bucket through the same functions and commands
a user runs (``scan URL``, ``report URL``); the damage tests work on a copy of
the run in another prefix, so the shared run stays whole.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from dataclasses import fields

import pytest
from _distributed_workers import launch
from _s3_server import Bucket, options_for
from _store_dcp_workers import w_save_then_resume

from ckpt_lesson.files.storage_fsspec import FsspecStorage
from ckpt_lesson.runs.layout import ScanResult
from ckpt_lesson.runs.report import read_recovery_log
from ckpt_lesson.runs.scan import scan_checkpoints


@pytest.fixture(scope="module")
def resumed(s3_endpoint: str, tmp_path_factory: pytest.TempPathFactory) -> Bucket:
    bucket = Bucket(f"t-{uuid.uuid4().hex[:20]}", s3_endpoint, options_for(s3_endpoint))
    bucket.fs().call_s3("create_bucket", Bucket=bucket.name)
    out = tmp_path_factory.mktemp("dcp_store_scan")
    assert launch(w_save_then_resume, 2, out, bucket.url(), bucket.options, str(out), limit=240) == [0, 0]
    assert [json.loads((out / f"resume-rank{r}.json").read_text())["step"] for r in (0, 1)] == [4, 4]
    return bucket


def _cli(bucket: Bucket, *argv: str) -> subprocess.CompletedProcess[str]:
    """``python -m ckpt_lesson ARGV`` in a child that finds the bucket through the AWS_* environment."""
    env = {**os.environ, **bucket.env(), "PYTHONPATH": os.getcwd()}
    cmd = [sys.executable, "-m", "ckpt_lesson", *argv]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)


def _copy_run(bucket: Bucket, prefix: str) -> FsspecStorage:
    """Every object of the shared run, copied under ``prefix``: a second run to damage."""
    source = FsspecStorage(bucket.url(), bucket.options)
    copy = FsspecStorage(bucket.url(prefix), bucket.options)
    for key in source.list_keys():
        copy.put_bytes(key, source.read_bytes(key, limit=1 << 30))
    return copy


def _attempt(store: FsspecStorage, step_dir: str) -> str:
    [marker] = [k for k in store.list_keys(step_dir) if k.endswith("/COMMIT")]
    return f"{step_dir}/{json.loads(store.read_bytes(marker, limit=1 << 16))['save_id']}"


def test_scan_of_a_bucket_verifies_each_multi_rank_save_with_every_ranks_objects(resumed: Bucket) -> None:
    results = scan_checkpoints(resumed.url(), resumed.options)
    assert [(r.path.name, r.step, r.status, r.reason) for r in results] == [
        ("step-00000002", 2, "ok", ""),
        ("step-00000004", 4, "ok", ""),
    ]
    store = FsspecStorage(resumed.url(), resumed.options)
    names = sorted(k.rsplit("/", 1)[-1] for k in store.list_keys(_attempt(store, "step-00000004")))
    assert names == [".metadata", "__0_0.distcp", "__1_0.distcp", "manifest.json"]  # both ranks' objects
    done = _cli(resumed, "scan", resumed.url())
    assert done.returncode == 0, done.stderr
    assert "2 save(s): 2 ok, 0 corrupt, 0 incomplete" in done.stdout


def test_scan_json_of_a_bucket_has_the_columns_of_a_local_scan(resumed: Bucket) -> None:
    done = _cli(resumed, "scan", resumed.url(), "--json")
    assert done.returncode == 0, done.stderr
    rows = json.loads(done.stdout)
    assert [(row["name"], row["status"]) for row in rows] == [
        ("step-00000002", "ok"),
        ("step-00000004", "ok"),
    ]
    local_columns = {f.name for f in fields(ScanResult)} | {"name"}  # what cli/scan.py prints for a folder
    assert all(set(row) == local_columns for row in rows)


def test_scan_of_a_bucket_names_a_flipped_byte_and_a_missing_rank_object_and_an_uncommitted_upload(
    resumed: Bucket,
) -> None:
    store = _copy_run(resumed, "damaged")
    step2, step4 = _attempt(store, "step-00000002"), _attempt(store, "step-00000004")
    store.delete([f"{step2}/__0_0.distcp"])  # rank 0's object of step 2 is gone
    for name in ("__1_0.distcp", ".metadata"):  # rank 1's object and DCP's index of step 4 are damaged
        data = bytearray(store.read_bytes(f"{step4}/{name}", limit=1 << 30))
        data[len(data) // 2] ^= 0x01
        store.put_bytes(f"{step4}/{name}", bytes(data))
    orphan = f"step-00000006/{uuid.uuid4().hex}"  # a writer that died before its marker
    for key in store.list_keys(step2):
        store.put_bytes(f"{orphan}/{key.rsplit('/', 1)[-1]}", store.read_bytes(key, limit=1 << 30))

    rows = {r.step: r for r in scan_checkpoints(resumed.url("damaged"), resumed.options)}
    assert (rows[2].status, rows[4].status, rows[6].status) == ("incomplete", "corrupt", "incomplete")
    assert "__0_0.distcp: missing" in rows[2].reason
    assert "__1_0.distcp" in rows[4].reason and ".metadata" in rows[4].reason
    assert "__0_0.distcp" not in rows[4].reason  # rank 0's object of step 4 is whole
    assert rows[6].path.name.startswith(".uncommitted-step-00000006-")
    assert "no commit marker names" in rows[6].reason
    done = _cli(resumed, "scan", resumed.url("damaged"))
    assert done.returncode == 1
    assert "3 save(s): 0 ok, 1 corrupt, 2 incomplete" in done.stdout


def test_report_of_a_bucket_shows_the_restore_the_two_ranks_made_recorded_once_by_rank_0(
    resumed: Bucket,
) -> None:
    [record] = read_recovery_log(resumed.url(), resumed.options)
    assert record["chosen"]["step"] == 4
    assert (record["fallback"], record["skipped"]) == (False, [])
    assert record["recovery_seconds"] is not None and record["recovery_seconds"] > 0
    assert record["last_good_save_age_seconds"] is not None  # from the commit marker's time
    assert record["steps_redone"] is None  # the heartbeat stayed on the machine: unknown, never a guess
    done = _cli(resumed, "report", resumed.url(), "--json")
    assert done.returncode == 0, done.stderr
    summary = json.loads(done.stdout)
    assert (summary["restores"], summary["fallbacks"]) == (1, 0)
