"""Side files (heartbeat, recovery log, locks, step log): no symlink followed, no FIFO waited on.

Each test plants the hostile thing at a side file's name on the fly, runs the
real writer, and checks the two things that matter: the file outside the run
directory is untouched, and nothing hangs (the autouse alarm fails a hang).
"""

from __future__ import annotations

import logging
import os
import signal
from pathlib import Path

import pytest

from ckpt_lesson.errors import CheckpointError
from ckpt_lesson.files.side_files import append_beside, open_beside, replace_beside
from ckpt_lesson.runs.commit import LOCK_NAME, MARKER_LOCK, writer_is_dead
from ckpt_lesson.runs.marker_cleanup import clean_unmarked
from ckpt_lesson.runs.report import (
    PROGRESS_NAME,
    RECOVERY_LOG,
    RecoveryRecorder,
    append_recovery_record,
    read_progress,
    record_progress,
)
from ckpt_lesson.runs.steplog import STEP_LOG_ENV, log_step

OUTSIDE = b"someone else's file\n"


@pytest.fixture(autouse=True)
def no_hang():
    """A FIFO must not hang a test: fail it after 30 s instead."""

    def fail(signum, frame):
        raise TimeoutError("hung for 30 s opening a side file")

    previous = signal.signal(signal.SIGALRM, fail)
    signal.alarm(30)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, previous)


def plant(kind: str, at: Path, tmp_path: Path) -> Path:
    """Put a symlink to an outside file, or a FIFO, at `at`; returns the outside file."""
    victim = tmp_path / "outside.txt"
    victim.write_bytes(OUTSIDE)
    if kind == "symlink":
        at.symlink_to(victim)
    else:
        os.mkfifo(at)
    return victim


def run_dir(tmp_path: Path) -> Path:
    run = tmp_path / "run"
    run.mkdir()
    return run


@pytest.mark.parametrize("kind", ["symlink", "fifo"])
def test_the_recovery_log_refuses_a_symlink_or_fifo_and_leaves_the_target_untouched(tmp_path, kind):
    run = run_dir(tmp_path)
    victim = plant(kind, run / RECOVERY_LOG, tmp_path)
    with pytest.raises(CheckpointError, match="recovery.jsonl"):
        append_recovery_record(run, {"step": 4})
    assert victim.read_bytes() == OUTSIDE


@pytest.mark.parametrize("kind", ["symlink", "fifo"])
def test_a_recovery_recorder_keeps_training_when_its_log_name_is_hostile(tmp_path, kind, caplog):
    run = run_dir(tmp_path)
    victim = plant(kind, run / RECOVERY_LOG, tmp_path)
    recorder = RecoveryRecorder(run, started_at=0.0)
    recorder.restored({"step": 4, "manifest": {}, "skipped": []})
    with caplog.at_level(logging.WARNING):
        record = recorder.step_done(5)
    assert record is not None and record["chosen"]["step"] == 4
    assert "recovery.jsonl" in caplog.text
    assert victim.read_bytes() == OUTSIDE


def test_the_heartbeat_temp_name_cannot_be_prepared_in_advance(tmp_path):
    run = run_dir(tmp_path)
    # The old predictable name, and a few guesses around it: none of them may receive our bytes.
    victim = plant("symlink", run / f".{PROGRESS_NAME}.tmp-{os.getpid()}", tmp_path)
    assert record_progress(run, 7)
    assert read_progress(run) == 7
    assert victim.read_bytes() == OUTSIDE
    assert not (run / PROGRESS_NAME).is_symlink()


@pytest.mark.parametrize("kind", ["symlink", "fifo"])
def test_a_hostile_heartbeat_name_is_replaced_never_written_through(tmp_path, kind):
    run = run_dir(tmp_path)
    victim = plant(kind, run / PROGRESS_NAME, tmp_path)
    assert record_progress(run, 3)
    assert read_progress(run) == 3
    assert victim.read_bytes() == OUTSIDE


@pytest.mark.parametrize("kind", ["symlink", "fifo"])
def test_the_step_log_refuses_a_symlink_or_fifo_before_the_first_step(tmp_path, kind, monkeypatch):
    name = tmp_path / f"steps-{kind}.jsonl"
    victim = plant(kind, name, tmp_path)
    monkeypatch.setenv(STEP_LOG_ENV, str(name))
    with pytest.raises(CheckpointError, match=name.name):
        log_step(1, 0.5)
    assert victim.read_bytes() == OUTSIDE


@pytest.mark.parametrize("kind", ["symlink", "fifo"])
def test_a_hostile_staging_lock_never_counts_as_a_dead_writer(tmp_path, kind):
    run = run_dir(tmp_path)
    staging = run / ".staging-step-00000004-1-deadbeef"
    staging.mkdir()
    victim = plant(kind, staging / LOCK_NAME, tmp_path)
    assert writer_is_dead(staging) is False
    assert victim.read_bytes() == OUTSIDE


def test_marker_cleanup_leaves_a_folder_whose_lock_is_a_symlink(tmp_path):
    run = run_dir(tmp_path)
    folder = run / "step-00000004"
    folder.mkdir()
    victim = plant("symlink", folder / MARKER_LOCK, tmp_path)
    assert clean_unmarked(run) == []
    assert folder.is_dir() and victim.read_bytes() == OUTSIDE


@pytest.mark.parametrize("what", ["dir", "socket"])
def test_open_beside_refuses_every_kind_of_non_regular_file(tmp_path, what):
    import socket

    target = tmp_path / "side"
    if what == "dir":
        target.mkdir()
        flags = os.O_RDONLY
    else:
        sock = socket.socket(socket.AF_UNIX)
        sock.bind(str(target))
        sock.close()
        flags = os.O_WRONLY | os.O_APPEND
    with pytest.raises((CheckpointError, OSError)):
        os.close(open_beside(target, flags))


def test_append_and_replace_beside_write_regular_files(tmp_path):
    append_beside(tmp_path / "log", b"a\n")
    append_beside(tmp_path / "log", b"b\n")
    replace_beside(tmp_path / "rec", b"x")
    replace_beside(tmp_path / "rec", b"y")
    assert (tmp_path / "log").read_bytes() == b"a\nb\n"
    assert (tmp_path / "rec").read_bytes() == b"y"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["log", "rec"]
