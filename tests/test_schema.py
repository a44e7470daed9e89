"""Schema versions: migrations are pure, unknown ones refused; a save's step must match its folder's name."""

from __future__ import annotations

import copy
import shutil
from pathlib import Path

import pytest
from _distributed_local import restore_locally, save_locally

from ckpt_lesson.errors import CorruptCheckpointError, SchemaError
from ckpt_lesson.files.schema import (
    CURRENT_SCHEMA,
    KNOWN_SCHEMAS,
    MIGRATIONS,
    SCHEMA_V1,
    SCHEMA_V2,
    check_recorded_step,
    current_env,
    folder_name_step,
    migrate_payload,
    migrate_v1_to_v2,
)
from ckpt_lesson.runs.folder_manifest import latest_verified_folder, verify_folder, write_folder_manifest
from ckpt_lesson.runs.scan import scan_checkpoints


def v1_payload() -> dict:
    return {
        "schema": SCHEMA_V1,
        "model": {"w": [1.0, 2.0]},
        "optimizer": {"state": {}, "param_groups": []},
        "scheduler": None,
        "state": {"step": 3, "epoch": 0, "batch_in_epoch": 3, "losses": [1.0, 0.5, 0.25]},
        "rng": {"python": {"state": [1, 2, 3]}},
        "wall_saved_at": 1700000000.0,
    }


def test_migrate_v1_to_v2_does_not_modify_its_input():
    original = v1_payload()
    pristine = copy.deepcopy(original)
    migrated = migrate_v1_to_v2(original)
    assert original == pristine
    assert migrated is not original


def test_migrate_v1_to_v2_adds_explicitly_unrecorded_blocks_and_keeps_everything_else():
    migrated = migrate_v1_to_v2(v1_payload())
    assert migrated["schema"] == SCHEMA_V2
    assert migrated["env"] == {"recorded": False}
    assert migrated["data"] == {"recorded": False, "fingerprint": None, "order_seed": None}
    assert migrated["extras"] is None
    for key, value in v1_payload().items():
        if key != "schema":
            assert migrated[key] == value


def test_migrate_v1_to_v2_keeps_existing_extras():
    assert migrate_v1_to_v2({**v1_payload(), "extras": {"a": 1}})["extras"] == {"a": 1}


@pytest.mark.parametrize("payload", [{"schema": SCHEMA_V2}, {}, [1, 2], None], ids=repr)
def test_migrate_v1_to_v2_refuses_anything_but_v1(payload):
    with pytest.raises(SchemaError, match="expects schema"):
        migrate_v1_to_v2(payload)


def test_migrate_payload_returns_a_current_payload_unchanged_and_is_idempotent():
    current = migrate_payload(v1_payload())
    snapshot = copy.deepcopy(current)
    again = migrate_payload(current)
    assert again == snapshot and current == snapshot
    assert migrate_payload(again) == snapshot


def test_migrate_payload_lifts_v1_to_the_current_schema_without_touching_the_input():
    original = v1_payload()
    lifted = migrate_payload(original, source="old.pt")
    assert lifted["schema"] == CURRENT_SCHEMA
    assert original["schema"] == SCHEMA_V1


@pytest.mark.parametrize(
    "payload, words",
    [
        ([1, 2], "not a dict"),
        ({"model": {}}, "no 'schema' field"),
        ({"schema": "ckpt.v3"}, "upgrade ckpt_lesson"),
        ({"schema": "something.else"}, "not a ckpt_lesson checkpoint"),
        ({"schema": 2}, "unknown schema"),
    ],
)
def test_migrate_payload_refuses_and_names_the_source(payload, words):
    with pytest.raises(SchemaError, match=words) as info:
        migrate_payload(payload, source="runs/ckpt.pt")
    assert "runs/ckpt.pt" in str(info.value)


def test_every_known_schema_but_the_current_one_has_a_migration_and_the_chain_ends():
    assert KNOWN_SCHEMAS[-1] == CURRENT_SCHEMA
    assert set(MIGRATIONS) == set(KNOWN_SCHEMAS[:-1])
    for schema in MIGRATIONS:
        lifted = MIGRATIONS[schema]({**v1_payload(), "schema": schema})
        assert KNOWN_SCHEMAS.index(lifted["schema"]) == KNOWN_SCHEMAS.index(schema) + 1


def test_current_env_records_versions_and_world_size():
    env = current_env(world_size=4)
    assert set(env) == {"torch", "numpy", "python", "device_type", "world_size"}
    assert env["world_size"] == 4 and env["device_type"] in {"cpu", "cuda"}
    assert all(isinstance(env[k], str) for k in ("torch", "numpy", "python"))


def test_migrate_payload_refuses_a_known_schema_without_a_registered_migration(monkeypatch):
    import ckpt_lesson.files.schema as schema

    monkeypatch.setattr(schema, "MIGRATIONS", {})
    with pytest.raises(SchemaError, match="no migration registered"):
        schema.migrate_payload({"schema": schema.SCHEMA_V1}, source="old.pt")


def test_migrate_payload_stops_a_migration_that_never_advances_the_schema(monkeypatch):
    import ckpt_lesson.files.schema as schema

    monkeypatch.setattr(schema, "MIGRATIONS", {schema.SCHEMA_V1: lambda p: dict(p)})
    with pytest.raises(SchemaError, match="does not advance"):
        schema.migrate_payload({"schema": schema.SCHEMA_V1}, source="old.pt")


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
