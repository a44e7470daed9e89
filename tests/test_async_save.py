"""AsyncCheckpointer: snapshot on the training thread, commit protocol on a writer thread.

No test sleeps to make a race likely: a gate on ``FooterWriter.write`` holds the
writer thread mid-file until the test lets it go, so "training continues while
a save is in flight" is a fact of the test, not a matter of timing.
"""

from __future__ import annotations

import copy
import multiprocessing
import os
import random
import signal
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from ckpt_lesson.errors import CheckpointError
from ckpt_lesson.files import integrity
from ckpt_lesson.files.checkpoint import TrainState, build_payload, read_checkpoint
from ckpt_lesson.files.payload import optimizer_state_with_bindings
from ckpt_lesson.files.rng import capture_rng_state, restore_rng_state
from ckpt_lesson.runs.async_save import AsyncCheckpointer, TrainingSnapshot
from ckpt_lesson.runs.manager import CheckpointManager

SEED = 5


class Gate:
    """Holds the writer thread at one point until the test calls ``open()``.

    ``at_event("part_begin")`` is a manager ``on_event`` hook that holds the
    writer before it builds the payload (so nothing, not even the RNG, has been
    read for writing yet); ``on_writes(monkeypatch)`` holds it inside
    ``FooterWriter.write``, mid-file. Only threads other than the main one wait.
    """

    def __init__(self) -> None:
        self.entered = threading.Event()  # the writer reached the gate
        self.released = threading.Event()

    def block(self) -> None:
        if threading.current_thread() is not threading.main_thread() and not self.released.is_set():
            self.entered.set()
            if not self.released.wait(30):
                raise RuntimeError("test gate was never opened")

    def at_event(self, event: str) -> Any:
        return lambda name, info: self.block() if name == event else None

    def on_writes(self, monkeypatch: pytest.MonkeyPatch) -> None:
        original = integrity.FooterWriter.write

        def write(self_: Any, data: Any) -> int:
            self.block()
            return original(self_, data)

        monkeypatch.setattr(integrity.FooterWriter, "write", write)

    def wait_for_writer(self) -> None:
        assert self.entered.wait(30), "the writer thread never reached the gate"

    def open(self) -> None:
        self.released.set()


def saver(run: Any, ckpt: AsyncCheckpointer, on_step: Any = None) -> Any:
    def after_step(state: TrainState, record: Any) -> None:
        if ckpt.should_save(state.step):
            ckpt.save_async(run.model, run.optimizer, run.scheduler, state)
        if on_step is not None:
            on_step(state.step)

    return after_step


def reference(tiny_run: Any, until: int) -> tuple[list[float], list[tuple[int, ...]]]:
    run = tiny_run(SEED)
    records = run.train(until)
    return run.state.losses, [r.sample_ids for r in records]


def assert_same_tree(a: Any, b: Any) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    elif isinstance(a, dict):
        assert isinstance(b, dict) and list(a) == list(b)
        for key in a:
            assert_same_tree(a[key], b[key])
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            assert_same_tree(x, y)
    else:
        assert a == b


def saved_payload(run_dir: Path, step: int) -> dict[str, Any]:
    return read_checkpoint(run_dir / f"step-{step:08d}" / "checkpoint.pt")


@pytest.mark.parametrize("num_shards", [None, 2], ids=["single", "sharded"])
def test_async_save_resumes_bit_for_bit(tmp_path, monkeypatch, tiny_run, num_shards):
    losses, ids = reference(tiny_run, 20)
    gate = Gate()
    gate.on_writes(monkeypatch)  # held mid-file
    run = tiny_run(SEED)
    mgr = CheckpointManager(tmp_path, every_steps=5, num_shards=num_shards)
    ckpt = AsyncCheckpointer(mgr)
    seen_in_flight = []

    def on_step(step: int) -> None:
        if step in (6, 7):  # training goes on while the step-5 save is held mid-write
            gate.wait_for_writer()
            seen_in_flight.append(ckpt.in_flight)
        if step == 8:
            gate.open()

    run.train(8, after_step=saver(run, ckpt, on_step))
    assert ckpt.wait() == tmp_path / "step-00000005"
    assert seen_in_flight == [True, True]
    assert (tmp_path / "step-00000005" / ("checkpoint.pt" if num_shards is None else "index.json")).is_file()

    fresh = tiny_run(SEED)  # "crash" at step 8: restore into new objects and go on
    state = CheckpointManager(tmp_path, every_steps=5).restore_latest(
        fresh.model, fresh.optimizer, fresh.scheduler
    )
    assert state is not None and state.step == 5
    fresh.state = state
    records = fresh.train(20)
    assert fresh.state.losses == losses
    assert [r.sample_ids for r in records] == ids[5:]


