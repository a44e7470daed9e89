"""verify_on_save's two checks: "writer" (sizes; the digest came from the bytes written) and
"device" (evict the cached pages, then hash what the disk returns)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ckpt_lesson.errors import CheckpointError, CorruptCheckpointError
from ckpt_lesson.files.checkpoint import TrainState
from ckpt_lesson.files.hashing import DEFAULT_ALGO, digest_bytes
from ckpt_lesson.files.verify import check_written_part, drop_cached_pages, verify_mode
from ckpt_lesson.runs.manager import CheckpointManager


def tiny() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = torch.nn.Linear(4, 2)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def record_of(path: Path) -> dict:
    blob = path.read_bytes()
    return {
        "file": path.name,
        "bytes": len(blob),
        "algo": DEFAULT_ALGO,
        "digest": digest_bytes(blob, DEFAULT_ALGO),
    }


def staging_hook(tmp_path: Path, damage):
    def hook(name: str, info: dict) -> None:
        if name == "manifest_written":
            [staging] = [p for p in tmp_path.iterdir() if p.name.startswith(".staging-")]
            damage(staging / "checkpoint.pt")

    return hook


def truncate(path: Path) -> None:
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size - 1)


def flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def test_verify_on_save_accepts_writer_device_true_and_false_and_refuses_anything_else(tmp_path):
    assert [verify_mode(v) for v in ("writer", "device", True, False)] == ["writer", "device", "device", None]
    with pytest.raises(CheckpointError, match="verify_on_save must be"):
        verify_mode("yes")
    with pytest.raises(CheckpointError, match="verify_on_save must be"):
        CheckpointManager(tmp_path, every_steps=1, verify_on_save="always")


@pytest.mark.parametrize("mode", ["writer", "device"])
def test_both_checks_catch_a_part_cut_short_before_publishing(tmp_path, mode):
    model, opt = tiny()
    mgr = CheckpointManager(
        tmp_path, every_steps=1, verify_on_save=mode, on_event=staging_hook(tmp_path, truncate)
    )
    with pytest.raises(CorruptCheckpointError, match="size"):
        mgr.save(model, opt, None, TrainState(step=1))
    assert list(tmp_path.iterdir()) == []


def test_the_writer_check_does_not_read_the_bytes_back_so_a_same_size_change_gets_through(tmp_path):
    # The documented limit of the cheap default: it checks our writer, not the disk; the retention
    # re-hash (runs/reverify.py) or a "device" check is what sees changed bytes.
    model, opt = tiny()
    mgr = CheckpointManager(tmp_path, every_steps=1, on_event=staging_hook(tmp_path, flip))
    mgr.save(model, opt, None, TrainState(step=1))
    assert not mgr.verify_step(1).ok


def test_the_device_check_rereads_after_dropping_the_cached_pages(tmp_path):
    path = tmp_path / "part.bin"
    path.write_bytes(b"x" * 100_000)
    part = record_of(path)
    drop_cached_pages(path)  # clean or not, the call must succeed on a regular file
    assert check_written_part(path, part, "device") is None
    flip(path)
    assert "!= recorded" in check_written_part(path, part, "device")
    assert check_written_part(path, part, "writer") is None  # same size: the writer check passes
