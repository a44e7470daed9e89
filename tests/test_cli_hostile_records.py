"""No CLI path prints a traceback for issue 20's hostile records: scan and report judge them instead."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from _distributed_local import save_locally

from ckpt_lesson.runs.folder_manifest import FOLDER_MANIFEST_NAME, write_folder_manifest

DEEP = b"[" * 200_000 + b"]" * 200_000


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    return subprocess.run(
        [sys.executable, "-m", "ckpt_lesson", *args], capture_output=True, text=True, timeout=300, env=env
    )


@pytest.fixture(scope="module")
def dcp_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run = tmp_path_factory.mktemp("cli") / "run"
    save_locally(run, steps=(2, 4))
    return run


@pytest.mark.parametrize("case", ["deep_manifest", "copied_name", "fifo_metadata"])
def test_scan_reports_a_hostile_dcp_record_as_damage_without_a_traceback(dcp_run, tmp_path, case):
    run = tmp_path / "run"
    shutil.copytree(dcp_run, run)
    if case == "deep_manifest":
        (run / "step-00000004" / "manifest.json").write_bytes(DEEP)
    elif case == "copied_name":
        shutil.copytree(run / "step-00000002", run / "step-00000006")
    else:
        (run / "step-00000004" / ".metadata").unlink()
        os.mkfifo(run / "step-00000004" / ".metadata")
    done = cli("scan", str(run))
    assert "Traceback" not in done.stderr + done.stdout
    assert done.returncode == 1 and "corrupt" in done.stdout


def test_scan_reports_a_deep_hf_folder_manifest_without_a_traceback(tmp_path):
    for step in (2, 4):
        folder = tmp_path / f"checkpoint-{step}"
        folder.mkdir()
        (folder / "model.safetensors").write_bytes(b"w" * 64)
        write_folder_manifest(folder, step=step)
    (tmp_path / "checkpoint-4" / FOLDER_MANIFEST_NAME).write_bytes(DEEP)
    done = cli("scan", str(tmp_path))
    assert "Traceback" not in done.stderr + done.stdout
    assert done.returncode == 1 and "checkpoint-4" in done.stdout


def test_report_on_a_fifo_recovery_log_is_one_line_not_a_hang_or_traceback(tmp_path):
    os.mkfifo(tmp_path / "recovery.jsonl")
    done = cli("report", str(tmp_path))
    assert "Traceback" not in done.stderr + done.stdout
    assert done.returncode in (0, 2)
