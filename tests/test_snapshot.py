"""The snapshot's deferred copies (``overlap_copy=...``): large tensors copied on the writer thread.

By default (``"optimizer"``) the optimizer's moments are deferred; ``True`` defers
parameters too.

The writer is held before its copies by wrapping ``DeferredCopies.run`` with a
gate, so "the optimizer step waits for the copy" is a fact of the test, not a
matter of timing.
"""

from __future__ import annotations

import threading

import pytest
import torch
from torch.optim.optimizer import _global_optimizer_pre_hooks

from ckpt_lesson.errors import CheckpointError
from ckpt_lesson.files.checkpoint import TrainState
from ckpt_lesson.runs.async_save import AsyncCheckpointer
from ckpt_lesson.runs.manager import CheckpointManager
from ckpt_lesson.runs.snapshot import DeferredCopies, StepGate


def make_run(seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    # 1024 x 1024 weights are 4 MiB: deferred. The batch-norm statistics change in a forward
    # pass, so they must be copied on the training thread; the small bias is too.
    model = torch.nn.Sequential(
        torch.nn.Linear(64, 1024), torch.nn.BatchNorm1d(1024), torch.nn.Linear(1024, 1024)
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    train_step(model, opt)
    return model, opt


def train_step(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    model.train()
    model(torch.randn(16, 64)).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()


def held_writer(monkeypatch: pytest.MonkeyPatch) -> threading.Event:
    """Hold the writer thread before its deferred copies until the returned event is set."""
    release = threading.Event()
    original = DeferredCopies.run

    def run(self: DeferredCopies, step: int | None = None) -> None:
        release.wait(timeout=60)
        original(self, step)

    monkeypatch.setattr(DeferredCopies, "run", run)
    return release


def clone_state(obj: torch.nn.Module | torch.optim.Optimizer) -> dict:
    sd = obj.state_dict()
    if isinstance(obj, torch.nn.Module):
        return {k: v.clone() for k, v in sd.items()}
    return {k: {kk: vv.clone() for kk, vv in v.items()} for k, v in sd["state"].items()}


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(
        torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) else same(a[k], b[k]) for k in a
    )


@pytest.mark.parametrize("form", ["state", "positional"])
def test_an_overlapped_save_holds_the_values_from_before_the_next_optimizer_step(tmp_path, monkeypatch, form):
    model, opt = make_run()
    release = held_writer(monkeypatch)
    mgr = CheckpointManager(tmp_path / "run", keep_last=2, every_steps=1)
    ckpt = AsyncCheckpointer(mgr, overlap_copy=True)
    weights, moments = clone_state(model), clone_state(opt)
    if form == "state":
        ckpt.save_async(1, {"model": model, "optimizer": opt})
    else:
        ckpt.save_async(model, opt, None, TrainState(step=1))
    assert ckpt.copying  # the large tensors are not copied yet

    # The next training step runs on another thread: its forward and backward go ahead (batch-norm
    # statistics change), its optimizer step must wait for the writer's copies.
    stepped = threading.Event()

    def next_step() -> None:
        train_step(model, opt)
        stepped.set()

    trainer = threading.Thread(target=next_step)
    trainer.start()
    assert not stepped.wait(timeout=0.5), "the optimizer step ran before the snapshot was copied"
    assert same(clone_state(opt), moments)
    release.set()
    trainer.join(timeout=60)
    assert stepped.is_set() and not same(clone_state(model), weights)
    assert ckpt.step_wait_s > 0  # the step's time at the gate is what the save cost training
    ckpt.close()

    fresh, fresh_opt = make_run(seed=1)
    if form == "state":
        mgr.restore_latest({"model": fresh, "optimizer": fresh_opt})
    else:
        mgr.restore_latest(fresh, fresh_opt, None)
    assert same(clone_state(fresh), weights) and same(clone_state(fresh_opt), moments)


def test_only_large_parameters_and_moments_are_deferred_never_buffers_or_small_tensors():
    model, opt = make_run()
    later = DeferredCopies([model, opt])
    deferred = {name for name, t in model.state_dict().items() if later.wants(t)}
    assert deferred == {"2.weight"}  # 4 MiB; the first layer's 256 KiB and every bias are small
    assert not later.wants(model[1].running_mean)  # a buffer: a forward pass changes it
    moments = [t for s in opt.state.values() for t in s.values() if t.nbytes >= 1 << 20]
    assert moments and all(later.wants(t) for t in moments)


def test_a_shut_gate_holds_every_optimizer_step_until_it_opens():
    model, opt = make_run()
    gate = StepGate()
    try:
        gate.shut()
        done = threading.Event()
        worker = threading.Thread(target=lambda: (train_step(model, opt), done.set()))
        worker.start()
        assert not done.wait(timeout=0.5)
        gate.open()
        worker.join(timeout=60)
        assert done.is_set()
    finally:
        gate.remove()


def test_close_unregisters_the_step_hook(tmp_path):
    model, opt = make_run()
    before = len(_global_optimizer_pre_hooks)
    with AsyncCheckpointer(
        CheckpointManager(tmp_path / "run", keep_last=1, every_steps=1), overlap_copy=True
    ) as ckpt:
        ckpt.save_async(1, {"model": model, "optimizer": opt})
        assert len(_global_optimizer_pre_hooks) == before + 1
    assert len(_global_optimizer_pre_hooks) == before and not ckpt.copying


def test_by_default_moments_wait_for_the_writer_and_parameters_are_copied_at_once(tmp_path, monkeypatch):
    model, opt = make_run()
    release = held_writer(monkeypatch)
    mgr = CheckpointManager(tmp_path / "run", keep_last=2, every_steps=1)
    ckpt = AsyncCheckpointer(mgr)  # overlap_copy="optimizer"
    weights, moments = clone_state(model), clone_state(opt)
    ckpt.save_async(1, {"model": model, "optimizer": opt})
    assert ckpt.copying  # the moments are not copied yet
    with torch.no_grad():  # a parameter written in place before the next step: the snapshot has its copy
        model[2].weight.mul_(0.5)
    release.set()
    ckpt.wait()
    train_step(model, opt)
    ckpt.close()
    fresh, fresh_opt = make_run(seed=1)
    mgr.restore_latest({"model": fresh, "optimizer": fresh_opt})
    assert same(clone_state(fresh), weights) and same(clone_state(fresh_opt), moments)


def test_only_moments_are_deferred_by_default():
    model, opt = make_run()
    later = DeferredCopies([model, opt], parameters=False)
    assert not any(later.wants(t) for t in model.state_dict().values())
    moments = [t for s in opt.state.values() for t in s.values() if t.nbytes >= 1 << 20]
    assert moments and all(later.wants(t) for t in moments)


def test_a_moment_written_in_place_before_its_copy_fails_the_save_by_name(tmp_path, monkeypatch):
    model, opt = make_run()
    release = held_writer(monkeypatch)
    mgr = CheckpointManager(tmp_path / "run", keep_last=2, every_steps=1)
    ckpt = AsyncCheckpointer(mgr)
    ckpt.save_async(1, {"model": model, "optimizer": opt})
    for state in opt.state.values():  # a reset of the moments outside step(): breaks the contract
        state["exp_avg"].zero_()
    release.set()
    with pytest.raises(CheckpointError, match=r"step 1: .*written in place.*overlap_copy=False"):
        ckpt.wait()
    assert mgr.all_steps() == []  # nothing of the torn snapshot was published
    ckpt.close()


def test_overlap_copy_must_be_true_false_or_optimizer(tmp_path):
    with pytest.raises(CheckpointError, match="overlap_copy must be True, False or 'optimizer'"):
        AsyncCheckpointer(CheckpointManager(tmp_path / "run", every_steps=1), overlap_copy="yes")  # type: ignore[arg-type]
