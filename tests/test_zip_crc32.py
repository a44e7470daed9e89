"""``zip_crc32=True`` on every save entry point: the files then pass zip tools' CRC checks."""

from __future__ import annotations

import zipfile
from pathlib import Path

import pytest
import torch

from ckpt_lesson.errors import CheckpointError
from ckpt_lesson.files.atomic import atomic_save
from ckpt_lesson.files.checkpoint import save_checkpoint
from ckpt_lesson.files.sharded import save_sharded_checkpoint
from ckpt_lesson.runs.async_save import AsyncCheckpointer
from ckpt_lesson.runs.manager import CheckpointManager


def bad_members(folder: Path) -> dict[str, str | None]:
    """``testzip()`` of every torch archive under ``folder``: ``None`` when every CRC32 matches."""
    found = {}
    for path in sorted(folder.rglob("*.pt")):
        with zipfile.ZipFile(path) as archive:
            found[path.name] = archive.testzip()
    assert found, f"no .pt file under {folder}"
    return found


def save_every_way(run: object, out: Path, keep: bool) -> None:
    atomic_save({"w": torch.arange(8.0)}, out / "atomic" / "w.pt", zip_crc32=keep)
    save_checkpoint(
        run.model, run.optimizer, run.scheduler, run.state, out / "single" / "c.pt", zip_crc32=keep
    )
    save_sharded_checkpoint(
        run.model, run.optimizer, run.scheduler, run.state, out / "sharded", num_shards=2, zip_crc32=keep
    )
    CheckpointManager(out / "mgr", every_steps=1, zip_crc32=keep).save(
        run.model, run.optimizer, run.scheduler, run.state
    )
    CheckpointManager(out / "mgr_sharded", every_steps=1, num_shards=2, zip_crc32=keep).save(
        run.model, run.optimizer, run.scheduler, run.state
    )
    with AsyncCheckpointer(CheckpointManager(out / "async", every_steps=1, zip_crc32=keep)) as ckpt:
        ckpt.save_async(run.model, run.optimizer, run.scheduler, run.state)


def test_every_save_entry_point_with_zip_crc32_writes_files_that_pass_testzip(tmp_path, tiny_run):
    run = tiny_run(0)
    run.train(2)
    save_every_way(run, tmp_path, keep=True)
    for sub in ("atomic", "single", "sharded", "mgr", "mgr_sharded", "async"):
        assert set(bad_members(tmp_path / sub).values()) == {None}, sub


def test_by_default_the_crc32s_are_skipped_and_zip_tools_flag_the_files(tmp_path, tiny_run):
    # The documented trade-off (docs/guarantees.md, safety limits): torch.load never checks these CRCs.
    run = tiny_run(0)
    run.train(2)
    save_every_way(run, tmp_path, keep=False)
    for sub in ("atomic", "single", "sharded", "mgr", "mgr_sharded", "async"):
        assert None not in bad_members(tmp_path / sub).values(), sub


@pytest.mark.parametrize("value", [1, "yes", None])
def test_a_zip_crc32_that_is_not_a_bool_is_refused(tmp_path, value):
    with pytest.raises(CheckpointError, match="zip_crc32 must be True or False"):
        CheckpointManager(tmp_path, every_steps=1, zip_crc32=value)
