"""Every save's step is checked against its folder's name: DCP manifests and HF folder manifests."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from _distributed_local import restore_locally, save_locally

from ckpt_lesson.errors import CorruptCheckpointError
from ckpt_lesson.files.step_names import check_recorded_step, folder_name_step
from ckpt_lesson.runs.folder_manifest import latest_verified_folder, verify_folder, write_folder_manifest
from ckpt_lesson.runs.scan import scan_checkpoints


def test_a_dcp_save_copied_under_a_newer_name_is_skipped_and_the_next_save_of_that_step_succeeds(
    tmp_path: Path,
) -> None:
    run = tmp_path / "run"
    save_locally(run, steps=(2, 4))
    shutil.copytree(run / "step-00000002", run / "step-00000006")  # a step-2 save under step 6's name
    restored, _ = restore_locally(run)
    assert restored.step == 4
    [skipped] = restored.skipped
    assert skipped["step"] == 6 and "records step 2" in skipped["reason"]
    save_locally(run, steps=(6,))  # not refused as "already saved": the impostor is moved aside
    assert restore_locally(run)[0].step == 6
    assert [p for p in run.iterdir() if p.name.startswith(".quarantine-step-00000006-")]


def test_a_hf_folder_copied_under_a_newer_name_is_skipped(tmp_path: Path) -> None:
    out = tmp_path / "out"
    for step in (2, 4):
        folder = out / f"checkpoint-{step}"
        folder.mkdir(parents=True)
        (folder / "model.safetensors").write_bytes(bytes([step]) * 64)
        write_folder_manifest(folder, step=step)
    shutil.copytree(out / "checkpoint-2", out / "checkpoint-6")
    assert "records step 2" in (verify_folder(out / "checkpoint-6") or "")
    assert latest_verified_folder(out) == out / "checkpoint-4"
    assert {r.step: r.status for r in scan_checkpoints(out)}[6] == "corrupt"


@pytest.mark.parametrize("recorded", [2, "6", 6.0, None, True])
def test_a_recorded_step_that_is_not_exactly_the_folder_step_is_refused(recorded: object) -> None:
    with pytest.raises(CorruptCheckpointError, match="step-00000006/manifest.json: records step"):
        check_recorded_step(recorded, Path("run/step-00000006"), record="manifest.json")


def test_only_names_that_carry_a_step_are_checked() -> None:
    check_recorded_step(2, Path("run/.staging-step-00000006-1-ab"), record="manifest.json")
    assert folder_name_step("checkpoint-12") == 12 and folder_name_step("step-6") is None
