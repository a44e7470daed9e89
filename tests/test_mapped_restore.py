"""Mapped restores: nothing mapped outlives the restore, and a truncated file cannot kill one.

A restore maps its sealed private copy (files/private_copy.py), never the file: the window
in which truncating the file during a mapped apply killed the process with SIGBUS is closed.
"""

from __future__ import annotations

import multiprocessing
import os
from pathlib import Path

import torch

from ckpt_lesson.files.checkpoint import TrainState, load_checkpoint, save_checkpoint
from ckpt_lesson.files.mapped_restore import keep_no_mapped_extra_state
from ckpt_lesson.runs.manager import CheckpointManager


class Keeper(torch.nn.Module):
    """A module whose set_extra_state keeps the tensor it is given (allowed by torch's API)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(64, 64)
        self.kept = torch.zeros(1 << 16)

    def get_extra_state(self) -> torch.Tensor:
        return self.kept

    def set_extra_state(self, state: torch.Tensor) -> None:
        self.kept = state


def objects(seed: int) -> tuple[Keeper, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = Keeper()
    model.kept = torch.randn(1 << 16)
    return model, torch.optim.AdamW(model.parameters())


def in_child(target, *args) -> int:
    ctx = multiprocessing.get_context("spawn")  # fork after torch started its threads can deadlock
    child = ctx.Process(target=target, args=args)
    child.start()
    child.join(120)
    return child.exitcode


def _restore_then_truncate_then_touch(path: str) -> None:
    model, opt = objects(1)
    load_checkpoint(path, model, opt, None, mmap=True)
    os.truncate(path, 0)  # what a sync tool or another job may do to the file after the restore
    expected, _ = objects(0)
    os._exit(0 if torch.equal(model.kept, expected.kept) else 3)


def _truncate_during_apply(path: str, mmap: bool) -> None:
    model, opt = objects(1)
    # A load_state_dict pre-hook runs while the weights are being applied: truncate the file then.
    model.register_load_state_dict_pre_hook(lambda *a, **k: os.truncate(path, 0))
    load_checkpoint(path, model, opt, None, mmap=mmap)
    expected, _ = objects(0)
    os._exit(0 if torch.equal(model.lin.weight, expected.lin.weight) else 3)


def saved(tmp_path: Path) -> str:
    model, opt = objects(0)
    path = tmp_path / "c.pt"
    save_checkpoint(model, opt, None, TrainState(step=1), path)
    return str(path)


def test_extra_state_a_module_keeps_is_a_copy_so_truncating_the_file_later_is_harmless(tmp_path):
    assert in_child(_restore_then_truncate_then_touch, saved(tmp_path)) == 0


def test_truncating_the_file_while_mapped_weights_are_applied_is_harmless_with_or_without_mmap(tmp_path):
    # The window documented until round four: mapped weights are read while they are applied.
    # They now come from the sealed private copy, which nobody can truncate (was SIGBUS, -7).
    assert in_child(_truncate_during_apply, saved(tmp_path), True) == 0
    assert in_child(_truncate_during_apply, saved(tmp_path), False) == 0


def test_restore_latest_offers_mmap_false(tmp_path, tiny_run):
    run = tiny_run(0)
    run.train(2)
    mgr = CheckpointManager(tmp_path, every_steps=1)
    mgr.save(run.model, run.optimizer, run.scheduler, run.state)
    fresh = tiny_run(1)
    state = mgr.restore_latest(fresh.model, fresh.optimizer, fresh.scheduler, mmap=False)
    assert state is not None and state.step == 2
    assert all(
        torch.equal(a, b)
        for a, b in zip(fresh.model.state_dict().values(), run.model.state_dict().values(), strict=True)
    )


def test_only_the_extra_state_entries_are_copied():
    weight, extra = torch.ones(2), torch.zeros(2)
    out = keep_no_mapped_extra_state({"model": {"w": weight, "m._extra_state": extra}, "state": {}})
    assert out["model"]["w"] is weight
    assert out["model"]["m._extra_state"] is not extra and torch.equal(out["model"]["m._extra_state"], extra)
