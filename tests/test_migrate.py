"""Tests for file-level migration (ckpt_lesson.files.migrate) and the legacy v1 writer."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest
import torch

from ckpt_lesson import cli
from ckpt_lesson.course.training import (
    SyntheticRegression,
    make_model,
    make_optimizer_and_scheduler,
    seed_everything,
    train,
)
from ckpt_lesson.errors import CheckpointError, CorruptCheckpointError, SchemaError, StateMismatchError
from ckpt_lesson.files import schema
from ckpt_lesson.files.checkpoint import TrainState, load_checkpoint, load_verified_file, read_checkpoint
from ckpt_lesson.files.integrity import file_digest
from ckpt_lesson.files.migrate import migrate_file, write_legacy_v1_checkpoint

SEED = 11
SPLIT = 6
TOTAL = 12


def _setup():
    seed_everything(SEED)
    data = SyntheticRegression(n=64, seed=SEED)
    model = make_model()
    optimizer, scheduler = make_optimizer_and_scheduler(model, total_steps=TOTAL)
    return data, model, optimizer, scheduler


def _legacy_run(path: Path) -> list[float]:
    """Train to SPLIT, write a v1 file, train on to TOTAL; return the losses after SPLIT."""
    data, model, optimizer, scheduler = _setup()
    state = TrainState()
    train(model, optimizer, scheduler, state, data, until_step=SPLIT, seed=SEED)
    write_legacy_v1_checkpoint(model, optimizer, scheduler, state, path)
    records = train(model, optimizer, scheduler, state, data, until_step=TOTAL, seed=SEED)
    return [r.loss for r in records]


def _resume(path: Path) -> tuple[TrainState, list[float]]:
    data, model, optimizer, scheduler = _setup()
    state = load_checkpoint(path, model, optimizer, scheduler)
    records = train(model, optimizer, scheduler, state, data, until_step=TOTAL, seed=SEED)
    return state, [r.loss for r in records]


@pytest.fixture
def legacy(tmp_path: Path) -> tuple[Path, list[float]]:
    path = tmp_path / "last.pt"
    return path, _legacy_run(path)


def _flip_byte_in_tensor_data(path: Path) -> None:
    # The middle of a small checkpoint is tensor bytes: torch.load would not notice a flip there.
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    path.write_bytes(bytes(raw))


def test_legacy_v1_file_is_plain_torch_save_with_v1_schema_and_no_footer(legacy):
    path, _ = legacy
    payload, digest = load_verified_file(path)
    assert payload["schema"] == schema.SCHEMA_V1
    assert "env" not in payload and "data" not in payload
    assert not digest.has_footer


def test_legacy_v1_file_loads_with_a_warning_and_resumes_bit_for_bit(legacy, caplog):
    path, expected = legacy
    with caplog.at_level(logging.WARNING, logger="ckpt_lesson.files.checkpoint"):
        state, losses = _resume(path)
    assert any("legacy v1 checkpoint with no integrity record" in r.getMessage() for r in caplog.records)
    assert state.step == TOTAL
    assert losses == expected


def test_migrate_file_keeps_the_original_bytes_as_a_backup(legacy):
    path, _ = legacy
    before = path.read_bytes()
    result = migrate_file(path)
    assert result.backup == path.with_name("last.pt.v1.bak")
    assert result.backup.read_bytes() == before
    assert (result.from_schema, result.to_schema, result.changed) == ("ckpt.v1", "ckpt.v2", True)


def test_migrated_file_is_v2_with_an_integrity_footer(legacy):
    path, _ = legacy
    migrate_file(path)
    payload, digest = load_verified_file(path)
    assert payload["schema"] == schema.SCHEMA_V2
    assert payload["env"] == {"recorded": False}
    assert payload["data"]["recorded"] is False
    assert digest.has_footer


def test_migrated_file_loads_without_warning_and_resumes_bit_for_bit(legacy, caplog):
    path, expected = legacy
    migrate_file(path)
    with caplog.at_level(logging.WARNING):
        state, losses = _resume(path)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert state.step == TOTAL
    assert losses == expected


def test_migrated_file_holds_exactly_the_state_of_the_original(legacy):
    path, _ = legacy
    old = read_checkpoint(path)
    migrate_file(path)
    new = read_checkpoint(path)
    assert new["state"] == old["state"]
    assert new["wall_saved_at"] == old["wall_saved_at"]
    assert new["model"].keys() == old["model"].keys()
    assert all(torch.equal(new["model"][k], old["model"][k]) for k in old["model"])
    assert torch.equal(new["rng"]["torch_cpu"], old["rng"]["torch_cpu"])


def test_a_byte_flipped_after_migration_is_detected_on_load(legacy):
    path, _ = legacy
    migrate_file(path)
    _flip_byte_in_tensor_data(path)
    _, model, optimizer, scheduler = _setup()
    with pytest.raises(CorruptCheckpointError, match="footer"):
        load_checkpoint(path, model, optimizer, scheduler)


def test_migrating_twice_says_already_current_and_changes_nothing(legacy):
    path, _ = legacy
    migrate_file(path)
    after_first = path.read_bytes()
    result = migrate_file(path)
    assert (result.changed, result.backup, result.from_schema, result.to_schema) == (
        False,
        None,
        "ckpt.v2",
        "ckpt.v2",
    )
    assert path.read_bytes() == after_first


def test_migrate_refuses_to_overwrite_an_existing_backup(legacy):
    path, _ = legacy
    before = path.read_bytes()
    path.with_name("last.pt.v1.bak").write_bytes(b"an older backup")
    with pytest.raises(CheckpointError, match="never overwritten"):
        migrate_file(path)
    assert path.read_bytes() == before
    assert path.with_name("last.pt.v1.bak").read_bytes() == b"an older backup"


def test_rerunning_an_interrupted_migration_reuses_its_identical_backup(legacy):
    # A kill after the backup was made but before the file was replaced leaves exactly this.
    path, expected = legacy
    before = path.read_bytes()
    os.link(path, path.with_name("last.pt.v1.bak"))
    result = migrate_file(path)
    assert result.changed and result.backup is not None
    assert result.backup.read_bytes() == before
    assert load_verified_file(path)[0]["schema"] == "ckpt.v2"
    assert _resume(path)[1] == expected


@pytest.mark.parametrize("record", ["manifest.json", "index.json"])
def test_migrate_refuses_a_file_whose_sha256_a_manifest_or_index_records(legacy, record):
    path, _ = legacy
    before = path.read_bytes()
    (path.parent / record).write_text("{}")
    with pytest.raises(CheckpointError, match=f"recorded in {record}"):
        migrate_file(path)
    assert path.read_bytes() == before
    assert not path.with_name("last.pt.v1.bak").exists()


def test_migrate_uses_the_given_backup_suffix(legacy):
    path, _ = legacy
    result = migrate_file(path, backup_suffix=".orig")
    assert result.backup is not None and result.backup.name == "last.pt.orig"


def test_migrate_falls_back_to_an_fsynced_copy_where_hard_links_fail(legacy, monkeypatch):
    path, _ = legacy
    before = path.read_bytes()

    def no_links(src, dst, **kwargs):
        raise PermissionError("hard links not allowed here")

    monkeypatch.setattr(os, "link", no_links)
    result = migrate_file(path)
    assert result.backup is not None and result.backup.read_bytes() == before
    assert load_verified_file(path)[0]["schema"] == "ckpt.v2"


def test_migrate_refuses_an_unknown_newer_schema_and_changes_nothing(tmp_path):
    path = tmp_path / "future.pt"
    torch.save({"schema": "ckpt.v9", "model": {}}, path)
    before = path.read_bytes()
    with pytest.raises(SchemaError, match="ckpt.v9"):
        migrate_file(path)
    assert path.read_bytes() == before
    assert not path.with_name("future.pt.v1.bak").exists()


def test_migrate_refuses_a_payload_without_schema(tmp_path):
    path = tmp_path / "noschema.pt"
    torch.save({"model": {"w": torch.zeros(2)}}, path)
    with pytest.raises(SchemaError, match="no 'schema' field"):
        migrate_file(path)


def test_migrate_refuses_a_v1_payload_missing_a_bucket(tmp_path):
    path = tmp_path / "partial.pt"
    torch.save({"schema": "ckpt.v1", "model": {"w": torch.zeros(2)}}, path)
    with pytest.raises(StateMismatchError, match="lacks"):
        migrate_file(path)
    assert not path.with_name("partial.pt.v1.bak").exists()


def test_migrate_refuses_a_v2_file_that_lost_its_footer(tmp_path):
    path = tmp_path / "stripped.pt"
    torch.save({"schema": "ckpt.v2", "model": {}}, path)
    with pytest.raises(CorruptCheckpointError, match="footer"):
        migrate_file(path)


def test_migrate_refuses_a_missing_path_a_directory_and_a_non_checkpoint(tmp_path):
    with pytest.raises(CheckpointError, match="no such checkpoint file"):
        migrate_file(tmp_path / "absent.pt")
    with pytest.raises(CheckpointError, match="is a directory"):
        migrate_file(tmp_path)
    text = tmp_path / "notes.txt"
    text.write_text("not a checkpoint\n")
    with pytest.raises(CorruptCheckpointError, match="not a torch.save archive"):
        migrate_file(text)


def test_migration_registry_chains_through_a_registered_v3(legacy, monkeypatch):
    # A v3 is one more pure function in the registry; nothing else changes.
    path, _ = legacy

    def v2_to_v3(payload):
        out = dict(payload)
        out["schema"] = "ckpt.v3"
        out["provenance"] = {"migrated": True}
        return out

    monkeypatch.setattr(schema, "KNOWN_SCHEMAS", (*schema.KNOWN_SCHEMAS, "ckpt.v3"))
    monkeypatch.setattr(schema, "CURRENT_SCHEMA", "ckpt.v3")
    monkeypatch.setitem(schema.MIGRATIONS, "ckpt.v2", v2_to_v3)
    v1 = load_verified_file(path)[0]
    lifted = schema.migrate_payload(v1)
    assert lifted["schema"] == "ckpt.v3"
    assert lifted["env"] == {"recorded": False}  # the v1 -> v2 step ran first
    assert lifted["provenance"] == {"migrated": True}
    assert v1["schema"] == "ckpt.v1"  # migrations are pure
    result = migrate_file(path)
    assert (result.from_schema, result.to_schema) == ("ckpt.v1", "ckpt.v3")
    assert load_verified_file(path)[0]["schema"] == "ckpt.v3"


@pytest.fixture
def only_migrate_command(monkeypatch):
    # cli.main imports every command's module to build its parser; keep these tests about
    # `migrate` alone, so a sibling command that is broken or half-written cannot fail them.
    monkeypatch.setattr(cli, "COMMANDS", {"migrate": cli.COMMANDS["migrate"]})


def test_cli_migrate_help_exits_zero(only_migrate_command, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["migrate", "--help"])
    assert exc.value.code == 0
    assert "--backup-suffix" in capsys.readouterr().out


def test_cli_migrate_reports_what_it_did_then_already_current(only_migrate_command, legacy, capsys):
    path, _ = legacy
    assert cli.main(["migrate", str(path)]) == 0
    out = capsys.readouterr().out
    assert "ckpt.v1 -> ckpt.v2" in out and "last.pt.v1.bak" in out
    assert cli.main(["migrate", str(path)]) == 0
    assert "already current" in capsys.readouterr().out


def test_cli_migrate_exits_2_with_an_error_for_a_missing_path(only_migrate_command, tmp_path, capsys):
    assert cli.main(["migrate", str(tmp_path / "absent.pt")]) == 2
    assert capsys.readouterr().err.startswith("error: ")


def test_cli_migrate_exits_2_with_an_error_for_a_non_checkpoint_file(only_migrate_command, tmp_path, capsys):
    text = tmp_path / "notes.txt"
    text.write_text("not a checkpoint\n")
    assert cli.main(["migrate", str(text)]) == 2
    assert "not a torch.save archive" in capsys.readouterr().err
    assert text.read_text() == "not a checkpoint\n"


def test_migrated_file_digest_matches_its_footer(legacy):
    path, _ = legacy
    migrate_file(path)
    digest = file_digest(path)
    assert digest.size == path.stat().st_size
    assert digest.has_footer
