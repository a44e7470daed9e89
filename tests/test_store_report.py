"""``report URL`` of a run in a bucket (a real S3 API: moto's server, s3fs over HTTP)."""

from __future__ import annotations

import pytest

from ckpt_lesson import cli
from ckpt_lesson.runs.manager import CheckpointManager


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
