"""Save preparation (agreement before writing), target clearing, and retention after publish."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from _distributed_local import flip_byte, save_locally
from _distributed_workers import make_run

from ckpt_lesson import CheckpointError, KeepLastK, TrainState
from ckpt_lesson.distributed import DistributedCheckpointManager, verify_save
from ckpt_lesson.distributed.comm import Comm
from ckpt_lesson.distributed.saving import FolderSaves, clear_target
from ckpt_lesson.runs.reverify import check_save


def test_an_invalid_data_state_is_refused_before_a_staging_folder_exists(tmp_path: Path) -> None:
    model, opt, sched, _ = make_run("plain", 1, 0)
    mgr = DistributedCheckpointManager(tmp_path, every_steps=1)
    with pytest.raises(CheckpointError, match="refused before writing anything: rank 0"):
        mgr.save(model, opt, sched, TrainState(step=1), data_state={"perm": np.arange(3)})
    assert list(tmp_path.iterdir()) == []


def test_a_good_save_of_the_same_step_is_never_overwritten(tmp_path: Path) -> None:
    save_locally(tmp_path, steps=(2,))
    with pytest.raises(CheckpointError, match="already saved.*never overwritten"):
        clear_target(tmp_path, tmp_path / "step-00000002", lambda name, **info: None)


def test_a_damaged_save_of_the_same_step_is_moved_aside_and_replaced(tmp_path: Path) -> None:
    save_locally(tmp_path, steps=(2,))
    flip_byte(tmp_path / "step-00000002" / "__0_0.distcp")
    events: list[str] = []
    model, opt, sched, _ = make_run("plain", 1, 0)
    mgr = DistributedCheckpointManager(
        tmp_path, every_steps=2, on_event=lambda name, info: events.append(name)
    )
    mgr.save(model, opt, sched, TrainState(step=2))
    assert "quarantined" in events
    assert len(list(tmp_path.glob(".quarantine-step-00000002-*"))) == 1
    verify_save(tmp_path / "step-00000002", Comm())  # the new one verifies


def test_retention_deletes_only_after_k_good_saves_and_never_the_newest(tmp_path: Path) -> None:
    save_locally(tmp_path, steps=(2, 4, 6), keep_last=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000004", "step-00000006"]


def test_retention_does_not_count_a_save_that_lost_a_part(tmp_path: Path) -> None:
    save_locally(tmp_path, steps=(2, 4))
    keeper = FolderSaves(tmp_path, KeepLastK(1), lambda name, **info: None)
    keeper.worker.known.verified.update({2, 4})
    (tmp_path / "step-00000004" / "__0_0.distcp").write_bytes(b"short")
    assert check_save(tmp_path / "step-00000002", full=False) is None
    assert check_save(tmp_path / "step-00000004", full=False) is not None
    keeper.after_publish(tmp_path / "step-00000004", {"step": 4})
    keeper.wait()
    assert (tmp_path / "step-00000002").exists()  # the only good save is kept


def test_a_failing_purge_is_logged_and_never_fails_the_published_save(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    class Broken:
        def to_delete(self, steps: Any, verified: Any) -> list[int]:
            raise RuntimeError("policy bug")

    save_locally(tmp_path, steps=(2,), retention=Broken())
    assert (tmp_path / "step-00000002").exists()
    assert "retention after step-00000002 failed" in caplog.text
