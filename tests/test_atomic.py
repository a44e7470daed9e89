"""Atomic, durable writes: after any crash the target is the old file or the new one, whole.

The crash tests run a writer process that saves a 64 MB checkpoint over an
existing one with :func:`atomic_save` and SIGKILL it at chosen moments: a fixed
delay after it starts writing, while the temp file is visibly growing, just
before the rename and just after it. Whatever the moment, the target must load
and equal one of the two payloads exactly. Temp files may be left behind by a
SIGKILL (nothing runs after it), but they are always recognisable as temp files.
"""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from ckpt_lesson.errors import CheckpointError
from ckpt_lesson.files import atomic
from ckpt_lesson.files.atomic import (
    atomic_save,
    atomic_write_bytes,
    atomic_write_json,
    fsync_dir,
    is_temp_file,
)
from ckpt_lesson.files.checkpoint import load_verified_file
from ckpt_lesson.files.hashing import DEFAULT_ALGO, digest_bytes

PART = 1 << 20  # float32 elements per part: 4 MB
PARTS = 16  # 64 MB in all, written part by part so the temp file grows visibly


def big_payload(tag: str, value: float) -> dict:
    return {"tag": tag, "parts": [torch.full((PART,), value) for _ in range(PARTS)]}


# The writer. Importing torch costs seconds, so one child process imports it
# once and then forks a fresh writer per scenario; the parent SIGKILLs that
# writer, and the child reports how it died. A fork shares nothing with its
# siblings afterwards, so every scenario still starts from a clean process.
WRITER = r"""
import os, sys, time
import torch

torch.set_num_threads(1)  # no OpenMP pool to inherit across fork()
from ckpt_lesson.files import atomic

part, parts = int(sys.argv[1]), int(sys.argv[2])
payload = {"tag": "new", "parts": [torch.full((part,), 2.0) for _ in range(parts)]}
real_replace = os.replace
moment = ""

def replace(src, dst):
    # Markers on stdout let the parent kill at an exact point around the rename.
    if moment == "before_rename":
        print("AT_RENAME", flush=True)
        time.sleep(60)
    real_replace(src, dst)
    if moment == "after_rename":
        print("RENAMED", flush=True)
        time.sleep(60)

os.replace = replace  # atomic.py calls os.replace through the os module
print("READY", flush=True)
for line in sys.stdin:
    target, moment = line.split()
    pid = os.fork()
    if pid == 0:
        try:
            print(f"WRITING {os.getpid()}", flush=True)
            atomic.atomic_save(payload, target)
            print("DONE", flush=True)
            time.sleep(60)
        finally:
            os._exit(0)
    _, status = os.waitpid(pid, 0)
    print(f"REAPED {status}", flush=True)
"""