def test_training_after_save_async_does_not_leak_into_the_save(tmp_path, tiny_run):
    gate = Gate()  # held before the payload is even built
    run = tiny_run(SEED)
    run.train(4)
    ckpt = AsyncCheckpointer(
        CheckpointManager(tmp_path, every_steps=100, on_event=gate.at_event("part_begin"))
    )
    ckpt.save_async(run.model, run.optimizer, run.scheduler, run.state)
    expected = {
        "model": copy.deepcopy(run.model.state_dict()),
        "optimizer": copy.deepcopy(optimizer_state_with_bindings(run.model, run.optimizer)),
        "scheduler": copy.deepcopy(run.scheduler.state_dict()),
        "state": run.state.to_dict(),
        "rng": capture_rng_state(),
    }
    gate.wait_for_writer()
    run.train(9)  # in-place parameter, moment and counter updates while the writer holds the snapshot
    gate.open()
    ckpt.wait()

    payload = saved_payload(tmp_path, 4)
    for bucket, value in expected.items():
        assert_same_tree(payload[bucket], value)
    assert not torch.equal(run.model.state_dict()["0.weight"], expected["model"]["0.weight"])
    assert run.state.step == 9 and payload["state"]["step"] == 4


def test_rng_is_captured_at_the_snapshot_not_at_write_time(tmp_path, tiny_run):
    gate = Gate()  # held before the payload (and so any RNG capture at write time) is built
    run = tiny_run(SEED)
    run.train(3)
    ckpt = AsyncCheckpointer(
        CheckpointManager(tmp_path, every_steps=100, on_event=gate.at_event("part_begin"))
    )
    ckpt.save_async(run.model, run.optimizer, run.scheduler, run.state)
    gate.wait_for_writer()
    drawn = (torch.rand(4), np.random.rand(4).tolist(), random.random())  # advances all three
    gate.open()
    ckpt.wait()

    restore_rng_state(saved_payload(tmp_path, 3)["rng"])
    again = (torch.rand(4), np.random.rand(4).tolist(), random.random())
    assert torch.equal(drawn[0], again[0]) and drawn[1:] == again[1:]


def test_build_payload_uses_a_given_rng_state_and_refuses_a_malformed_one(tiny_run):
    run = tiny_run(SEED)
    earlier = capture_rng_state()
    torch.rand(3)
    payload = build_payload(run.model, run.optimizer, run.scheduler, run.state, rng=earlier)
    assert payload["rng"] is earlier
    with pytest.raises(CheckpointError):
        build_payload(run.model, run.optimizer, run.scheduler, run.state, rng={"python": None})


def test_a_snapshot_shares_no_memory_with_the_live_objects(tiny_run):
    run = tiny_run(SEED)
    run.train(2)
    snap = TrainingSnapshot.capture(run.model, run.optimizer, run.scheduler, run.state)
    live = run.model.state_dict()["0.weight"]
    copied = snap.model.state_dict()["0.weight"]
    assert torch.equal(live, copied) and live.data_ptr() != copied.data_ptr()
    assert hasattr(snap.model.state_dict(), "_metadata")  # load_state_dict's version info survives
    run.state.losses.append(1.0)
    assert len(snap.state.losses) == 2


