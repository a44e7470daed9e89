"""The manifest: JSON only, validated field by field before anything else is read."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from ckpt_lesson import CorruptCheckpointError, IncompleteCheckpointError, SchemaError, UnsafeCheckpointError
from ckpt_lesson.files.hashing import hash_bytes
from ckpt_lesson.files.record_seal import SEAL_KEY, seal_record
from ckpt_lesson.runs.dcp_manifest import MAX_MANIFEST_BYTES, build_manifest, read_dcp_manifest


def _manifest(**changes: Any) -> dict[str, Any]:
    parts = [
        {"file": "__0_0.distcp", "bytes": 3, **hash_bytes(b"abc")},
        {"file": ".metadata", "bytes": 1, **hash_bytes(b"m")},
    ]
    fields = {
        "step": 4,
        "world_size": 2,
        "parts": parts,
        "per_rank_keys": ["rank0_local", "rank1_local"],
        "state": {"step": 4},
        "covers": ["model", "optimizer"],
        "save_id": "abc",
        "dcp_version": "1.0.0",
    }
    return build_manifest(**{**fields, **changes})


def _write(folder: Path, manifest: Any, *, seal: bool = True) -> Path:
    """Write ``manifest`` sealed (as the writer does), so the test reaches the field checks."""
    folder.mkdir(exist_ok=True)
    record = seal_record(manifest) if seal and isinstance(manifest, dict) else manifest
    (folder / "manifest.json").write_text(json.dumps(record))
    return folder


def test_a_built_manifest_reads_back_equal_with_sorted_parts(tmp_path: Path) -> None:
    manifest = _manifest()
    read, raw = read_dcp_manifest(_write(tmp_path / "s", manifest))
    assert read == seal_record(manifest)
    assert [p["file"] for p in read["parts"]] == [".metadata", "__0_0.distcp"]
    assert raw == (tmp_path / "s" / "manifest.json").read_bytes()


def test_a_folder_without_a_manifest_is_an_incomplete_save(tmp_path: Path) -> None:
    (tmp_path / "s").mkdir()
    with pytest.raises(IncompleteCheckpointError, match="never finished"):
        read_dcp_manifest(tmp_path / "s")


def test_a_manifest_that_is_not_json_is_corrupt(tmp_path: Path) -> None:
    (tmp_path / "s").mkdir()
    (tmp_path / "s" / "manifest.json").write_bytes(b"{not json")
    with pytest.raises(CorruptCheckpointError, match="not valid JSON"):
        read_dcp_manifest(tmp_path / "s")


def test_a_manifest_of_another_schema_is_a_schema_error_naming_the_other_manager(tmp_path: Path) -> None:
    with pytest.raises(SchemaError, match="use CheckpointManager"):
        read_dcp_manifest(_write(tmp_path / "s", {**_manifest(), "schema": "ckpt.manifest.v1"}))


@pytest.mark.parametrize("name", ["../escape", "sub/file", "..", "manifest.json", "a\x00b"])
def test_a_part_name_that_leaves_the_folder_is_unsafe(tmp_path: Path, name: str) -> None:
    manifest = _manifest()
    manifest["parts"][1]["file"] = name
    with pytest.raises(UnsafeCheckpointError):
        read_dcp_manifest(_write(tmp_path / "s", manifest))


@pytest.mark.parametrize(
    "change",
    [
        {"step": -1},
        {"step": True},
        {"world_size": 0},
        {"per_rank_keys": ["rank0_local"]},
        {"parts": []},
        {"covers": "model"},
        {"layout": "single"},
    ],
)
def test_malformed_fields_are_corrupt(tmp_path: Path, change: dict[str, Any]) -> None:
    with pytest.raises(CorruptCheckpointError):
        read_dcp_manifest(_write(tmp_path / "s", {**_manifest(), **change}))


def test_a_manifest_without_a_metadata_part_is_corrupt(tmp_path: Path) -> None:
    manifest = _manifest()
    manifest["parts"] = [p for p in manifest["parts"] if p["file"] != ".metadata"]
    with pytest.raises(CorruptCheckpointError, match="no .metadata part"):
        read_dcp_manifest(_write(tmp_path / "s", manifest))


def test_a_part_listed_twice_is_corrupt(tmp_path: Path) -> None:
    manifest = _manifest()
    manifest["parts"].append(dict(manifest["parts"][0]))
    with pytest.raises(CorruptCheckpointError, match="listed twice"):
        read_dcp_manifest(_write(tmp_path / "s", manifest))


def test_a_symlinked_or_oversized_manifest_is_refused_unread(tmp_path: Path) -> None:
    real = _write(tmp_path / "real", _manifest()) / "manifest.json"
    (tmp_path / "s").mkdir()
    (tmp_path / "s" / "manifest.json").symlink_to(real)
    with pytest.raises(CorruptCheckpointError, match="not a regular file"):
        read_dcp_manifest(tmp_path / "s")
    (tmp_path / "big").mkdir()
    with open(tmp_path / "big" / "manifest.json", "wb") as f:
        f.truncate(MAX_MANIFEST_BYTES + 1)  # sparse: no disk used
    with pytest.raises(CorruptCheckpointError, match="cap"):
        read_dcp_manifest(tmp_path / "big")
    assert os.path.getsize(tmp_path / "big" / "manifest.json") > MAX_MANIFEST_BYTES


def test_build_manifest_refuses_a_malformed_record_so_nothing_is_published() -> None:
    with pytest.raises(CorruptCheckpointError):
        _manifest(parts=[{"file": ".metadata", "bytes": 1, "algo": "md5", "digest": "0" * 32}])


def test_a_well_formed_manifest_without_its_seal_is_refused_as_corrupt_naming_file_cause_and_fix(
    tmp_path: Path,
) -> None:
    with pytest.raises(CorruptCheckpointError) as refused:
        read_dcp_manifest(_write(tmp_path / "s", _manifest(), seal=False))
    message = str(refused.value)
    assert message.startswith("s/manifest.json: a multi-rank manifest without its checksum ('record_digest')")
    assert "damaged or edited" in message and "Restore an older save" in message


@pytest.mark.parametrize(
    "edit",
    [
        lambda m: m.update(step=6),
        lambda m: m["covers"].remove("optimizer"),
        lambda m: m["parts"][0].update(bytes=m["parts"][0]["bytes"] + 1),
        lambda m: m.update({"record_digesT": m.pop(SEAL_KEY)}),  # a flipped bit in the seal's own name
    ],
)
def test_a_sealed_manifest_with_a_field_edited_afterwards_is_refused_as_corrupt(
    tmp_path: Path, edit: Any
) -> None:
    manifest = seal_record(_manifest())
    edit(manifest)
    with pytest.raises(CorruptCheckpointError, match="checksum"):
        read_dcp_manifest(_write(tmp_path / "s", manifest, seal=False))


def test_an_unsealed_record_of_another_schema_is_still_a_schema_error(tmp_path: Path) -> None:
    # The seal rule is about our own records; a single-process manifest read here must still
    # be sent to the right manager, sealed or not.
    other = {**_manifest(), "schema": "ckpt.manifest.v1"}
    with pytest.raises(SchemaError, match="use CheckpointManager"):
        read_dcp_manifest(_write(tmp_path / "s", other, seal=False))
