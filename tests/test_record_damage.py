"""Every record read is bounded and typed: deep JSON and EIO are damage, and ranks fall back together."""

from __future__ import annotations

import errno
import json
import os
import shutil
from pathlib import Path

import pytest
from _distributed_local import restore_locally, save_locally
from _record_workers import w_restore_report, w_restore_report_with_eio, w_save_steps

from ckpt_lesson.faults.rank_launch import launch
from ckpt_lesson.runs.folder_manifest import (
    FOLDER_MANIFEST_NAME,
    latest_verified_folder,
    write_folder_manifest,
)

DEEP = b"[" * 200_000 + b"]" * 200_000


def test_a_deeply_nested_dcp_manifest_is_damage_and_restore_falls_back(tmp_path: Path) -> None:
    run = tmp_path / "run"
    save_locally(run, steps=(2, 4))
    (run / "step-00000004" / "manifest.json").write_bytes(DEEP)
    restored, _ = restore_locally(run)
    assert restored.step == 2
    assert "nested too deeply" in restored.skipped[0]["reason"]


def test_a_deeply_nested_hf_folder_manifest_is_damage_and_the_older_folder_is_chosen(tmp_path: Path) -> None:
    for step in (2, 4):
        folder = tmp_path / f"checkpoint-{step}"
        folder.mkdir()
        (folder / "model.safetensors").write_bytes(b"w" * 64)
        write_folder_manifest(folder, step=step)
    (tmp_path / "checkpoint-4" / FOLDER_MANIFEST_NAME).write_bytes(DEEP)
    assert latest_verified_folder(tmp_path) == tmp_path / "checkpoint-2"


@pytest.mark.parametrize("victim", ["manifest.json", ".metadata"])
def test_an_io_error_reading_a_dcp_record_is_damage_and_restore_falls_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, victim: str
) -> None:
    run = tmp_path / "run"
    save_locally(run, steps=(2, 4))
    target = str(run / "step-00000004" / victim)
    real_read = os.read

    def failing_read(fd: int, n: int) -> bytes:
        # Fault injection at the OS boundary: a bad sector under one file (no real disk fails on cue).
        if os.readlink(f"/proc/self/fd/{fd}") == target:
            raise OSError(errno.EIO, "Input/output error")
        return real_read(fd, n)

    monkeypatch.setattr(os, "read", failing_read)
    restored, _ = restore_locally(run)
    assert restored.step == 2
    assert victim in restored.skipped[0]["reason"]


def test_two_ranks_agree_on_damaged_records_and_fall_back_together(tmp_path: Path) -> None:
    good = tmp_path / "good"
    assert launch(w_save_steps, 2, tmp_path, str(good), [2, 4]) == [0, 0]
    deep, renamed = tmp_path / "deep", tmp_path / "renamed"
    shutil.copytree(good, deep)
    (deep / "step-00000004" / "manifest.json").write_bytes(DEEP)
    shutil.copytree(good, renamed)
    shutil.copytree(renamed / "step-00000002", renamed / "step-00000006")
    assert launch(w_restore_report, 2, tmp_path, str(tmp_path), ["deep", "renamed"]) == [0, 0]
    for name, step, skipped in (("deep", 2, 4), ("renamed", 4, 6)):
        reports = [json.loads((tmp_path / f"{name}-rank{r}.json").read_text()) for r in (0, 1)]
        assert reports[0] == reports[1], name  # the same verdict on every rank
        assert reports[0]["step"] == step and [s["step"] for s in reports[0]["skipped"]] == [skipped]


def test_eio_on_a_dcp_record_on_one_rank_only_is_damage_and_both_ranks_fall_back_together(
    tmp_path: Path,
) -> None:
    good = tmp_path / "good"
    assert launch(w_save_steps, 2, tmp_path, str(good), [2, 4]) == [0, 0]
    cases = [
        ("manifest-r1", 1, "manifest.json"),
        ("metadata-r1", 1, ".metadata"),
        ("metadata-r0", 0, ".metadata"),
    ]
    for name, _, _ in cases:
        shutil.copytree(good, tmp_path / name)
    # Without agreement the rank that hit EIO would raise (or skip) alone and the other would wait
    # in a collective until gloo gave up: the job would end with a nonzero exit code on both ranks.
    assert launch(w_restore_report_with_eio, 2, tmp_path, str(tmp_path), cases) == [0, 0]
    for name, victim_rank, victim in cases:
        reports = [json.loads((tmp_path / f"{name}-rank{r}.json").read_text()) for r in (0, 1)]
        assert reports[0] == reports[1], name  # the same verdict, from the same gathered findings
        assert reports[0]["step"] == 2, reports[0]
        (skipped,) = reports[0]["skipped"]
        assert skipped["step"] == 4 and skipped["status"] == "corrupt", skipped
        reason = skipped["reason"]
        assert victim in reason and "Input/output error" in reason, reason
        assert f"rank {victim_rank}: " in reason and f"rank {1 - victim_rank}: " not in reason, reason