def test_three_saves_reusing_buffers_each_hold_exactly_their_own_snapshot(tmp_path, tiny_run):
    run = tiny_run(SEED)
    ckpt = AsyncCheckpointer(CheckpointManager(tmp_path, every_steps=100, keep_last=5))
    expected, pointers = {}, []
    for step in (2, 5, 9):
        run.train(step)
        ckpt.save_async(run.model, run.optimizer, run.scheduler, run.state)
        expected[step] = {
            "model": copy.deepcopy(run.model.state_dict()),
            "optimizer": copy.deepcopy(optimizer_state_with_bindings(run.model, run.optimizer)),
            "state": run.state.to_dict(),
        }
        pointers.append(ckpt._buffers.model.state_dict()["0.weight"].data_ptr())
        ckpt.wait()
    assert len(set(pointers)) == 1  # the second and third snapshots refilled the first one's buffer
    for step, value in expected.items():
        payload = saved_payload(tmp_path, step)
        for bucket, tree in value.items():
            assert_same_tree(payload[bucket], tree)
    assert not torch.equal(expected[2]["model"]["0.weight"], expected[9]["model"]["0.weight"])


def test_a_reused_buffer_whose_shape_changed_is_replaced_not_overwritten(tiny_run):
    run = tiny_run(SEED)
    first = TrainingSnapshot.capture(run.model, run.optimizer, run.scheduler, run.state)
    bigger = torch.nn.Linear(8, 64)  # same key names as a Linear, different shapes
    weight = first.model.state_dict()
    second = TrainingSnapshot.capture(bigger, run.optimizer, run.scheduler, run.state, reuse=first)
    assert torch.equal(second.model.state_dict()["weight"], bigger.weight.detach())
    assert all(t.data_ptr() != second.model.state_dict()["weight"].data_ptr() for t in weight.values())


def test_a_failed_background_save_surfaces_on_the_next_call_or_wait(tmp_path, monkeypatch, tiny_run):
    run = tiny_run(SEED)
    mgr = CheckpointManager(tmp_path, every_steps=5)
    ckpt = AsyncCheckpointer(mgr)
    run.train(5, after_step=saver(run, ckpt))
    assert ckpt.wait() == tmp_path / "step-00000005"

    def broken(self_: Any, data: Any) -> int:
        raise OSError(28, "No space left on device (test)")

    monkeypatch.setattr(integrity.FooterWriter, "write", broken)
    run.train(10, after_step=saver(run, ckpt))  # save_async(10) returns; the write fails behind it
    with pytest.raises(CheckpointError, match=r"step[- ]0*10") as failed:
        ckpt.save_async(run.model, run.optimizer, run.scheduler, run.state)  # the next call reports it
    assert isinstance(failed.value.__cause__, OSError)
    assert not ckpt.in_flight and ckpt.wait() is None  # reported once; that call started nothing

    run.train(11)
    ckpt.save_async(run.model, run.optimizer, run.scheduler, run.state)
    with pytest.raises(CheckpointError, match=r"step[- ]0*11"):
        ckpt.wait()
    monkeypatch.undo()

    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000005"]  # no staging left behind
    fresh = tiny_run(SEED)
    state = CheckpointManager(tmp_path, every_steps=5).restore_latest(
        fresh.model, fresh.optimizer, fresh.scheduler
    )
    assert state is not None and state.step == 5


def test_a_checkpoint_error_in_the_writer_is_raised_as_it_is(tmp_path, tiny_run):
    run = tiny_run(SEED)
    run.train(2)
    mgr = CheckpointManager(tmp_path, every_steps=100)
    mgr.save(run.model, run.optimizer, run.scheduler, run.state)
    ckpt = AsyncCheckpointer(mgr)
    ckpt.save_async(run.model, run.optimizer, run.scheduler, run.state)  # step 2 again
    with pytest.raises(CheckpointError, match="already saved") as info:
        ckpt.wait()
    assert info.value.__cause__ is None


