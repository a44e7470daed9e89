"""``scan_checkpoints`` and ``python -m ckpt_lesson scan`` on multi-rank (DCP) saves.

The saves come from the distributed manager run as a world of one (no process
group): its files and manifest have the same layout as a 2-rank save, with
fewer data files.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from _distributed_local import flip_byte, save_locally

from ckpt_lesson import cli
from ckpt_lesson.errors import SchemaError
from ckpt_lesson.files.record_seal import seal_record
from ckpt_lesson.runs.layout import inspect_save, read_manifest
from ckpt_lesson.runs.manager import CheckpointManager
from ckpt_lesson.runs.scan import scan_checkpoints


def _statuses(run: Path) -> dict[int, tuple[str, str]]:
    return {r.step: (r.status, r.reason) for r in scan_checkpoints(run)}


def test_scan_lists_good_distributed_saves_as_ok(tmp_path: Path) -> None:
    save_locally(tmp_path / "run", steps=(2, 4))
    assert _statuses(tmp_path / "run") == {2: ("ok", ""), 4: ("ok", "")}


def test_scan_calls_a_distributed_save_with_a_flipped_data_byte_corrupt_and_names_the_file(
    tmp_path: Path,
) -> None:
    save_locally(tmp_path / "run", steps=(2, 4))
    data = sorted((tmp_path / "run" / "step-00000004").glob("*.distcp"))[0]
    flip_byte(data)
    status, reason = _statuses(tmp_path / "run")[4]
    assert status == "corrupt"
    assert reason.startswith(f"{data.name}: xxh3_128")
    assert _statuses(tmp_path / "run")[2] == ("ok", "")


def test_scan_calls_a_distributed_save_with_a_changed_metadata_file_corrupt(tmp_path: Path) -> None:
    save_locally(tmp_path / "run", steps=(2,))
    flip_byte(tmp_path / "run" / "step-00000002" / ".metadata")
    assert _statuses(tmp_path / "run")[2][0] == "corrupt"


def test_scan_calls_a_distributed_save_with_a_missing_data_file_incomplete(tmp_path: Path) -> None:
    save_locally(tmp_path / "run", steps=(2,))
    data = sorted((tmp_path / "run" / "step-00000002").glob("*.distcp"))[0]
    data.unlink()
    assert _statuses(tmp_path / "run")[2] == ("incomplete", f"{data.name}: missing")


def test_scan_calls_a_distributed_save_without_its_manifest_incomplete(tmp_path: Path) -> None:
    save_locally(tmp_path / "run", steps=(2,))
    (tmp_path / "run" / "step-00000002" / "manifest.json").unlink()
    assert _statuses(tmp_path / "run")[2][0] == "incomplete"


def test_scan_calls_a_malformed_distributed_manifest_corrupt(tmp_path: Path) -> None:
    save_locally(tmp_path / "run", steps=(2,))
    path = tmp_path / "run" / "step-00000002" / "manifest.json"
    manifest = json.loads(path.read_text())
    manifest["world_size"] = 0
    path.write_text(json.dumps(seal_record(manifest)))  # sealed again: structure, not the seal, is tested
    status, reason = _statuses(tmp_path / "run")[2]
    assert (status, "'world_size'" in reason) == ("corrupt", True)


def test_scan_calls_a_distributed_manifest_without_its_seal_corrupt(tmp_path: Path) -> None:
    save_locally(tmp_path / "run", steps=(2, 4))
    path = tmp_path / "run" / "step-00000004" / "manifest.json"
    manifest = json.loads(path.read_text())
    del manifest["record_digest"]
    path.write_text(json.dumps(manifest))
    status, reason = _statuses(tmp_path / "run")[4]
    assert (status, "without its checksum" in reason) == ("corrupt", True)
    assert _statuses(tmp_path / "run")[2] == ("ok", "")


def test_a_size_only_inspection_of_a_distributed_save_reads_no_data(tmp_path: Path) -> None:
    # hash_parts=False is the cheap check the single-process manager uses for retention:
    # a same-size flip passes it, a truncation does not.
    save_locally(tmp_path / "run", steps=(2,))
    folder = tmp_path / "run" / "step-00000002"
    data = sorted(folder.glob("*.distcp"))[0]
    flip_byte(data)
    assert inspect_save(folder, hash_parts=False)[0].ok
    data.write_bytes(data.read_bytes()[:-1])
    assert inspect_save(folder, hash_parts=False)[0].status == "corrupt"


def test_a_manifest_of_neither_layout_still_raises_the_first_schema_error(tmp_path: Path) -> None:
    save_locally(tmp_path / "run", steps=(2,))
    folder = tmp_path / "run" / "step-00000002"
    manifest = json.loads((folder / "manifest.json").read_text())
    (folder / "manifest.json").write_text(json.dumps(seal_record({**manifest, "schema": "ckpt.manifest.v9"})))
    with pytest.raises(SchemaError, match="unknown manifest schema 'ckpt.manifest.v9'"):
        inspect_save(folder)


def test_reading_a_distributed_save_as_a_single_process_one_names_the_right_manager(tmp_path: Path) -> None:
    save_locally(tmp_path / "run", steps=(2,))
    with pytest.raises(SchemaError, match="restore it with DistributedCheckpointManager"):
        read_manifest(tmp_path / "run" / "step-00000002")


def test_the_single_process_manager_refuses_a_distributed_run_directory_by_name(tmp_path: Path) -> None:
    save_locally(tmp_path / "run", steps=(2,))
    model, opt = _tiny_model_and_optimizer()
    with pytest.raises(SchemaError, match="DistributedCheckpointManager"):
        CheckpointManager(tmp_path / "run", every_steps=2).restore_latest(model, opt, None)


def test_the_scan_command_prints_distributed_saves_and_exits_1_on_damage(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    save_locally(tmp_path / "run", steps=(2, 4))
    assert cli.main(["scan", str(tmp_path / "run")]) == 0
    assert "2 save(s): 2 ok, 0 corrupt, 0 incomplete" in capsys.readouterr().out
    shutil.rmtree(tmp_path / "run" / "step-00000004")
    flip_byte(sorted((tmp_path / "run" / "step-00000002").glob("*.distcp"))[0])
    assert cli.main(["scan", str(tmp_path / "run"), "--json"]) == 1
    rows = json.loads(capsys.readouterr().out)
    assert [(r["step"], r["status"]) for r in rows] == [(2, "corrupt")]


def _tiny_model_and_optimizer():
    import torch

    model = torch.nn.Linear(2, 1)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)
