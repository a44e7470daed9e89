"""``publish="marker"``: a multi-rank save without a rename, committed by a marker written last.

Most checks run the manager as a world of one (no process group), which writes
the same files; the kills are real SIGKILLs of 2 ranks through the package's
fault campaign (:mod:`ckpt_lesson.faults.rank_chaos`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from _distributed_local import restore_locally, save_locally

from ckpt_lesson import CheckpointError
from ckpt_lesson.distributed import DistributedCheckpointManager
from ckpt_lesson.faults.rank_chaos import RankKill, run_rank_campaign
from ckpt_lesson.files.hashing import hash_bytes
from ckpt_lesson.files.record_seal import seal_record
from ckpt_lesson.runs.commit import COMMIT_MARKER, MARKER_LOCK, open_marker_folder
from ckpt_lesson.runs.marker_cleanup import clean_unmarked
from ckpt_lesson.runs.scan import scan_checkpoints

STEP2, STEP4 = "step-00000002", "step-00000004"


def _statuses(run: Path) -> dict[int, tuple[str, str]]:
    return {r.step: (r.status, r.reason) for r in scan_checkpoints(run)}


def _marker(run: Path, step_dir: str) -> dict[str, Any]:
    return json.loads((run / step_dir / COMMIT_MARKER).read_text())


def test_a_distributed_marker_save_is_written_in_place_and_its_marker_names_the_manifest_written_last(
    tmp_path: Path,
) -> None:
    seen: list[tuple[str, bool, bool]] = []

    def watch(name: str, info: dict[str, Any]) -> None:
        folder = tmp_path / "run" / STEP4
        staging = any(p.name.startswith(".staging") for p in (tmp_path / "run").iterdir())
        seen.append((name, staging, (folder / COMMIT_MARKER).exists()))

    save_locally(tmp_path / "run", steps=(2, 4), publish="marker", on_event=watch)
    events = [(n, s, m) for n, s, m in seen if n in ("file_written", "manifest_written", "published")]
    assert not any(staging for _, staging, _ in seen)  # never a staging folder
    assert [m for n, _, m in events if n == "manifest_written"][-1] is False  # marker after the manifest
    assert events[-1] == ("published", False, True)
    folder = tmp_path / "run" / STEP4
    raw = (folder / "manifest.json").read_bytes()
    marker = _marker(tmp_path / "run", STEP4)
    assert json.loads(raw)["publish"] == "marker"
    assert marker["manifest"] == hash_bytes(raw, marker["manifest"]["algo"])
    assert _statuses(tmp_path / "run") == {2: ("ok", ""), 4: ("ok", "")}
    assert restore_locally(tmp_path / "run")[0].step == 4


def test_a_distributed_marker_save_without_its_marker_is_incomplete_and_restore_falls_back(
    tmp_path: Path,
) -> None:
    # The disk state a kill between manifest and marker leaves (the real kills are below).
    run = tmp_path / "run"
    save_locally(run, steps=(2, 4), publish="marker")
    (run / STEP4 / COMMIT_MARKER).unlink()
    (run / STEP4 / MARKER_LOCK).touch()  # the writer held it until the kill; now nobody does
    assert _statuses(run)[4] == ("incomplete", f"no {COMMIT_MARKER} (save never finished)")
    restored, _ = restore_locally(run)
    assert restored.step == 2
    # Its writer is gone, but it holds a manifest: moved aside (kept for a person), never deleted.
    [aside] = [p for p in run.iterdir() if p.name.startswith(f".quarantine-{STEP4}-")]
    assert not (run / STEP4).exists() and (aside / "manifest.json").is_file()


@pytest.mark.parametrize("forge", ["other_digest", "other_save"])
def test_a_distributed_marker_naming_a_different_manifest_is_refused_and_restore_falls_back(
    tmp_path: Path, forge: str
) -> None:
    run = tmp_path / "run"
    save_locally(run, steps=(2, 4), publish="marker")
    if forge == "other_digest":
        marker = _marker(run, STEP4)
        marker["manifest"]["digest"] = "0" * len(marker["manifest"]["digest"])
        (run / STEP4 / COMMIT_MARKER).write_text(
            json.dumps(seal_record(marker))
        )  # sealed: only the name differs
    else:  # step 2's valid marker copied beside step 4's manifest
        (run / STEP4 / COMMIT_MARKER).write_bytes((run / STEP2 / COMMIT_MARKER).read_bytes())
    status, reason = _statuses(run)[4]
    assert status == "corrupt" and reason.startswith(f"{STEP4}/{COMMIT_MARKER}: names manifest")
    restored, _ = restore_locally(run)
    assert restored.step == 2
    [skipped] = restored.skipped
    assert skipped["status"] == "corrupt" and "not committed" in skipped["reason"]


def test_a_distributed_marker_with_a_broken_seal_is_corrupt(tmp_path: Path) -> None:
    run = tmp_path / "run"
    save_locally(run, steps=(2, 4), publish="marker")
    marker = _marker(run, STEP4)
    marker["step"] = 2
    (run / STEP4 / COMMIT_MARKER).write_text(json.dumps(marker))
    assert _statuses(run)[4][0] == "corrupt"


def test_a_failed_distributed_marker_save_removes_its_folder_and_the_previous_save_stays(
    tmp_path: Path,
) -> None:
    def fail_before_marker(name: str, info: dict[str, Any]) -> None:
        if name == "manifest_written" and info["step"] == 4:
            raise OSError("disk full")

    with pytest.raises(CheckpointError):
        save_locally(tmp_path / "run", steps=(2, 4), publish="marker", on_event=fail_before_marker)
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == [STEP2]


def test_the_unmarked_cleaner_spares_a_live_writer_and_every_rename_mode_save(tmp_path: Path) -> None:
    save_locally(tmp_path / "renamed", steps=(2,))
    assert clean_unmarked(tmp_path / "renamed") == []
    (tmp_path / "live").mkdir()
    with open_marker_folder(tmp_path / "live" / STEP4) as folder:
        assert (folder / MARKER_LOCK).exists()
        assert clean_unmarked(tmp_path / "live") == []  # its lock is held
    assert clean_unmarked(tmp_path / "live") == [STEP4]  # its writer left without a marker
    assert not (tmp_path / "live" / STEP4).exists()


def test_the_publish_option_is_validated(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match=r"publish must be one of \('rename', 'marker'\), got 'copy'"):
        DistributedCheckpointManager(tmp_path, every_steps=1, publish="copy")


def test_after_real_kills_before_the_marker_every_distributed_rank_restores_the_previous_save(
    tmp_path: Path,
) -> None:
    kills = [
        RankKill("before_publish", "all", publish="marker"),
        RankKill("before_publish", "others", publish="marker"),
    ]
    result = run_rank_campaign(kills, world=2, workdir=tmp_path)
    assert result.ok, result.table()
    lost, kept = result.outcomes
    assert [r["step"] for r in lost.restored] == [2, 2]  # killed between manifest and marker
    assert lost.restored[0]["staging_before"] == [STEP4] and lost.restored[0]["staging_after"] == []
    assert [r["step"] for r in kept.restored] == [4, 4]  # rank 0 lived to write the marker