def test_leaving_the_block_after_an_error_keeps_that_error_and_logs_the_failed_save(
    tmp_path, monkeypatch, tiny_run, caplog
):
    def broken(self_: Any, data: Any) -> int:
        raise OSError(5, "I/O error (test)")

    monkeypatch.setattr(integrity.FooterWriter, "write", broken)
    run = tiny_run(SEED)
    run.train(2)
    with pytest.raises(KeyError, match="the body's own error"):
        with AsyncCheckpointer(CheckpointManager(tmp_path, every_steps=100)) as ckpt:
            ckpt.save_async(run.model, run.optimizer, run.scheduler, run.state)
            raise KeyError("the body's own error")
    assert "asynchronous save failed" in caplog.text and "step 2" in caplog.text
    assert not ckpt.in_flight


def test_a_bad_state_is_refused_on_the_calling_thread_and_starts_nothing(tmp_path, tiny_run):
    run = tiny_run(SEED)
    ckpt = AsyncCheckpointer(CheckpointManager(tmp_path, every_steps=100))
    with pytest.raises(CheckpointError, match="TrainState"):
        ckpt.save_async(run.model, run.optimizer, run.scheduler, {"step": 3})
    assert not ckpt.in_flight and ckpt.wait() is None and list(tmp_path.iterdir()) == []


def test_save_async_from_the_writer_thread_is_refused(tmp_path, tiny_run):
    run = tiny_run(SEED)
    run.train(2)
    holder: list[AsyncCheckpointer] = []

    def hook(name: str, info: dict[str, Any]) -> None:
        if name == "save_begin":
            holder[0].save_async(run.model, run.optimizer, run.scheduler, run.state)

    with pytest.raises(CheckpointError, match="writer thread"):
        with AsyncCheckpointer(CheckpointManager(tmp_path, every_steps=100, on_event=hook)) as ckpt:
            holder.append(ckpt)
            ckpt.save_async(run.model, run.optimizer, run.scheduler, run.state)
    assert list(tmp_path.iterdir()) == []


def test_only_one_save_is_in_flight(tmp_path, monkeypatch, tiny_run):
    gate = Gate()
    gate.on_writes(monkeypatch)
    events: list[tuple[str, int]] = []
    mgr = CheckpointManager(tmp_path, every_steps=100, on_event=lambda n, i: events.append((n, i["step"])))
    ckpt = AsyncCheckpointer(mgr)
    run = tiny_run(SEED)
    run.train(2)
    ckpt.save_async(run.model, run.optimizer, run.scheduler, run.state)
    gate.wait_for_writer()
    run.train(3)
    second = threading.Thread(
        target=ckpt.save_async, args=(run.model, run.optimizer, run.scheduler, run.state)
    )
    second.start()
    second.join(0.2)  # correct code blocks here until the gate opens; a second writer would show below
    assert second.is_alive()
    assert [s for n, s in events if n == "save_begin"] == [2]
    gate.open()
    second.join(30)
    assert ckpt.wait() == tmp_path / "step-00000003"
    assert [(n, s) for n, s in events if n in ("save_begin", "published")] == [
        ("save_begin", 2),
        ("published", 2),
        ("save_begin", 3),
        ("published", 3),
    ]


def test_the_time_rule_does_not_fire_again_while_a_save_is_in_flight(tmp_path, tiny_run):
    gate = Gate()
    clock = [0.0]
    mgr = CheckpointManager(
        tmp_path, every_seconds=10, clock=lambda: clock[0], on_event=gate.at_event("part_begin")
    )
    ckpt = AsyncCheckpointer(mgr)
    run = tiny_run(SEED)
    run.train(2)
    clock[0] = 10.0
    assert ckpt.should_save(2)
    ckpt.save_async(run.model, run.optimizer, run.scheduler, run.state)
    gate.wait_for_writer()
    clock[0] = 30.0  # the write is slow; the manager's timer still counts from 0
    assert mgr.should_save(3) and not ckpt.should_save(3)
    gate.open()
    ckpt.wait()
    assert not ckpt.should_save(3)  # the timer restarted when step 2 was published, at 30
    clock[0] = 40.0
    assert ckpt.should_save(3)


