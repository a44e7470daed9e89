"""Verified before read, nothing unpickled unverified: damaged and crafted saves, in one process.

Damage (a flipped byte, a missing file) is refused before DCP reads anything
and the restore falls back to the older save. A crafted file is refused even
when the manifest was rewritten to match it, and its side effect (creating a
marker file) never happens. Negative controls show the crafted payloads are
real: stock DCP runs them.
"""

from __future__ import annotations

import json
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch.distributed.checkpoint as dcp
from _distributed_local import RunsCode, flip_byte, restore_locally, rewrite_manifest_entry, save_locally
from _distributed_workers import make_run, train_step
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

import ckpt_lesson.distributed.verify as verify_module
import ckpt_lesson.runs.dcp_manifest as dcp_manifest_module
from ckpt_lesson import IncompleteCheckpointError, TrainState, UnsafeCheckpointError
from ckpt_lesson.distributed import Comm, DistributedCheckpointManager, VerifyingReader, verify_save
from ckpt_lesson.files.record_seal import SEAL_KEY

STEP4 = "step-00000004"


@pytest.fixture
def run(tmp_path: Path) -> Path:
    save_locally(tmp_path / "run")
    return tmp_path / "run"


@pytest.fixture
def loads(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The save folders dcp.load was asked to read, in order."""
    seen: list[str] = []
    real = dcp.load

    def spy(state_dict, *, storage_reader, **kwargs):
        seen.append(Path(storage_reader.path).name)
        return real(state_dict, storage_reader=storage_reader, **kwargs)

    monkeypatch.setattr(dcp, "load", spy)
    return seen


def test_a_flipped_byte_in_a_data_file_is_refused_before_loading_and_restore_falls_back(
    run: Path, loads: list[str]
) -> None:
    flip_byte(run / STEP4 / "__0_0.distcp")
    restored, _ = restore_locally(run)
    assert restored.step == 2
    assert loads == ["step-00000002"]  # step 4 was never handed to DCP
    [skipped] = restored.skipped
    assert skipped["status"] == "corrupt" and "__0_0.distcp" in skipped["reason"]


def test_a_flipped_byte_in_metadata_is_refused_before_unpickling_and_restore_falls_back(
    run: Path, loads: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    parsed: list[int] = []
    real = verify_module.load_metadata_bytes
    monkeypatch.setattr(
        verify_module, "load_metadata_bytes", lambda data, **kw: parsed.append(1) or real(data, **kw)
    )
    flip_byte(run / STEP4 / ".metadata", at=0.3)
    restored, _ = restore_locally(run)
    assert restored.step == 2
    assert loads == ["step-00000002"]
    assert parsed == [1]  # only step 2's metadata was ever parsed
    assert ".metadata" in restored.skipped[0]["reason"]


def test_a_crafted_metadata_runs_nothing_and_restore_falls_back_when_the_manifest_does_not_match(
    run: Path, tmp_path: Path
) -> None:
    marker = tmp_path / "pwned"
    (run / STEP4 / ".metadata").write_bytes(pickle.dumps(RunsCode(marker)))
    restored, _ = restore_locally(run)
    assert restored.step == 2
    assert not marker.exists()


def test_a_crafted_metadata_with_a_matching_manifest_is_refused_as_unsafe_and_runs_nothing(
    run: Path, tmp_path: Path, loads: list[str]
) -> None:
    marker = tmp_path / "pwned"
    (run / STEP4 / ".metadata").write_bytes(pickle.dumps(RunsCode(marker)))
    rewrite_manifest_entry(run / STEP4, ".metadata")
    with pytest.raises(UnsafeCheckpointError, match=r"builtins\.exec"):
        restore_locally(run)
    assert not marker.exists()
    assert loads == []


def test_stock_dcp_runs_the_crafted_metadata(run: Path, tmp_path: Path) -> None:
    """Negative control: the payload above is real; DCP's own reader executes it."""
    marker = tmp_path / "pwned"
    (run / STEP4 / ".metadata").write_bytes(pickle.dumps(RunsCode(marker)))
    with pytest.raises(Exception):  # noqa: B017 - whatever exec returns is no Metadata
        FileSystemReader(run / STEP4).read_metadata()
    assert marker.exists()


def _save_with_crafted_value(run: Path, marker: Path) -> None:
    """A save whose scheduler state holds a value that pickles as a call to exec (manifest matches)."""
    model, opt, sched, _ = make_run("plain", 1, 0)
    crafted = {**sched.state_dict(), "gamma": RunsCode(marker)}
    sched.state_dict = lambda: crafted
    mgr = DistributedCheckpointManager(run, keep_last=5, every_steps=2)
    mgr.save(model, opt, sched, TrainState(step=6))
    mgr.close()


def test_a_crafted_non_tensor_value_is_refused_as_unsafe_and_runs_nothing(run: Path, tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    _save_with_crafted_value(run, marker)
    with pytest.raises(UnsafeCheckpointError, match=r"scheduler\.gamma.*not plain data"):
        restore_locally(run)
    assert not marker.exists()


def test_stock_dcp_runs_the_crafted_non_tensor_value(run: Path, tmp_path: Path) -> None:
    """Negative control: DCP's DefaultLoadPlanner reads non-tensor values with weights_only=False."""
    marker = tmp_path / "pwned"
    _save_with_crafted_value(run, marker)
    _, _, sched, _ = make_run("plain", 1, 0)
    dcp.load(
        {"scheduler": sched.state_dict()},
        storage_reader=FileSystemReader(run / "step-00000006"),
        planner=DefaultLoadPlanner(allow_partial_load=True),
        no_dist=True,
    )
    assert marker.exists()


def _unsealed(manifest: dict) -> None:
    del manifest[SEAL_KEY]


def _edited(manifest: dict) -> None:
    manifest["state"]["step"] = 5  # a plausible value; the seal, not a field check, must catch it


@pytest.mark.parametrize("damage", [_unsealed, _edited], ids=["seal-removed", "field-edited"])
def test_a_manifest_without_a_valid_seal_is_refused_before_loading_and_restore_falls_back(
    run: Path, loads: list[str], damage: Any
) -> None:
    path = run / STEP4 / "manifest.json"
    manifest = json.loads(path.read_text())
    damage(manifest)
    path.write_text(json.dumps(manifest))
    restored, _ = restore_locally(run)
    assert restored.step == 2
    assert loads == ["step-00000002"]  # step 4 was never handed to DCP
    [skipped] = restored.skipped
    assert skipped["status"] == "corrupt"
    assert f"{STEP4}/manifest.json: " in skipped["reason"] and "checksum" in skipped["reason"]


def test_a_missing_data_file_makes_the_save_incomplete_and_restore_falls_back(run: Path) -> None:
    (run / STEP4 / "__0_0.distcp").unlink()
    restored, _ = restore_locally(run)
    assert restored.step == 2
    assert restored.skipped[0]["status"] == "incomplete"
    with pytest.raises(IncompleteCheckpointError, match="__0_0.distcp: missing"):
        verify_save(run / STEP4, Comm())


def test_the_reader_refuses_dcps_fallback_to_rank_local_metadata(run: Path) -> None:
    reader = VerifyingReader(verify_save(run / STEP4, Comm()))
    assert reader.read_metadata().storage_data  # the verified one is served
    with pytest.raises(UnsafeCheckpointError, match="rank-local metadata"):
        reader.read_metadata(rank=0)


def test_the_reader_refuses_a_file_the_manifest_does_not_list(run: Path) -> None:
    verified = verify_save(run / STEP4, Comm())
    unlisted = verified.__class__(verified.folder, verified.manifest, verified.metadata, {})
    model, opt, sched, _ = make_run("plain", 1, 0)
    with pytest.raises(CheckpointException) as info:  # DCP's wrapper (a BaseException) around ours
        dcp.load({"model": model.state_dict()}, storage_reader=VerifyingReader(unlisted), no_dist=True)
    [(error, _)] = info.value.failures.values()
    assert isinstance(error, UnsafeCheckpointError) and "unlisted file '__0_0.distcp'" in str(error)


def test_a_restored_save_continues_training_exactly_like_the_uninterrupted_run(tmp_path: Path) -> None:
    losses = save_locally(tmp_path / "run", steps=(2, 4))
    uninterrupted = save_locally(tmp_path / "other", steps=(2, 6))
    restored, (model, opt, sched, sampler) = restore_locally(tmp_path / "run")
    sampler.set_state(restored.data_state["sampler"])
    more = [train_step(model, opt, sched, sampler) for _ in range(2)]
    assert restored.state.losses == losses
    assert restored.state.losses + more == uninterrupted


class _FakePeers(Comm):
    """This process as rank ``rank`` of ``world``; the other ranks report ``others`` from all_gather."""

    def __init__(self, rank: int, world: int, others: dict[str, object] | None = None) -> None:
        self.enabled, self.group, self.rank, self.world_size = False, None, rank, world
        self.others = others

    def all_gather(self, obj: object) -> list[object]:
        peer = self.others if self.others is not None else obj
        return [obj if r == self.rank else peer for r in range(self.world_size)]


@pytest.mark.parametrize(("rank", "share"), [(0, ["__0_0.distcp", "__0_2.distcp"]), (1, ["__0_1.distcp"])])
def test_each_rank_hashes_only_its_share_of_the_data_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, rank: int, share: list[str]
) -> None:
    save_locally(tmp_path / "run", steps=(2,), thread_count=3)
    hashed: list[str] = []
    real = dcp_manifest_module.hash_file
    monkeypatch.setattr(
        dcp_manifest_module, "hash_file", lambda path, algo: hashed.append(path.name) or real(path, algo)
    )
    verify_save(tmp_path / "run" / "step-00000002", _FakePeers(rank, 2))
    assert sorted(hashed) == share


def test_a_problem_another_rank_found_fails_the_save_on_this_rank_too(tmp_path: Path) -> None:
    save_locally(tmp_path / "run", steps=(2,))
    folder = tmp_path / "run" / "step-00000002"
    mine = verify_module._local_findings(verify_module.FolderSave(folder, Comm()), Comm())[0]
    theirs = {**mine, "problems": ["__1_0.distcp: xxh3_128 0123... != recorded 4567..."]}
    with pytest.raises(verify_module.CorruptCheckpointError, match="__1_0.distcp"):
        verify_save(folder, _FakePeers(0, 2, theirs))
    with pytest.raises(verify_module.CorruptCheckpointError, match="different manifests"):
        verify_save(folder, _FakePeers(0, 2, {**mine, "manifest": "0" * 32}))
