"""Marker-mode cleanup deletes only interrupted saves; anything that might be a save is kept."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from _distributed_local import flip_byte, restore_locally, save_locally

from ckpt_lesson.runs.commit import COMMIT_MARKER, MARKER_LOCK
from ckpt_lesson.runs.marker_cleanup import clean_unmarked, unmarked_save_verifies

STEP2, STEP4 = "step-00000002", "step-00000004"


def _aside(run: Path, name: str) -> list[Path]:
    return [p for p in run.iterdir() if p.name.startswith(f".quarantine-{name}-")]


def test_a_committed_marker_folder_keeps_no_marker_lock(tmp_path: Path) -> None:
    save_locally(tmp_path / "run", steps=(2, 4), publish="marker")
    for name in (STEP2, STEP4):
        assert (tmp_path / "run" / name / COMMIT_MARKER).is_file()
        assert not (tmp_path / "run" / name / MARKER_LOCK).exists()


@pytest.mark.parametrize("old_lock", [False, True], ids=["new_save", "save_with_a_left_over_lock"])
def test_losing_commit_json_never_deletes_a_save_whose_manifest_and_parts_verify(
    tmp_path: Path, old_lock: bool, caplog: pytest.LogCaptureFixture
) -> None:
    run = tmp_path / "run"
    save_locally(run, steps=(2, 4), publish="marker")
    (run / STEP4 / COMMIT_MARKER).unlink()  # a sync tool or a careless rm
    if old_lock:  # saves written before the lock was removed at commit still carry a free one
        (run / STEP4 / MARKER_LOCK).touch()
    files = sorted(p.name for p in (run / STEP4).iterdir())
    with caplog.at_level(logging.WARNING, logger="ckpt_lesson.distributed"):
        restored, _ = restore_locally(run)  # a rename-mode manager opened on the directory
    assert restored.step == 2
    kept = _aside(run, STEP4)[0] if old_lock else run / STEP4
    assert sorted(p.name for p in kept.iterdir()) == files
    assert unmarked_save_verifies(kept) is None
    if old_lock:
        assert "every part verify" in caplog.text and STEP4 in caplog.text


def test_an_unmarked_folder_with_a_damaged_part_is_quarantined_with_its_reason(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    run = tmp_path / "run"
    save_locally(run, steps=(2, 4), publish="marker")
    (run / STEP4 / COMMIT_MARKER).unlink()
    (run / STEP4 / MARKER_LOCK).touch()
    part = next(p for p in (run / STEP4).iterdir() if p.suffix == ".distcp")
    flip_byte(part)
    with caplog.at_level(logging.WARNING, logger="ckpt_lesson.distributed"):
        assert clean_unmarked(run) == []
    [aside] = _aside(run, STEP4)
    assert (aside / part.name).is_file()
    assert "does not verify" in caplog.text and part.name in caplog.text


def test_an_unmarked_folder_without_a_manifest_is_an_interrupted_save_and_is_removed(tmp_path: Path) -> None:
    run = tmp_path / "run"
    save_locally(run, steps=(2,), publish="marker")
    (run / STEP4).mkdir()
    (run / STEP4 / MARKER_LOCK).touch()
    (run / STEP4 / "__0_0.distcp").write_bytes(b"half a part")
    assert clean_unmarked(run) == [STEP4]
    assert sorted(p.name for p in run.iterdir()) == [STEP2]
