"""Staging space of bucket managers: no staged save outlives its process (real SIGKILLs, moto's S3 server)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

from ckpt_lesson.runs.store_staging import STAGING_PREFIX, StagingFolder, reclaim_dead_staging

_TESTS = os.path.dirname(os.path.abspath(__file__))


def _child(code, *, env=None, tmpdir=None):
    full = {**os.environ, **(env or {}), "PYTHONPATH": os.getcwd()}
    if tmpdir is not None:
        full["TMPDIR"] = str(tmpdir)
    return subprocess.run([sys.executable, "-c", code], env=full, capture_output=True, text=True, timeout=300)


def _staging(parent):
    return sorted(p.name for p in parent.iterdir() if p.name.startswith(STAGING_PREFIX))


_KILLED_HOLDER = """
import os, signal, sys
from ckpt_lesson.runs.store_staging import StagingFolder
folder = StagingFolder(sys.argv[1] if len(sys.argv) > 1 else None)
(folder.path / "step-00000004").mkdir()
(folder.path / "step-00000004" / "checkpoint.pt").write_bytes(b"x" * 100_000)
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_a_dead_owners_folder_is_reclaimed_and_one_in_use_never_is(tmp_path):
    alive = StagingFolder(tmp_path)
    (alive.path / "staged.pt").write_bytes(b"in use")
    killed = _child(_KILLED_HOLDER, tmpdir=tmp_path)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert len(_staging(tmp_path)) == 2
    older = tmp_path / f"{STAGING_PREFIX}older-version"  # no lock file: nothing proves its owner is gone
    older.mkdir()
    second = StagingFolder(tmp_path)  # reclaims on the way in
    assert set(_staging(tmp_path)) == {alive.path.name, second.path.name, older.name}
    assert (alive.path / "staged.pt").read_bytes() == b"in use"
    assert reclaim_dead_staging(tmp_path) == []  # both live folders are locked, even within one process
    second.remove()
    alive.remove()
    alive.remove()  # idempotent
    assert _staging(tmp_path) == [older.name]
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".ckpt-lesson")] == []


def test_interpreter_exit_removes_the_current_folder(tmp_path):
    done = _child(
        "from ckpt_lesson.runs.store_staging import StagingFolder\n"
        "f = StagingFolder(); (f.path / 'a.pt').write_bytes(b'x'); print(f.path)\n",
        tmpdir=tmp_path,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().startswith(str(tmp_path)) and _staging(tmp_path) == []


_SAVE_AND_EXIT = """
import sys
sys.path.insert(0, {tests!r})
from conftest import build_tiny_run
from ckpt_lesson.runs.manager import CheckpointManager
run = build_tiny_run(seed=1)
mgr = CheckpointManager(sys.argv[1], every_steps=2)
run.train(until_step=2)
mgr.save(run.model, run.optimizer, run.scheduler, run.state)
print(mgr.run_dir)
# no close(): interpreter exit must remove the staging folder
"""


def test_a_run_killed_mid_upload_leaves_nothing_in_tmpdir_once_any_later_run_has_started(s3_bucket, tmp_path):
    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir()
    writer = os.path.join(_TESTS, "_store_writer.py")
    env = {**os.environ, **s3_bucket.env(), "PYTHONPATH": os.getcwd(), "TMPDIR": str(tmpdir)}
    killed = subprocess.run([sys.executable, writer, s3_bucket.url("a"), "part:1"], env=env, timeout=300)
    assert killed.returncode == -signal.SIGKILL
    (left,) = _staging(tmpdir)  # the killed writer's staged save of step 4, whole
    assert [p.name for p in (tmpdir / left).iterdir() if p.name.startswith("step-")] == ["step-00000004"]
    # A run on another prefix, which exits without close(): afterwards TMPDIR holds nothing of either.
    code = _SAVE_AND_EXIT.format(tests=_TESTS)
    done = subprocess.run(
        [sys.executable, "-c", code, s3_bucket.url("b")], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().startswith(str(tmpdir / STAGING_PREFIX))
    assert _staging(tmpdir) == []
