"""Recovery report: one JSON line per restore, a heartbeat for steps redone, and the report CLI.

The ``report URL`` tests use a real S3 API (moto's server, s3fs over HTTP)."""

from __future__ import annotations

import json
import time

import pytest

from ckpt_lesson import cli
from ckpt_lesson.errors import CheckpointError, CorruptCheckpointError
from ckpt_lesson.files.storage import open_storage
from ckpt_lesson.runs.manager import CheckpointManager
from ckpt_lesson.runs.report import (
    RECOVERY_LOG,
    RecoveryRecorder,
    append_recovery_record,
    build_recovery_record,
    code_version,
    process_start_time,
    read_progress,
    read_recovery_log,
    record_progress,
    summarize_recoveries,
)


def restore_info(step=240, skipped=(), created_at=1000.0):
    return {
        "step": step,
        "save_id": "s" * 32,
        "skipped": list(skipped),
        "manifest": {"created_at": created_at, "save_id": "s" * 32},
    }


def test_steps_redone_are_the_last_executed_step_minus_the_restored_step():
    rec = build_recovery_record(
        restore_info(skipped=[{"step": 280, "status": "incomplete", "reason": "part missing"}]),
        last_executed_step=300, started_at=10.0, first_step_at=12.5, now=1100.0, version="abc",
    )  # fmt: skip
    assert rec["chosen"] == {"step": 240, "save_id": "s" * 32}
    assert rec["steps_redone"] == 60
    assert rec["fallback"] is True and rec["incomplete_saves"] == 1 and rec["corrupt_saves"] == 0
    assert rec["recovery_seconds"] == 2.5
    assert rec["last_good_save_age_seconds"] == 100.0
    assert rec["code_version"] == "abc"


def test_without_a_heartbeat_steps_redone_is_unknown_not_guessed():
    rec = build_recovery_record(restore_info(), last_executed_step=None, started_at=0.0, first_step_at=None)
    assert rec["steps_redone"] is None and rec["recovery_seconds"] is None
    assert rec["fallback"] is False


def test_progress_heartbeat_round_trips_and_tolerates_garbage(tmp_path):
    assert read_progress(tmp_path) is None
    record_progress(tmp_path, 17)
    assert read_progress(tmp_path) == 17
    (tmp_path / "progress.json").write_text("{not json")
    assert read_progress(tmp_path) is None
    assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]


def test_recorder_writes_one_record_after_the_first_resumed_step(tmp_path):
    record_progress(tmp_path, 300)  # what the crashed process left behind
    recorder = RecoveryRecorder(tmp_path, started_at=time.time())
    assert recorder.last_executed_step == 300
    recorder.restored(restore_info(step=240, created_at=time.time()))
    first = recorder.step_done(241)
    assert first is not None and first["steps_redone"] == 60 and first["recovery_seconds"] >= 0
    assert recorder.step_done(242) is None
    assert read_progress(tmp_path) == 242
    assert [r["chosen"]["step"] for r in read_recovery_log(tmp_path)] == [240]


def test_a_fresh_start_writes_no_recovery_record(tmp_path):
    recorder = RecoveryRecorder(tmp_path)
    recorder.restored({"step": None, "save_id": None, "skipped": [], "manifest": None})
    recorder.step_done(1)
    assert not (tmp_path / RECOVERY_LOG).exists()


def test_a_torn_last_line_is_ignored(tmp_path):
    append_recovery_record(tmp_path, {"chosen": {"step": 40}, "fallback": False})
    with open(tmp_path / RECOVERY_LOG, "a") as f:
        f.write('{"chosen": {"st')  # a crash mid-append
    assert len(read_recovery_log(tmp_path)) == 1


