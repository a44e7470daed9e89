"""Mapped restores: nothing mapped outlives the restore, and a truncated file cannot kill one.

A restore maps its sealed private copy (files/private_copy.py), never the file: the window
in which truncating the file during a mapped apply killed the process with SIGBUS is closed.
What it copies out lands in fresh memory, faulted in while the file is hashed (FreshMemory).
"""

from __future__ import annotations

import io
import multiprocessing
import os
import time
import zipfile
from pathlib import Path

import torch

from ckpt_lesson.files import loading
from ckpt_lesson.files.checkpoint import TrainState, load_checkpoint, save_checkpoint
from ckpt_lesson.files.loading import load_verified_file
from ckpt_lesson.files.mapped_restore import (
    MIN_RECORD_BYTES,
    FreshMemory,
    copy_out,
    keep_no_mapped_extra_state,
    record_spans,
)
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
    out = keep_no_mapped_extra_state({"w": weight, "m._extra_state": extra})
    assert out["w"] is weight
    assert out["m._extra_state"] is not extra and torch.equal(out["m._extra_state"], extra)
    plain = {"w": weight}
    assert keep_no_mapped_extra_state(plain) is plain  # nothing to copy: the very dict


WIDTH = 1024  # one weight or moment: 4 MiB, above MIN_RECORD_BYTES


def adamw_objects(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(WIDTH, WIDTH, bias=False), torch.nn.Linear(WIDTH, WIDTH))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, WIDTH)).sum().backward()
    opt.step()
    return model, opt


def saved_adamw(tmp_path: Path) -> Path:
    model, opt = adamw_objects(0)
    path = tmp_path / "c.pt"
    save_checkpoint(model, opt, None, TrainState(step=1), path)
    return path


def wait_until_faulted(fresh: FreshMemory, count: int) -> None:
    deadline = time.monotonic() + 60
    while fresh.faulted < count and time.monotonic() < deadline:
        time.sleep(0.01)


def test_record_spans_lists_the_large_tensor_records_last_first(tmp_path):
    path = saved_adamw(tmp_path)
    with open(path, "rb") as f:
        sizes = [n for _, n in record_spans(f, path.stat().st_size)]
        assert f.tell() == 0
    # two weights and four moments of 4 MiB; the 4 KiB bias and its moments are too small to count
    assert sizes == [WIDTH * WIDTH * 4] * 6


def test_a_directory_that_declares_more_than_the_file_holds_gets_no_buffers(tmp_path):
    path = saved_adamw(tmp_path)
    with open(path, "rb") as f:
        assert record_spans(f, 10 * WIDTH * WIDTH) == []  # the records add up to 24 MiB
    assert record_spans(io.BytesIO(os.urandom(4096)), 4096) == []


def test_compressed_and_small_records_get_no_buffers():
    raw = io.BytesIO()
    with zipfile.ZipFile(raw, "w") as z:
        z.writestr("a/data/0", b"\0" * MIN_RECORD_BYTES, compress_type=zipfile.ZIP_DEFLATED)
        z.writestr("a/data/1", b"\0" * 16, compress_type=zipfile.ZIP_STORED)
        z.writestr("a/data/2", b"\0" * MIN_RECORD_BYTES, compress_type=zipfile.ZIP_STORED)
    assert [n for _, n in record_spans(raw, len(raw.getvalue()))] == [MIN_RECORD_BYTES]


class AheadOfTheHash(FreshMemory):
    """The real FreshMemory, whose helper gets ahead of the hash pass (a slow disk's case)."""

    def start(self, f, size):
        super().start(f, size)
        wait_until_faulted(self, 6)


def test_the_moments_land_in_buffers_faulted_in_during_the_hash_and_are_not_copied_again(
    tmp_path, monkeypatch
):
    path = saved_adamw(tmp_path)
    _, expected = adamw_objects(0)
    monkeypatch.setattr(loading, "FreshMemory", AheadOfTheHash)
    seen = {}

    def private(payload, fresh):
        loaded = payload["optimizer"]["state"]
        seen["loaded_ptrs"] = {t.untyped_storage().data_ptr() for s in loaded.values() for t in s.values()}
        seen["fresh"] = fresh
        return copy_out(payload, fresh=fresh)

    payload, _ = load_verified_file(path, mmap=True, private=private)
    fresh, loaded_ptrs, copied = seen["fresh"], seen["loaded_ptrs"], payload["optimizer"]
    # The helper faulted a buffer for each of the 6 large records (4 moments, 2 weights) before the
    # hash pass reached it, and the pass wrote each record straight into its buffer.
    assert fresh.faulted == 6 and len(fresh._mine) == 6
    for i, state in copied["state"].items():
        for key, value in state.items():
            assert torch.equal(value, expected.state_dict()["state"][i][key])
            if value.nbytes >= MIN_RECORD_BYTES:  # the very buffer the hash pass filled, as it is
                assert value.untyped_storage().data_ptr() in fresh._mine & loaded_ptrs


def test_a_tensor_on_a_buffer_the_hash_pass_filled_is_kept_and_every_other_tensor_is_cloned():
    fresh = FreshMemory()
    filled = fresh.take(0, WIDTH * WIDTH * 4).view(torch.float32)
    assert fresh.copy(filled) is filled
    big = torch.arange(WIDTH * WIDTH, dtype=torch.float32).reshape(WIDTH, WIDTH)
    for t in (big, big.t(), torch.nn.Parameter(big.clone()), torch.ones(3)):
        out = fresh.copy(t)
        assert torch.equal(out, t) and out.untyped_storage().data_ptr() != t.untyped_storage().data_ptr()


def test_unused_buffers_are_freed_when_the_restore_ends(tmp_path):
    path = saved_adamw(tmp_path)
    fresh = FreshMemory()
    with open(path, "rb") as f:  # a restore that ends before its hash pass took any buffer
        fresh.start(f, path.stat().st_size)
    wait_until_faulted(fresh, 6)
    assert len(fresh._at) == 6
    fresh.close(wait=True)
    assert fresh._at == {} and not fresh._thread.is_alive()


def _restore_moments_then_truncate_then_touch(path: str) -> None:
    # The moments as saved, read before the cut. (Not adamw_objects(0) rebuilt here: a parent that ran
    # seed_everything saved them with 1 thread, and 1024x1024 products round differently on 2.)
    saved_state = torch.load(path, weights_only=True)["optimizer"]["state"]
    want = [t for s in saved_state.values() for t in s.values()]
    model, opt = adamw_objects(1)
    load_checkpoint(path, model, opt, None, mmap=True)
    os.truncate(path, 0)  # a mapped moment would now die with SIGBUS when touched
    moments = [t for s in opt.state_dict()["state"].values() for t in s.values()]
    # 3: a moment differs from the saved one (the copies out of the mapping lost or changed bytes)
    os._exit(0 if all(torch.equal(a, b) for a, b in zip(moments, want, strict=True)) else 3)


def test_moments_restored_through_the_buffers_survive_the_file_being_truncated(tmp_path):
    ctx = multiprocessing.get_context("spawn")  # fork after torch started its threads can deadlock
    child = ctx.Process(target=_restore_moments_then_truncate_then_touch, args=(str(saved_adamw(tmp_path)),))
    child.start()
    child.join(120)
    # -7 (SIGBUS): a restored moment still pointed into the truncated file; 3: a moment's bytes differ
    assert child.exitcode == 0, f"child exit code {child.exitcode}"
