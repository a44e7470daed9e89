"""scan_checkpoints / verify_part / read_manifest and the ``scan`` CLI."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from ckpt_lesson import cli
from ckpt_lesson.errors import (
    CheckpointError,
    CorruptCheckpointError,
    IncompleteCheckpointError,
    SchemaError,
    UnsafeCheckpointError,
)
from ckpt_lesson.files.atomic import atomic_write_json
from ckpt_lesson.files.checkpoint import TrainState, save_checkpoint
from ckpt_lesson.files.verify import verify_part, verify_record
from ckpt_lesson.runs.layout import ScanResult, read_manifest, step_dir_name
from ckpt_lesson.runs.scan import scan_checkpoints


def _tiny():
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    return model, opt


def make_save(run_dir: Path, step: int) -> Path:
    """A published single-file save with its manifest, written the way the manager lays it out."""
    step_dir = run_dir / step_dir_name(step)
    step_dir.mkdir(parents=True)
    model, opt = _tiny()
    digest = save_checkpoint(model, opt, None, TrainState(step=step), step_dir / "checkpoint.pt")
    manifest = {
        "schema": "ckpt.manifest.v1",
        "save_id": "0" * 32,
        "step": step,
        "layout": "single",
        "parts": [{"file": "checkpoint.pt", **digest.record()}],
    }
    atomic_write_json(manifest, step_dir / "manifest.json")
    return step_dir


def test_a_save_recorded_with_sha256_by_an_earlier_version_still_scans_ok(tmp_path):
    step_dir = tmp_path / step_dir_name(7)
    step_dir.mkdir()
    model, opt = _tiny()
    digest = save_checkpoint(model, opt, None, TrainState(step=7), step_dir / "checkpoint.pt", algo="sha256")
    part = {"file": "checkpoint.pt", "bytes": digest.size, "sha256": digest.sha256}  # the old record form
    head = {"schema": "ckpt.manifest.v1", "save_id": "0" * 32, "step": 7, "layout": "single"}
    atomic_write_json({**head, "parts": [part]}, step_dir / "manifest.json")
    assert [r.status for r in scan_checkpoints(tmp_path)] == ["ok"]
    flip_byte(step_dir / "checkpoint.pt", 300)
    assert [r.status for r in scan_checkpoints(tmp_path)] == ["corrupt"]


def flip_byte(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


def test_scan_reports_ok_corrupt_and_incomplete_sorted_by_step(tmp_path):
    make_save(tmp_path, 30)
    make_save(tmp_path, 10)
    bad = make_save(tmp_path, 20)
    flip_byte(bad / "checkpoint.pt", 200)
    (tmp_path / step_dir_name(40)).mkdir()  # published folder, manifest never written
    (tmp_path / ".staging-step-00000050-123-deadbeef").mkdir()
    results = scan_checkpoints(tmp_path)
    assert [(r.step, r.status) for r in results] == [
        (10, "ok"),
        (20, "corrupt"),
        (30, "ok"),
        (40, "incomplete"),
        (50, "incomplete"),
    ]
    assert "sha256" in results[1].reason or "footer" in results[1].reason
    assert results[3].reason == "no manifest.json (save never finished)"
    assert results[4].reason == "unpublished save (staging)"
    assert all(isinstance(r, ScanResult) for r in results)


def test_scan_flags_a_truncated_part_with_both_sizes(tmp_path):
    step_dir = make_save(tmp_path, 10)
    part = step_dir / "checkpoint.pt"
    size = part.stat().st_size
    with open(part, "r+b") as f:
        f.truncate(size - 5)
    [result] = scan_checkpoints(tmp_path)
    assert result.status == "corrupt"
    assert result.reason == f"checkpoint.pt: size {size - 5} != recorded {size}"


def test_scan_calls_a_save_with_a_missing_part_incomplete(tmp_path):
    step_dir = make_save(tmp_path, 10)
    (step_dir / "checkpoint.pt").unlink()
    [result] = scan_checkpoints(tmp_path)
    assert (result.status, result.reason) == ("incomplete", "checkpoint.pt: missing")


def test_scan_flags_a_manifest_whose_step_disagrees_with_its_folder(tmp_path):
    make_save(tmp_path, 10).rename(tmp_path / step_dir_name(11))
    [result] = scan_checkpoints(tmp_path)
    assert result.status == "corrupt"
    assert "records step 10" in result.reason


def test_scan_ignores_unrelated_files_and_folders(tmp_path):
    make_save(tmp_path, 10)
    (tmp_path / "notes.txt").write_text("hello")
    (tmp_path / "step-abc").mkdir()
    (tmp_path / ".quarantine-step-00000005-abcdef12").mkdir()
    assert [r.step for r in scan_checkpoints(tmp_path)] == [10]


def test_scan_of_a_missing_or_non_directory_path_raises(tmp_path):
    with pytest.raises(CheckpointError, match="no such run directory"):
        scan_checkpoints(tmp_path / "nope")
    (tmp_path / "file").write_text("x")
    with pytest.raises(CheckpointError, match="not a directory"):
        scan_checkpoints(tmp_path / "file")


def test_verify_part_returns_none_for_a_good_file_and_a_reason_otherwise(tmp_path):
    path = tmp_path / "blob.bin"
    path.write_bytes(b"hello")
    sha = "2cf24dba5fb0a30e26e83b2ac5b9e29e1b161e5c1fa7425e73043362938b9824"
    assert verify_part(path, size=5, sha256=sha) is None
    assert verify_part(path, size=6, sha256=sha) == "blob.bin: size 5 != recorded 6"
    assert verify_part(path, size=5, sha256="0" * 64).startswith("blob.bin: sha256 2cf24dba5fb0")
    assert verify_part(tmp_path / "gone.bin", size=5, sha256=sha) == "gone.bin: missing"


def test_verify_part_notices_a_flipped_byte_even_when_the_size_is_right(tmp_path):
    step_dir = make_save(tmp_path, 10)
    part = read_manifest(step_dir)["parts"][0]
    flip_byte(step_dir / "checkpoint.pt", 100)
    reason = verify_record(step_dir / "checkpoint.pt", part)
    assert reason is not None and reason.startswith("checkpoint.pt:")


def test_verify_part_refuses_a_symlink(tmp_path):
    target = tmp_path / "outside.bin"
    target.write_bytes(b"hello")
    link = tmp_path / "link.bin"
    link.symlink_to(target)
    sha = "2cf24dba5fb0a30e26e83b2ac5b9e29e1b161e5c1fa7425e73043362938b9824"
    assert "symlink" in verify_part(link, size=5, sha256=sha)


def _write_manifest(step_dir: Path, manifest) -> None:
    step_dir.mkdir(parents=True, exist_ok=True)
    (step_dir / "manifest.json").write_text(json.dumps(manifest))


GOOD_PART = {"file": "checkpoint.pt", "bytes": 1, "sha256": "a" * 64}
HEAD = {"schema": "ckpt.manifest.v1", "step": 1, "layout": "single"}


@pytest.mark.parametrize(
    ("manifest", "error", "match"),
    [
        ("not json at all", CorruptCheckpointError, "not valid JSON"),
        ([1, 2], CorruptCheckpointError, "JSON object"),
        ({"step": 1}, CorruptCheckpointError, "no 'schema'"),
        ({"schema": "ckpt.manifest.v9"}, SchemaError, "unknown manifest schema"),
        ({"schema": "ckpt.manifest.v1", "step": -1}, CorruptCheckpointError, "'step'"),
        ({"schema": "ckpt.manifest.v1", "step": 1, "layout": "x"}, CorruptCheckpointError, "'layout'"),
        ({**HEAD, "parts": []}, CorruptCheckpointError, "parts"),
        (
            {**HEAD, "parts": [GOOD_PART, GOOD_PART]},
            CorruptCheckpointError,
            "listed twice",
        ),
        (
            {**HEAD, "parts": [{**GOOD_PART, "bytes": "1"}]},
            CorruptCheckpointError,
            "bytes",
        ),
        (
            {**HEAD, "parts": [{**GOOD_PART, "sha256": "x"}]},
            CorruptCheckpointError,
            "sha256",
        ),
        (
            {**HEAD, "layout": "sharded", "parts": [{**GOOD_PART, "file": "../x"}]},
            UnsafeCheckpointError,
            "not a plain file name",
        ),
        (
            {**HEAD, "parts": [{**GOOD_PART, "file": "a.pt"}]},
            CorruptCheckpointError,
            "must list 'checkpoint.pt'",
        ),
    ],
)
def test_read_manifest_refuses_malformed_manifests_with_the_right_error(tmp_path, manifest, error, match):
    step_dir = tmp_path / "step-00000001"
    step_dir.mkdir()
    text = manifest if isinstance(manifest, str) else json.dumps(manifest)
    (step_dir / "manifest.json").write_text(text)
    with pytest.raises(error, match=match):
        read_manifest(step_dir)


def test_read_manifest_of_a_folder_without_one_is_incomplete(tmp_path):
    with pytest.raises(IncompleteCheckpointError, match="never finished"):
        read_manifest(tmp_path)


def test_scan_cli_exits_0_when_all_saves_are_ok_and_prints_no_paths(tmp_path, capsys):
    make_save(tmp_path, 10)
    make_save(tmp_path, 20)
    assert cli.main(["scan", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert str(tmp_path) not in out
    assert out.splitlines()[-1] == "2 save(s): 2 ok, 0 corrupt, 0 incomplete"
    assert "      10  ok" in out


def test_scan_cli_exits_1_when_a_save_is_corrupt_and_json_lists_every_save(tmp_path, capsys):
    make_save(tmp_path, 10)
    flip_byte(make_save(tmp_path, 20) / "checkpoint.pt", 150)
    assert cli.main(["scan", str(tmp_path), "--json"]) == 1
    rows = json.loads(capsys.readouterr().out)
    assert [(r["step"], r["status"], r["name"]) for r in rows] == [
        (10, "ok", "step-00000010"),
        (20, "corrupt", "step-00000020"),
    ]


def test_scan_cli_exits_1_for_an_unpublished_staging_folder(tmp_path):
    make_save(tmp_path, 10)
    (tmp_path / ".staging-step-00000020-1-abcdef12").mkdir()
    assert cli.main(["scan", str(tmp_path)]) == 1


def test_scan_cli_exits_2_with_a_clear_error_for_a_missing_path_or_a_file(tmp_path, capsys):
    assert cli.main(["scan", str(tmp_path / "missing")]) == 2
    assert "error:" in capsys.readouterr().err
    (tmp_path / "f.pt").write_bytes(b"x")
    assert cli.main(["scan", str(tmp_path / "f.pt")]) == 2
    assert "not a directory" in capsys.readouterr().err


def test_scan_cli_help_describes_the_exit_codes(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["scan", "--help"])
    assert exc.value.code == 0
    assert "Exit status" in capsys.readouterr().out


def test_scan_never_unpickles_anything(tmp_path, monkeypatch):
    make_save(tmp_path, 10)

    def refuse(*args, **kwargs):
        raise AssertionError("scan must not call torch.load")

    monkeypatch.setattr(torch, "load", refuse)
    assert [r.status for r in scan_checkpoints(tmp_path)] == ["ok"]


class _RunsCode:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))  # creates the marker file if ever unpickled


def test_scan_reads_a_lightning_file_s_epoch_and_step_without_running_its_pickle(tmp_path):
    import pickle
    import zipfile

    marker = tmp_path / "unpickled"
    ckdir = tmp_path / "ck"
    ckdir.mkdir()
    payload = {"epoch": 2, "global_step": 300, "loops": {"epoch": 9}, "evil": _RunsCode(marker)}
    with zipfile.ZipFile(ckdir / "crafted.ckpt", "w") as archive:  # stored, like torch.save
        archive.writestr("archive/data.pkl", pickle.dumps(payload, protocol=2))
    ((result),) = scan_checkpoints(ckdir)
    assert (result.status, result.epoch, result.step) == ("unverified", 2, 300)  # the outer keys only
    assert not marker.exists()