def test_summary_counts_fallbacks_incomplete_saves_and_times():
    records = [
        build_recovery_record(
            restore_info(step=40), last_executed_step=45, started_at=0, first_step_at=1.0, now=1e3
        ),
        build_recovery_record(
            restore_info(step=80, skipped=[{"step": 120, "status": "incomplete", "reason": "r"}]),
            last_executed_step=120,
            started_at=0,
            first_step_at=3.0,
            now=1e3,
        ),  # fmt: skip
        build_recovery_record(
            restore_info(step=160, skipped=[{"step": 200, "status": "corrupt", "reason": "r"}]),
            last_executed_step=None,
            started_at=0,
            first_step_at=2.0,
            now=1e3,
        ),  # fmt: skip
    ]
    s = summarize_recoveries(records)
    assert (s.restores, s.fallbacks, s.incomplete_saves, s.corrupt_saves) == (3, 2, 1, 1)
    assert (s.steps_redone_total, s.steps_redone_max) == (45, 40)
    assert (s.recovery_seconds_median, s.recovery_seconds_max) == (2.0, 3.0)
    text = s.format()
    assert "fallbacks           2" in text and "45 total, 40 max" in text


def test_report_cli_prints_a_summary_and_json(tmp_path, capsys):
    append_recovery_record(
        tmp_path,
        build_recovery_record(
            restore_info(), last_executed_step=300, started_at=0, first_step_at=1.5, now=1e3
        ),
    )
    assert cli.main(["report", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "restores            1" in out and "60 total" in out
    assert cli.main(["report", str(tmp_path), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["restores"] == 1 and data["steps_redone_total"] == 60


def test_report_cli_on_a_run_without_restores_says_so(tmp_path, capsys):
    assert cli.main(["report", str(tmp_path)]) == 0
    assert "no restores recorded" in capsys.readouterr().out


def test_report_cli_on_a_missing_directory_exits_2(tmp_path, capsys):
    assert cli.main(["report", str(tmp_path / "nope")]) == 2
    assert "error:" in capsys.readouterr().err
    with pytest.raises(CheckpointError):
        read_recovery_log(tmp_path / "nope")


def test_process_start_is_in_the_past_and_code_version_is_a_commit_or_none():
    assert 0 <= time.time() - process_start_time() < 3600
    version = code_version()
    assert version is None or (len(version) == 40 and int(version, 16) >= 0)


# ------------------------------------------------------------------ report URL: the log kept in a bucket
@pytest.fixture
def bucket_env(s3_bucket, monkeypatch):
    """The bucket's endpoint and credentials in the environment, as the command line reads them."""
    for name, value in s3_bucket.env().items():
        monkeypatch.setenv(name, value)
    return s3_bucket


def _one_line_error(capsys, argv):
    code = cli.main(argv)
    err = capsys.readouterr().err.strip()
    assert code != 0, err
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    return err


def test_report_of_a_missing_bucket_is_one_line_naming_the_bucket_and_a_non_zero_exit(bucket_env, capsys):
    err = _one_line_error(capsys, ["report", "s3://missing-bucket-33/run"])
    assert "bucket 'missing-bucket-33' does not exist" in err
    # scan of the same URL says the same thing
    assert "bucket 'missing-bucket-33' does not exist" in _one_line_error(
        capsys, ["scan", "s3://missing-bucket-33/run"]
    )


def test_report_of_an_empty_prefix_is_one_line_saying_no_run_was_found(bucket_env, capsys):
    err = _one_line_error(capsys, ["report", bucket_env.url("no-such-prefix")])
    assert "no-such-prefix: no run found" in err and "--json" not in err


def test_report_of_a_run_with_saves_but_no_restore_says_so_and_exits_zero(bucket_env, tiny_run, capsys):
    run = tiny_run(seed=3)
    with CheckpointManager(bucket_env.url("saved"), every_steps=2) as mgr:
        run.train(until_step=2)
        mgr.save(run.model, run.optimizer, run.scheduler, run.state)
    assert cli.main(["report", bucket_env.url("saved")]) == 0
    assert "saved: no restores recorded" in capsys.readouterr().out


def test_a_damaged_log_in_a_bucket_is_named_by_its_url_not_a_local_temp_path(s3_bucket):
    url = s3_bucket.url("damaged-log")
    open_storage(url, s3_bucket.options).put_bytes(RECOVERY_LOG, b"not json\n[1]\n")
    with pytest.raises(CorruptCheckpointError) as caught:
        read_recovery_log(url, s3_bucket.options)
    assert str(caught.value).startswith(f"{url}/{RECOVERY_LOG}: 2 line(s) and none is a recovery record")
