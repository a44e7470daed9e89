"""The checkpoint folder watcher: manager saves exactly, other folders by file changes."""

from __future__ import annotations

import os

import pytest

from ckpt_lesson.resume_test import inotify as resume_inotify
from ckpt_lesson.resume_test import watch as resume_watch
from ckpt_lesson.resume_test.watch import FILES, MANAGER, NONE, FolderEvent, FolderWatcher, SaveBurst, Waker


def test_a_missing_folder_is_watched_until_it_appears(tmp_path):
    watcher = FolderWatcher(tmp_path / "ckpt")
    assert watcher.poll() == [] and watcher.layout == NONE
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "a.pt").write_bytes(b"x")
    assert watcher.poll() == [FolderEvent("activity", "a.pt")]
    assert watcher.layout == FILES


def test_manager_saves_are_seen_as_staging_then_published(tmp_path):
    watcher = FolderWatcher(tmp_path)
    staging = tmp_path / ".staging-step-00000020-123-abcd1234"
    staging.mkdir()
    (staging / "checkpoint.pt").write_bytes(b"x")
    assert watcher.poll() == [FolderEvent("staging", staging.name, 20)]
    assert watcher.layout == MANAGER and watcher.staging_present()
    os.replace(staging, tmp_path / "step-00000020")
    assert watcher.poll() == [FolderEvent("published", "step-00000020", 20)]
    assert watcher.published_steps() == [20] and not watcher.staging_present()


def test_a_staging_folder_appearing_between_two_listings_is_never_taken_for_a_generic_save(
    tmp_path, monkeypatch
):
    # The race CI hit once: the top folder listed empty, then a staging folder created, then the
    # walk's own listing saw its files, reported as "activity": the save at step 4 counted twice.
    root = tmp_path / "ckpt"
    root.mkdir()
    watcher = FolderWatcher(root)
    real_scandir = os.scandir
    calls = []

    def scandir(path):
        calls.append(path)
        if len(calls) == 1:  # the first listing of this poll: nothing there yet
            listing = list(real_scandir(path))
            staging = root / ".staging-step-00000004-1-abcd1234"
            staging.mkdir()
            (staging / "state.json").write_bytes(b"{}")
            return iter(listing)
        return real_scandir(path)

    monkeypatch.setattr(os, "scandir", scandir)
    assert watcher.poll() == []  # one consistent listing: an empty folder, no activity
    monkeypatch.setattr(os, "scandir", real_scandir)
    assert watcher.poll() == [FolderEvent("staging", ".staging-step-00000004-1-abcd1234", 4)]


def test_a_manager_folder_ignores_other_files_beside_the_saves(tmp_path):
    watcher = FolderWatcher(tmp_path, layout=MANAGER)
    (tmp_path / "recovery.jsonl").write_text("{}\n")
    assert watcher.poll() == []


def test_a_plain_folder_reports_new_growing_changed_and_removed_files(tmp_path):
    watcher = FolderWatcher(tmp_path)
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "notes.txt").write_text("1")  # no checkpoint-like name yet: every file counts
    assert {e.name for e in watcher.poll()} == {"sub/", "sub/notes.txt"}
    (tmp_path / "sub" / "ckpt.pt").write_bytes(b"1")
    (tmp_path / "sub" / "notes.txt").write_text("12")  # from now on, a log beside a checkpoint
    assert {e.name for e in watcher.poll()} == {"sub/ckpt.pt"}
    assert watcher.poll() == []
    with open(tmp_path / "sub" / "ckpt.pt", "ab") as f:
        f.write(b"23")
    assert watcher.poll() == [FolderEvent("activity", "sub/ckpt.pt")]
    (tmp_path / "sub" / "ckpt.pt").unlink()
    assert watcher.poll() == [FolderEvent("activity", "sub/ckpt.pt")]
    assert set(watcher.files()) == {"sub/", "sub/notes.txt"}


def test_a_file_replaced_by_a_rename_shows_a_new_inode(tmp_path):
    (tmp_path / "ckpt.pt").write_bytes(b"old")
    watcher = FolderWatcher(tmp_path)
    before = watcher.files()["ckpt.pt"][2]
    (tmp_path / "tmp").write_bytes(b"new")
    os.replace(tmp_path / "tmp", tmp_path / "ckpt.pt")
    assert watcher.poll() == [FolderEvent("activity", "ckpt.pt")]
    assert watcher.files()["ckpt.pt"][2] != before and watcher.previous["ckpt.pt"][2] == before


def test_the_waker_returns_on_a_change_or_a_timeout(tmp_path):
    waker = Waker()
    waker.watch(tmp_path)
    (tmp_path / "f").write_text("x")
    waker.wait(5.0)  # returns at once: the write is already queued (or polling sleeps 2 ms)
    waker.wait(0.0)
    waker.close()
    waker.close()  # closing twice is harmless


