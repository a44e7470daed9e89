"""Fresh memory for a mapped restore: faulted in while the file is hashed, used for private copies only."""

from __future__ import annotations

import io
import multiprocessing
import os
import time
import zipfile
from pathlib import Path

import torch

from ckpt_lesson.files.checkpoint import TrainState, load_checkpoint, save_checkpoint
from ckpt_lesson.files.fresh_memory import MIN_RECORD_BYTES, FreshMemory, record_sizes
from ckpt_lesson.files.loading import load_verified_file
from ckpt_lesson.files.mapped_restore import copy_out

WIDTH = 1024  # one weight or moment: 4 MiB, above MIN_RECORD_BYTES


def objects(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(WIDTH, WIDTH, bias=False), torch.nn.Linear(WIDTH, WIDTH))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, WIDTH)).sum().backward()
    opt.step()
    return model, opt


def saved(tmp_path: Path) -> Path:
    model, opt = objects(0)
    path = tmp_path / "c.pt"
    save_checkpoint(model, opt, None, TrainState(step=1), path)
    return path


def wait_until_faulted(fresh: FreshMemory, count: int) -> None:
    deadline = time.monotonic() + 60
    while fresh.faulted < count and time.monotonic() < deadline:
        time.sleep(0.01)


def test_record_sizes_lists_the_large_tensor_records_last_first(tmp_path):
    path = saved(tmp_path)
    with open(path, "rb") as f:
        sizes = record_sizes(f, path.stat().st_size)
        assert f.tell() == 0
    # two weights and four moments of 4 MiB; the 4 KiB bias and its moments are too small to count
    assert sizes == [WIDTH * WIDTH * 4] * 6


def test_a_directory_that_declares_more_than_the_file_holds_gets_no_buffers(tmp_path):
    path = saved(tmp_path)
    with open(path, "rb") as f:
        assert record_sizes(f, 10 * WIDTH * WIDTH) == []  # the records add up to 24 MiB
    assert record_sizes(io.BytesIO(os.urandom(4096)), 4096) == []


def test_compressed_and_small_records_get_no_buffers():
    raw = io.BytesIO()
    with zipfile.ZipFile(raw, "w") as z:
        z.writestr("a/data/0", b"\0" * MIN_RECORD_BYTES, compress_type=zipfile.ZIP_DEFLATED)
        z.writestr("a/data/1", b"\0" * 16, compress_type=zipfile.ZIP_STORED)
        z.writestr("a/data/2", b"\0" * MIN_RECORD_BYTES, compress_type=zipfile.ZIP_STORED)
    assert record_sizes(raw, len(raw.getvalue())) == [MIN_RECORD_BYTES]


def test_the_moments_land_in_buffers_faulted_in_during_the_hash_and_are_not_copied_again(tmp_path):
    path = saved(tmp_path)
    _, expected = objects(0)
    with FreshMemory() as fresh:
        with open(path, "rb") as f:  # the helper gets ahead of the hash pass (a slow disk's case)
            fresh.start(f, path.stat().st_size)
        wait_until_faulted(fresh, 6)
        payload, _ = load_verified_file(path, mmap=True, fresh=fresh)
        loaded = payload["optimizer"]["state"]
        loaded_ptrs = {t.untyped_storage().data_ptr() for s in loaded.values() for t in s.values()}
        copied = copy_out(payload["optimizer"], fresh=fresh)
    # The helper faulted a buffer for each of the 6 large records (4 moments, 2 weights) before the
    # hash pass reached it, and the pass wrote each record straight into its buffer.
    assert fresh.faulted == 6 and len(fresh._mine) == 6 and fresh.used == 0
    for i, state in copied["state"].items():
        for key, value in state.items():
            assert torch.equal(value, expected.state_dict()["state"][i][key])
            if value.nbytes >= MIN_RECORD_BYTES:  # the very buffer the hash pass filled, as it is
                assert value.untyped_storage().data_ptr() in fresh._mine & loaded_ptrs


def test_views_parameters_and_small_tensors_are_cloned_not_given_a_buffer():
    fresh = FreshMemory()
    big = torch.arange(WIDTH * WIDTH, dtype=torch.float32).reshape(WIDTH, WIDTH)
    fresh._ready = {big.nbytes: [torch.zeros(big.nbytes, dtype=torch.uint8)]}
    for t in (big.t(), torch.nn.Parameter(big.clone()), torch.ones(3)):
        out = fresh.copy(t)
        assert torch.equal(out, t) and out.untyped_storage().data_ptr() != t.untyped_storage().data_ptr()
    assert fresh.used == 0
    out = fresh.copy(big)
    assert torch.equal(out, big) and out.is_contiguous() and fresh.used == 1


def test_unused_buffers_are_freed_when_the_restore_ends(tmp_path):
    path = saved(tmp_path)
    fresh = FreshMemory()
    load_verified_file(path, mmap=True, fresh=fresh)
    wait_until_faulted(fresh, 6)
    fresh.close(wait=True)
    assert fresh._ready == {} and not fresh._thread.is_alive()


def _restore_then_truncate_then_touch(path: str) -> None:
    # The moments as saved, read before the cut. (Not objects(0) rebuilt here: a parent that ran
    # seed_everything saved them with 1 thread, and 1024x1024 products round differently on 2.)
    saved_state = torch.load(path, weights_only=True)["optimizer"]["state"]
    want = [t for s in saved_state.values() for t in s.values()]
    model, opt = objects(1)
    load_checkpoint(path, model, opt, None, mmap=True)
    os.truncate(path, 0)  # a mapped moment would now die with SIGBUS when touched
    moments = [t for s in opt.state_dict()["state"].values() for t in s.values()]
    # 3: a moment differs from the saved one (the copies out of the mapping lost or changed bytes)
    os._exit(0 if all(torch.equal(a, b) for a, b in zip(moments, want, strict=True)) else 3)


def test_moments_restored_through_the_buffers_survive_the_file_being_truncated(tmp_path):
    ctx = multiprocessing.get_context("spawn")  # fork after torch started its threads can deadlock
    child = ctx.Process(target=_restore_then_truncate_then_touch, args=(str(saved(tmp_path)),))
    child.start()
    child.join(120)
    # -7 (SIGBUS): a restored moment still pointed into the truncated file; 3: a moment's bytes differ
    assert child.exitcode == 0, f"child exit code {child.exitcode}"