def killed_writer_child(tiny_run: Any, run_dir: Path, gate_file: Path) -> None:
    """Save step 4 for good, then hang the step-8 write after creating ``gate_file``."""
    run = tiny_run(SEED)
    ckpt = AsyncCheckpointer(CheckpointManager(run_dir, every_steps=4))
    run.train(4, after_step=saver(run, ckpt))
    ckpt.wait()
    original = integrity.FooterWriter.write

    def hang(self_: Any, data: Any) -> int:
        if threading.current_thread() is not threading.main_thread():
            gate_file.touch()
            threading.Event().wait()  # until SIGKILL
        return original(self_, data)

    integrity.FooterWriter.write = hang  # type: ignore[method-assign]
    run.train(8, after_step=saver(run, ckpt))
    ckpt.wait()
    os._exit(3)  # never reached when the kill lands


def test_a_sigkill_during_an_async_write_leaves_the_previous_save_restorable(tmp_path, tiny_run):
    losses, _ = reference(tiny_run, 12)
    run_dir, gate_file = tmp_path / "run", tmp_path / "writing"
    child = multiprocessing.get_context("fork").Process(
        target=killed_writer_child, args=(tiny_run, run_dir, gate_file)
    )
    child.start()
    try:
        deadline = time.monotonic() + 30
        while not gate_file.exists() and child.is_alive() and time.monotonic() < deadline:
            time.sleep(0.01)  # polling for the gate, not timing anything
        assert gate_file.exists(), "the child never reached the step-8 write"
        os.kill(child.pid, signal.SIGKILL)
        child.join(30)
    finally:
        if child.is_alive():
            child.kill()
    assert child.exitcode == -signal.SIGKILL
    left = sorted(p.name for p in run_dir.iterdir())
    assert left[0].startswith(".staging-step-00000008-") and left[1:] == ["step-00000004"]

    fresh = tiny_run(SEED)
    mgr = CheckpointManager(run_dir, every_steps=4)  # removes the dead writer's staging folder
    assert sorted(p.name for p in run_dir.iterdir()) == ["step-00000004"]
    fresh.state = mgr.restore_latest(fresh.model, fresh.optimizer, fresh.scheduler)
    assert fresh.state is not None and fresh.state.step == 4
    fresh.train(12)
    assert fresh.state.losses == losses


def test_writer_nice_lowers_only_the_writer_threads_priority(tmp_path, tiny_run, monkeypatch):
    run = tiny_run(0)
    run.train(2)
    mgr = CheckpointManager(tmp_path / "run", every_steps=1)
    seen: list[int] = []
    real_save = mgr.save

    def save(*args, **kwargs):
        seen.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))
        return real_save(*args, **kwargs)

    monkeypatch.setattr(mgr, "save", save)
    mine = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    with AsyncCheckpointer(mgr, writer_nice=10) as ckpt:
        ckpt.save_async(run.model, run.optimizer, run.scheduler, run.state)
        assert ckpt.wait().name == "step-00000002"
    assert seen == [min(19, mine + 10)]
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == mine  # training thread untouched


@pytest.mark.parametrize("nice", [-1, 20, 2.5, True, "10"])
def test_a_writer_nice_outside_0_to_19_is_refused(tmp_path, nice):
    mgr = CheckpointManager(tmp_path / "run", every_steps=1)
    with pytest.raises(CheckpointError, match="writer_nice must be an int from 0 to 19"):
        AsyncCheckpointer(mgr, writer_nice=nice)


def test_close_gives_back_the_snapshot_buffers_a_full_copy_of_the_state(tmp_path):
    import gc
    import weakref

    model = torch.nn.Linear(256, 256)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(4, 256)).sum().backward()
    opt.step()
    ckpt = AsyncCheckpointer(CheckpointManager(tmp_path / "run", keep_last=1, every_steps=1))
    ckpt.save_async(1, {"model": model, "optimizer": opt})
    ckpt.wait()
    kept = weakref.ref(ckpt._payload_buffers["objects"]["model"]["weight"])
    ckpt.close()
    gc.collect()
    assert kept() is None