def test_what_a_restart_finds_in_the_folder_is_not_reported_as_new(tmp_path):
    (tmp_path / "step-00000010").mkdir()
    watcher = FolderWatcher(tmp_path)
    assert watcher.layout == MANAGER and watcher.poll() == [] and watcher.published_steps() == [10]


def test_the_waker_reports_files_renamed_into_place(tmp_path):
    waker = Waker()
    if not waker.uses_inotify:
        waker.close()
        pytest.skip("no inotify here: polling cannot see renames (the inode check stands in)")
    waker.watch(tmp_path)
    (tmp_path / "ckpt.tmp").write_bytes(b"x")
    os.replace(tmp_path / "ckpt.tmp", tmp_path / "ckpt.pt")
    waker.wait(1.0)
    assert waker.take_moved_in() == {str(tmp_path / "ckpt.pt")}
    assert waker.take_moved_in() == set()
    waker.close()


def burst_after(tmp_path, change):
    """A SaveBurst over whatever ``change`` does to the folder, polled once or twice."""
    watcher = FolderWatcher(tmp_path)
    burst = SaveBurst()
    for step in change:
        step()
        burst.add({e.name for e in watcher.poll()}, watcher)
    return burst.cut_short(watcher.files())


def test_a_save_burst_flags_a_file_rewritten_in_place(tmp_path):
    (tmp_path / "ckpt.pt").write_bytes(b"old save")
    assert burst_after(tmp_path, [lambda: (tmp_path / "ckpt.pt").write_bytes(b"ne")]) == [("ckpt.pt", 2)]


def test_a_save_burst_trusts_a_file_renamed_into_place(tmp_path):
    (tmp_path / "ckpt.pt").write_bytes(b"old save")
    steps = [lambda: (tmp_path / "ckpt.tmp").write_bytes(b"new"),
             lambda: os.replace(tmp_path / "ckpt.tmp", tmp_path / "ckpt.pt")]  # fmt: skip
    assert burst_after(tmp_path, steps) == []


def test_a_save_burst_trusts_a_new_file_first_seen_under_its_temporary_name(tmp_path):
    steps = [lambda: (tmp_path / "ckpt.tmp").write_bytes(b"new"),
             lambda: os.replace(tmp_path / "ckpt.tmp", tmp_path / "ckpt.pt")]  # fmt: skip
    assert burst_after(tmp_path, steps) == []


def test_a_save_burst_flags_a_temporary_file_left_behind(tmp_path):
    assert burst_after(tmp_path, [lambda: (tmp_path / "ckpt.tmp").write_bytes(b"ha")]) == [("ckpt.tmp", 2)]


def inotify_waker():
    waker = Waker()
    if not waker.uses_inotify:
        waker.close()
        pytest.skip("no inotify here: the watcher polls")
    return waker


def test_with_inotify_a_new_folder_is_watched_and_changes_deep_inside_it_are_seen(tmp_path):
    waker = inotify_waker()
    watcher = FolderWatcher(tmp_path, waker=waker)
    assert watcher.poll() == []  # nothing changed: nothing walked
    (tmp_path / "a" / "b").mkdir(parents=True)
    (tmp_path / "a" / "b" / "c.pt").write_bytes(b"1")
    waker.wait(1.0)
    assert FolderEvent("activity", "a/b/c.pt") in watcher.poll()
    with open(tmp_path / "a" / "b" / "c.pt", "ab") as f:
        f.write(b"2")
    waker.wait(1.0)
    assert watcher.poll() == [FolderEvent("activity", "a/b/c.pt")]
    assert watcher.files()["a/b/c.pt"][0] == 2 and watcher.warning is None
    waker.close()


def test_a_folder_beyond_the_entry_cap_gets_a_warning(tmp_path, monkeypatch):
    monkeypatch.setattr(resume_watch, "MAX_ENTRIES", 5)
    for i in range(8):
        (tmp_path / f"f{i}.pt").write_bytes(b"x")
    watcher = FolderWatcher(tmp_path)
    assert len(watcher.files()) == 5
    assert "holds more than 5 entries: the watcher saw only part of it" in watcher.warning
    assert "--ckpt-glob" in watcher.warning


def test_beyond_the_watch_cap_the_watcher_warns_and_falls_back_to_polling(tmp_path, monkeypatch):
    monkeypatch.setattr(resume_inotify, "MAX_WATCHES", 2)
    waker = inotify_waker()
    for name in ("a", "b", "c"):
        (tmp_path / name).mkdir()
    watcher = FolderWatcher(tmp_path, waker=waker)
    assert waker.capped
    (tmp_path / "c" / "late.pt").write_bytes(b"x")  # in a folder no watch covers
    events = []
    for _ in range(200):  # polling walks at most a share of the time: give it a few ticks
        waker.wait(0.01)
        events += watcher.poll()
        if events:
            break
    assert events == [FolderEvent("activity", "c/late.pt")]
    assert "more folders than can be watched" in watcher.warning
    waker.close()
