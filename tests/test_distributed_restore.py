"""Restores in one process: the world-size policy, the scheduler check, following the run as it changes."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from _distributed_local import restore_locally, save_locally
from _distributed_workers import make_run

from ckpt_lesson import StateMismatchError
from ckpt_lesson.distributed import DistributedCheckpointManager
from ckpt_lesson.distributed.restore import world_size_message
from ckpt_lesson.distributed.saving import FolderSaves
from ckpt_lesson.files.record_seal import seal_record


def _pretend_saved_by(run: Path, world: int) -> None:
    """Make the newest manifest claim ``world`` ranks (a manifest is trusted once all ranks agree)."""
    path = sorted(run.glob("step-*"))[-1] / "manifest.json"
    manifest = json.loads(path.read_text())
    manifest["world_size"] = world
    manifest["per_rank_keys"] = [f"rank{r}_local" for r in range(world)]
    path.write_text(json.dumps(seal_record(manifest)))  # a consistent record from another world size


def test_a_save_by_another_world_size_is_refused_by_default_and_nothing_is_loaded(tmp_path: Path) -> None:
    save_locally(tmp_path / "run", steps=(2,))
    _pretend_saved_by(tmp_path / "run", 2)
    model, opt, sched, _ = make_run("plain", 1, 0)
    before = [p.clone() for p in model.parameters()]
    mgr = DistributedCheckpointManager(tmp_path / "run", every_steps=2)
    with pytest.raises(StateMismatchError, match=r"saved by 2 rank\(s\) and this run has 1"):
        mgr.restore_latest(model, opt, sched)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


def test_reseed_restores_weights_and_counters_drops_the_data_position_and_logs_why(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    losses = save_locally(tmp_path / "run", steps=(2,))
    _pretend_saved_by(tmp_path / "run", 2)
    with caplog.at_level(logging.WARNING, logger="ckpt_lesson.distributed"):
        restored, _ = restore_locally(tmp_path / "run", on_world_size_change="reseed", reseed_base=3)
    assert restored.resharded and restored.saved_world_size == 2 and restored.world_size == 1
    assert restored.state.losses == losses and restored.data_state is None and restored.reseed is not None
    assert "data positions NOT restored" in caplog.text and "reseed_base=3" in caplog.text


def test_a_save_with_a_scheduler_is_refused_for_a_restore_without_one(tmp_path: Path) -> None:
    save_locally(tmp_path / "run", steps=(2,))
    model, opt, _, _ = make_run("plain", 1, 0)
    mgr = DistributedCheckpointManager(tmp_path / "run", every_steps=2)
    with pytest.raises(StateMismatchError, match="saved with a scheduler"):
        mgr.restore_latest(model, opt, None)


def test_the_world_size_message_names_both_sizes_the_reason_and_both_ways_out() -> None:
    message = world_size_message("step-00000040", 4, 2)
    for part in (
        "step-00000040",
        "saved by 4",
        "has 2",
        "RNG state and data position",
        "Resume with 4",
        "reseed",
    ):
        assert part in message


def test_an_unknown_world_size_policy_is_refused(tmp_path: Path) -> None:
    model, opt, sched, _ = make_run("plain", 1, 0)
    with pytest.raises(ValueError, match="on_world_size_change"):
        DistributedCheckpointManager(tmp_path, every_steps=1).restore_latest(
            model, opt, sched, on_world_size_change="guess"
        )


def test_a_restore_follows_the_run_to_a_newer_save_when_retention_deletes_the_one_it_reads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run, trainer = tmp_path / "run", tmp_path / "trainer"
    save_locally(run, steps=(2, 4))
    save_locally(trainer, steps=(6,))
    real = FolderSaves.source

    def trainer_moves_on(saves: FolderSaves, step: int) -> Any:
        if step == 4 and (trainer / "step-00000006").exists():
            # While the eval job reads step 4, the trainer publishes step 6 and its keep_last=1
            # retention deletes steps 2 and 4: the only good save is newer than the one listed.
            (trainer / "step-00000006").rename(run / "step-00000006")
            shutil.rmtree(run / "step-00000004")
            shutil.rmtree(run / "step-00000002")
        return real(saves, step)

    monkeypatch.setattr(FolderSaves, "source", trainer_moves_on)
    restored, _ = restore_locally(run)
    assert restored.step == 6
    assert [(s["step"], s["status"]) for s in restored.skipped] == [(4, "incomplete")]
