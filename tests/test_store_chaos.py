"""``chaos --store``: the kill campaign against a bucket (a real S3 API: moto's server, s3fs over HTTP)."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest

from ckpt_lesson import cli
from ckpt_lesson.faults.campaign import run_campaign


@pytest.fixture
def bucket_env(s3_bucket, monkeypatch):
    """The bucket's endpoint and credentials in the environment, as a training machine gets them."""
    for name, value in s3_bucket.env().items():
        monkeypatch.setenv(name, value)
    return s3_bucket


def test_a_small_kill_campaign_against_the_bucket_makes_no_wrong_choice_and_no_corrupt_load(
    bucket_env, tmp_path
):
    # The first named run: mid-upload (multipart never completed), right after the marker, between
    # retention's marker and parts deletions, and a flipped byte in a committed part.
    result = run_campaign(kills=4, seed=0, workdir=tmp_path, store=bucket_env.url("chaos"))
    table = result.table()
    assert [o.plan.point for o in result.outcomes] == ["mid_upload", "committed", "store_retention", "bitrot"]
    assert all(o.killed for o in result.outcomes), table
    assert result.wrong_choices == 0 and result.corrupt_loads == 0, table
    assert result.ok, table
    assert [o.chosen for o in result.outcomes] == [o.predicted for o in result.outcomes]
    assert f"s3://{bucket_env.name} (local folders were scratch)" in table
    # The campaign removes its objects (and aborts unfinished uploads) when not asked to keep them.
    fs = bucket_env.fs()
    assert fs.find(f"{bucket_env.name}/chaos") == []
    assert fs.call_s3("list_multipart_uploads", Bucket=bucket_env.name).get("Uploads", []) == []


def _one_line_error(capsys, argv):
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    return err


def test_chaos_store_refuses_a_local_path_naming_the_flag(capsys):
    err = _one_line_error(capsys, ["chaos", "--store", "runs/local", "--kills", "1"])
    assert err.startswith("error: --store runs/local: not a bucket URL")


def test_chaos_store_refuses_a_missing_bucket_naming_the_flag_and_the_bucket(bucket_env, capsys):
    err = _one_line_error(capsys, ["chaos", "--store", "s3://no-such-bucket-23/x", "--kills", "1"])
    assert err.startswith("error: --store: s3://no-such-bucket-23/x") and "no-such-bucket-23" in err


@pytest.fixture
def fresh_clients():
    """fsspec caches one S3 client per set of arguments, not per environment: start and end without."""
    import s3fs

    s3fs.S3FileSystem.clear_instance_cache()
    yield
    s3fs.S3FileSystem.clear_instance_cache()


def test_chaos_store_refuses_an_unreachable_endpoint_naming_the_flag(
    bucket_env, capsys, monkeypatch, fresh_clients
):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # closed again: nothing listens there
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{port}")
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    err = _one_line_error(capsys, ["chaos", "--store", bucket_env.url("x"), "--kills", "1"])
    assert err.startswith("error: --store: ") and f"could not reach bucket '{bucket_env.name}'" in err


@pytest.mark.parametrize(
    "argv",
    [
        ["chaos", "--store", "s3://bucket/run", "--kills", "1"],
        ["migrate", "s3://bucket/run/last.pt"],
    ],
)
def test_without_the_s3_extra_a_bucket_url_is_one_line_naming_the_extra(argv):
    code = (
        "import sys; sys.modules['s3fs'] = None\n"
        "from ckpt_lesson.cli import main\n"
        f"sys.exit(main({argv!r}))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1, done.stderr
    assert "pip install ckpt_lesson[s3]" in lines[0] and "Traceback" not in done.stderr
