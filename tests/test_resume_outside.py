"""Files written outside ``--lose-machine``'s simulated machine are found, in arguments and in /proc."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from ckpt_lesson.resume_test.outside import OpenWrites, path_arguments, written_paths


def test_absolute_paths_are_read_from_whole_arguments_and_flag_values():
    command = ["/venv/bin/python", "train.py", "--out=/data/ckpt", "/tmp/x", "--lr=1e-3", "-o", "/y"]
    assert path_arguments(command) == ["/data/ckpt", "/tmp/x", "/y"]


def test_only_paths_written_since_the_start_and_outside_the_workdir_count(tmp_path):
    old, new, workdir = tmp_path / "code.py", tmp_path / "out", tmp_path / "w"
    old.write_text("x")
    workdir.mkdir()
    since = time.time() + 1  # everything before this moment counts as old
    time.sleep(0.01)
    new.mkdir()
    (new / "last.pt").write_bytes(b"x")
    os.utime(new / "last.pt", (since + 1, since + 1))
    (workdir / "inside.pt").write_bytes(b"x")
    os.utime(workdir / "inside.pt", (since + 1, since + 1))
    command = ["python", str(old), f"--save={new}", str(workdir / "inside.pt"), "{ckpt_dir}"]
    assert written_paths(command, since=since, inside=workdir) == [str(new)]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc")
def test_a_file_held_open_for_writing_outside_the_workdir_is_seen_and_one_open_for_reading_is_not(tmp_path):
    written, read = tmp_path / "out.log", tmp_path / "in.txt"
    read.write_text("x")
    code = f"a = open({str(written)!r}, 'w'); b = open({str(read)!r}); import time; time.sleep(30)"
    child = subprocess.Popen([sys.executable, "-c", code])
    try:
        writes = OpenWrites(child.pid, tmp_path / "w", every=0.0)
        deadline = time.monotonic() + 30
        while str(written) not in writes.found and time.monotonic() < deadline:
            writes.poll()
            time.sleep(0.05)
        assert writes.found == {str(written)}
    finally:
        child.kill()
        child.wait()


def test_a_folder_argument_that_holds_the_workdir_is_not_flagged_for_the_workdir_alone(tmp_path):
    since = time.time() - 1
    (tmp_path / "w").mkdir()  # the tool's workdir, created inside the folder the command names
    (tmp_path / "w" / "report.json").write_text("{}")
    assert written_paths(["python", "t.py", f"--data={tmp_path}"], since=since, inside=tmp_path / "w") == []
    (tmp_path / "ckpt.pt").write_bytes(b"x")
    assert written_paths(["python", "t.py", f"--data={tmp_path}"], since=since, inside=tmp_path / "w") == [
        str(tmp_path)
    ]