@pytest.fixture(scope="module")
def writer():
    proc = subprocess.Popen(
        [sys.executable, "-c", WRITER, str(PART), str(PARTS)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    watchdog = threading.Timer(300, proc.kill)  # never hang the suite
    watchdog.start()
    try:
        assert proc.stdout.readline().strip() == "READY"
        yield proc
    finally:
        watchdog.cancel()
        proc.kill()  # nothing left to flush: a clean exit would only spend time unloading torch
        proc.wait()
        proc.stdin.close()
        proc.stdout.close()


def temp_sizes(directory: Path) -> list[int]:
    sizes = []
    for entry in directory.iterdir():
        if is_temp_file(entry):
            try:
                sizes.append(entry.stat().st_size)
            except FileNotFoundError:  # renamed between listing and stat
                pass
    return sizes


def write_and_kill(writer: subprocess.Popen, directory: Path, moment: str, final_size: int) -> str:
    """Start a writer over ``directory/ckpt.pt``, SIGKILL it at ``moment``, return what was seen."""
    writer.stdin.write(f"{directory / 'ckpt.pt'} {moment}\n")
    writer.stdin.flush()
    line = writer.stdout.readline().split()
    assert line[:1] == ["WRITING"], line
    pid = int(line[1])
    seen = ""
    try:
        if moment.startswith("delay_"):
            time.sleep(float(moment.removeprefix("delay_").removesuffix("s")))
        elif moment == "while_growing":
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                growing = [s for s in temp_sizes(directory) if 0 < s < final_size]
                if growing:
                    seen = f"temp file at {growing[0]} of {final_size} bytes"
                    break
                time.sleep(0.0005)
        else:
            seen = writer.stdout.readline().strip()
    finally:
        os.kill(pid, signal.SIGKILL)  # the writer is always killed, even when an assert above failed
        while not (line := writer.stdout.readline()).startswith("REAPED") and line:
            pass  # skip a DONE printed before the kill landed
    status = int(line.split()[1])
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
    return seen


def which_payload(path: Path) -> str:
    """Load ``path`` (verified) and say whether it is exactly the old or the new payload."""
    obj, _ = load_verified_file(path)
    value = {"old": 1.0, "new": 2.0}[obj["tag"]]
    assert len(obj["parts"]) == PARTS
    assert all(torch.equal(p, torch.full((PART,), value)) for p in obj["parts"])
    return obj["tag"]


@pytest.mark.parametrize(
    "moment", ["delay_0.05s", "delay_0.2s", "while_growing", "before_rename", "after_rename"]
)
def test_sigkill_during_a_save_leaves_the_old_or_the_new_file_never_a_partial_one(writer, tmp_path, moment):
    final_size = atomic_save(big_payload("old", 1.0), tmp_path / "ckpt.pt").size
    seen = write_and_kill(writer, tmp_path, moment, final_size)

    names = sorted(p.name for p in tmp_path.iterdir())
    finished = [n for n in names if not is_temp_file(n)]
    leftovers = [tmp_path / n for n in names if is_temp_file(n)]
    assert finished == ["ckpt.pt"]
    outcome = which_payload(tmp_path / "ckpt.pt")

    if moment == "while_growing":
        assert seen, "the temp file was never seen part-written; make the payload bigger"
        assert outcome == "old"
        assert len(leftovers) == 1
        with pytest.raises(CheckpointError):  # a half-written temp file cannot pass for a checkpoint
            load_verified_file(leftovers[0])
    elif moment == "before_rename":
        assert seen == "AT_RENAME"
        assert outcome == "old"
        assert len(leftovers) == 1  # complete, but still only a temp file
    elif moment == "after_rename":
        assert seen == "RENAMED"
        assert outcome == "new"
        assert leftovers == []
    else:
        assert outcome in {"old", "new"}
        assert len(leftovers) <= 1


@pytest.fixture
def old_file(tmp_path):
    path = tmp_path / "ckpt.pt"
    atomic_save({"w": torch.zeros(1000)}, path)
    return path, path.read_bytes()


@pytest.mark.parametrize("interrupt", [KeyboardInterrupt, RuntimeError], ids=["ctrl_c", "error"])
def test_an_interrupted_write_removes_its_temp_file_and_keeps_the_old_file(old_file, monkeypatch, interrupt):
    path, old_bytes = old_file
    temps_during_write = []

    def interrupted_save(obj, f, *args, **kwargs):
        f.write(b"\x00" * 100_000)  # half a file is already on its way to disk
        temps_during_write.extend(p.name for p in path.parent.iterdir() if is_temp_file(p))
        raise interrupt("stop")

    monkeypatch.setattr(torch, "save", interrupted_save)
    with pytest.raises(interrupt):
        atomic_save({"w": torch.ones(1000)}, path)
    assert len(temps_during_write) == 1  # there was a temp file to clean up
    assert sorted(p.name for p in path.parent.iterdir()) == ["ckpt.pt"]
    assert path.read_bytes() == old_bytes


def test_the_previous_file_is_untouched_until_the_rename(old_file, monkeypatch):
    path, old_bytes = old_file
    old_inode = path.stat().st_ino
    checked = []
    real_replace = os.replace

    def replace(src, dst):
        # At this instant the new file is complete and durable under its temp name,
        # and the old one has not been modified in any way.
        assert Path(dst) == path and Path(src).parent == path.parent and is_temp_file(src)
        assert path.read_bytes() == old_bytes and path.stat().st_ino == old_inode
        assert torch.equal(load_verified_file(src)[0]["w"], torch.ones(1000))
        checked.append(src)
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", replace)
    atomic_save({"w": torch.ones(1000)}, path)
    assert len(checked) == 1
    assert torch.equal(load_verified_file(path)[0]["w"], torch.ones(1000))


@pytest.mark.parametrize("writer", ["atomic_save", "atomic_write_json", "atomic_write_bytes"])
def test_fsync_hits_the_file_then_replace_then_the_directory(tmp_path, monkeypatch, writer):
    events = []
    real_fsync, real_replace = os.fsync, os.replace

    sizes_at_fsync = []

    def fsync(fd):
        st = os.fstat(fd)
        events.append(("fsync", "dir" if stat.S_ISDIR(st.st_mode) else "file", st.st_ino))
        if not stat.S_ISDIR(st.st_mode):
            sizes_at_fsync.append(st.st_size)  # Python's buffer must be flushed before the fsync
        real_fsync(fd)

    def replace(src, dst):
        events.append(("replace", Path(src).name, Path(dst).name))
        real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    path = tmp_path / "out.bin"
    if writer == "atomic_save":
        atomic_save({"w": torch.ones(10)}, path)
    elif writer == "atomic_write_json":
        atomic_write_json({"a": 1}, path)
    else:
        atomic_write_bytes(b"hello", path)

    file_sync = ("fsync", "file", path.stat().st_ino)  # the final file's inode: the temp was renamed
    dir_sync = ("fsync", "dir", tmp_path.stat().st_ino)
    renames = [e for e in events if e[0] == "replace"]
    assert len(renames) == 1 and is_temp_file(renames[0][1]) and renames[0][2] == "out.bin"
    assert file_sync in events and dir_sync in events
    assert events.index(file_sync) < events.index(renames[0]) < len(events) - 1 - events[::-1].index(dir_sync)
    assert sizes_at_fsync == [path.stat().st_size]


def test_missing_parent_directories_are_created_and_each_new_one_is_fsynced_in_its_parent(
    tmp_path, monkeypatch
):
    synced = []
    real_fsync_dir = atomic.fsync_dir
    monkeypatch.setattr(atomic, "fsync_dir", lambda d: (synced.append(Path(d)), real_fsync_dir(d)))
    target = tmp_path / "a" / "b" / "ckpt.pt"
    atomic_save({"w": torch.ones(2)}, target)
    assert torch.equal(torch.load(target, weights_only=True)["w"], torch.ones(2))
    # the new folders' parents first (outermost first), then the target's folder for the rename
    assert synced == [tmp_path, tmp_path / "a", tmp_path / "a" / "b"]


def test_a_path_below_a_regular_file_is_a_one_line_checkpoint_error_and_writes_nothing(tmp_path):
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(CheckpointError, match="notes.txt exists and is not a directory") as info:
        atomic_write_json({"a": 1}, tmp_path / "notes.txt" / "sub" / "index.json")
    assert "\n" not in str(info.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]


def test_a_directory_as_target_is_refused_before_writing(tmp_path):
    (tmp_path / "ckpt.pt").mkdir()
    with pytest.raises(CheckpointError, match="is a directory"):
        atomic_save({"w": torch.ones(2)}, tmp_path / "ckpt.pt")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt.pt"]


def test_temp_files_are_recognisable_and_finished_files_are_not(tmp_path, monkeypatch):
    names = []
    real_replace = os.replace

    def replace(src, dst):
        names.append(Path(src).name)
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", replace)
    atomic_write_bytes(b"x", tmp_path / "step_10.pt")
    atomic_write_bytes(b"x", tmp_path / "step_10.pt")
    assert len(set(names)) == 2  # a fresh, unique temp name per write
    assert all(is_temp_file(n) and n.startswith(".step_10.pt.tmp-") for n in names)
    assert str(os.getpid()) in names[0]
    for finished in ["step_10.pt", "latest.json", ".hidden.pt", "tmp-model.pt", "a.tmp-1.pt"]:
        assert not is_temp_file(finished), finished


def test_atomic_write_json_writes_sorted_indented_json_and_returns_its_digest(tmp_path):
    path = tmp_path / "index.json"
    digest = atomic_write_json({"b": [1, 2], "a": {"z": 1.5, "y": None}}, path)
    text = path.read_text()
    assert json.loads(text) == {"a": {"y": None, "z": 1.5}, "b": [1, 2]}
    assert text.index('"a"') < text.index('"b"') and text.endswith("\n") and "\n  " in text
    assert digest.algo == DEFAULT_ALGO and digest.size == len(path.read_bytes())
    assert digest.digest == digest_bytes(path.read_bytes(), DEFAULT_ALGO)


@pytest.mark.parametrize("bad", [{"x": float("nan")}, {"x": object()}, {"x": torch.ones(1)}])
def test_atomic_write_json_refuses_values_json_cannot_hold_exactly(tmp_path, bad):
    with pytest.raises(CheckpointError, match="index.json"):
        atomic_write_json(bad, tmp_path / "index.json")
    assert list(tmp_path.iterdir()) == []


def test_fsync_dir_works_on_an_existing_directory_and_fails_loudly_on_a_missing_one(tmp_path):
    fsync_dir(tmp_path)
    with pytest.raises(FileNotFoundError):
        fsync_dir(tmp_path / "missing")
