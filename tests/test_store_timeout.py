"""A store that stops answering: every wait has a deadline of our own (moto server in a child, SIGSTOPped).

An in-process server cannot be paused, so this one runs as ``python -m moto.server``
on 127.0.0.1 and a free port. SIGSTOP freezes it with its socket still listening:
connections are accepted by the kernel and then nothing answers, the case where
botocore's and s3fs's own timeouts and retries stack up to many minutes.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid

import pytest
from _s3_server import options_for

from ckpt_lesson.errors import CheckpointError, LoadEnvironmentError
from ckpt_lesson.files.storage_transfer import DEFAULT_TIMEOUT
from ckpt_lesson.runs.manager import CheckpointManager

pytest.importorskip("s3fs")
pytest.importorskip("moto.server")


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def own_server():
    """``(process, endpoint)`` of a moto server in a child process; resumed and killed in teardown."""
    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise RuntimeError("moto server did not start") from None
                time.sleep(0.2)
        yield proc, f"http://127.0.0.1:{port}"
    finally:
        os.kill(proc.pid, signal.SIGCONT)
        proc.kill()
        proc.wait(timeout=30)


def _ours():
    # fsspec runs its requests on one IO-loop thread of its own ("fsspecIO"): not ours to stop.
    return {t for t in threading.enumerate() if t.name != "fsspecIO"}


def test_a_silent_store_is_a_one_line_error_naming_the_bucket_within_the_timeout(own_server, tiny_run):
    proc, endpoint = own_server
    options = options_for(endpoint)
    bucket = f"t-{uuid.uuid4().hex[:20]}"
    import s3fs

    s3fs.S3FileSystem(**options).call_s3("create_bucket", Bucket=bucket)
    run = tiny_run(seed=6)
    before = _ours()
    mgr = CheckpointManager(f"s3://{bucket}/run", every_steps=2, storage_options=options, timeout=3)
    run.train(until_step=2)
    mgr.save(run.model, run.optimizer, run.scheduler, run.state)
    os.kill(proc.pid, signal.SIGSTOP)  # alive, listening, silent
    try:
        started = time.monotonic()
        with pytest.raises(LoadEnvironmentError) as caught:
            mgr.restore_latest(run.model, run.optimizer, run.scheduler)
        waited = time.monotonic() - started
        message = str(caught.value)
        assert f"bucket '{bucket}'" in message and "no answer within 3 s while" in message, message
        assert "\n" not in message
        assert waited < 60, waited  # a bound, not a timing: without our deadline this took > 10 minutes
        run.train(until_step=4)
        with pytest.raises(LoadEnvironmentError, match=f"bucket '{bucket}'.*no answer within 3 s while"):
            mgr.save(run.model, run.optimizer, run.scheduler, run.state)
    finally:
        os.kill(proc.pid, signal.SIGCONT)
    mgr.close()
    left = _ours() - before
    deadline = time.monotonic() + 10
    while left and time.monotonic() < deadline:  # a thread of ours that is ending may need a moment
        time.sleep(0.1)
        left = {t for t in left if t.is_alive()}
    assert not left, left
    # The store answers again: the same run restores (the silent spell damaged nothing).
    with CheckpointManager(f"s3://{bucket}/run", every_steps=2, storage_options=options, timeout=30) as again:
        assert again.restore_latest(run.model, run.optimizer, run.scheduler).step == 2


def test_the_default_deadline_gives_up_on_a_silent_store_within_five_minutes():
    assert 0 < DEFAULT_TIMEOUT <= 300


def test_a_timeout_that_is_not_a_positive_number_is_refused_in_one_line():
    with pytest.raises(CheckpointError, match="timeout must be a number of seconds > 0"):
        CheckpointManager("s3://bucket/run", every_steps=2, timeout=0)
