"""Notebook 02's experiment in one call: a child saving through a slow disk is SIGKILLed mid-write."""

from __future__ import annotations

import pytest
import torch

import ckpt_lesson as cl
from ckpt_lesson.course.kill_child import kill_mid_save
from ckpt_lesson.files.checkpoint import load_verified_file


def test_a_naive_save_killed_mid_write_leaves_40_of_128_mib_that_do_not_load(tmp_path):
    target = tmp_path / "naive.pt"
    torch.save({"step": 1}, target)
    assert kill_mid_save("naive", target) is True
    assert round(target.stat().st_size / 2**20) == 40  # 8 MiB writes; the next would pass 48 MiB
    with pytest.raises(cl.CheckpointError):
        load_verified_file(target)


def test_an_atomic_save_killed_mid_write_leaves_the_previous_checkpoint(tmp_path):
    target = tmp_path / "atomic.pt"
    cl.atomic_save({"step": 1}, target)
    assert kill_mid_save("atomic", target) is True
    assert load_verified_file(target)[0]["step"] == 1
    assert (tmp_path / "slow_disk_child.py").is_file()  # the child's script, left to read


def test_an_unknown_mode_is_refused_naming_both_modes(tmp_path):
    with pytest.raises(cl.CheckpointError, match="mode 'fast' is not 'naive' or 'atomic'"):
        kill_mid_save("fast", tmp_path / "x.pt")
