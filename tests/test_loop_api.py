"""The loop verbs: ``resume`` builds the state, restores it and says where to start; ``save_if_due``."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import ckpt_lesson as cl


def parts(seed: int = 0):
    torch.manual_seed(seed)
    model = torch.nn.Linear(4, 2)
    return model, torch.optim.AdamW(model.parameters(), lr=0.1)


def train(model, opt) -> None:
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    opt.zero_grad()


def test_resume_on_a_fresh_folder_starts_at_zero_and_keeps_the_values_given(tmp_path):
    model, opt = parts()
    mgr = cl.CheckpointManager(tmp_path / "run", every_steps=2)
    start, state = mgr.resume(model=model, optimizer=opt, best=9.0)
    assert start == 0 and mgr.restored is None
    assert state == {"model": model, "optimizer": opt, "best": 9.0}


def test_save_if_due_saves_on_the_cadence_only_and_resume_restores_in_place_with_values(tmp_path):
    model, opt = parts()
    mgr = cl.CheckpointManager(tmp_path / "run", every_steps=2)
    start, state = mgr.resume({"model": model}, optimizer=opt, best=9.0)
    results = []
    for step in range(start + 1, 6):
        train(model, opt)
        state["best"] = float(step)
        results.append(mgr.save_if_due(step, state))
    assert [r is not None for r in results] == [False, True, False, True, False]
    assert mgr.all_steps() == [2, 4]
    saved = {k: v.clone() for k, v in model.state_dict().items()}  # after step 5, not saved

    model2, opt2 = parts(seed=1)
    mgr2 = cl.CheckpointManager(tmp_path / "run", every_steps=2)
    start, state2 = mgr2.resume(model=model2, optimizer=opt2, best=0.0)
    assert start == 4 and mgr2.restored.step == 4
    assert state2["model"] is model2 and state2["best"] == 4.0  # the value from the save
    assert not torch.equal(model2.weight, saved["weight"])  # step 4's weights, not step 5's
    assert opt2.state_dict()["state"][0]["step"] == 4


def test_save_if_due_passes_an_rng_snapshot_through(tmp_path):
    model, opt = parts()
    mgr = cl.CheckpointManager(tmp_path / "run", every_steps=1)
    snapshot = cl.capture_rng_state()
    expected = torch.rand(3)  # what the generator gives right after the snapshot
    mgr.save_if_due(1, {"model": model}, rng=snapshot)
    torch.rand(5)
    mgr.resume(model=model)
    assert torch.equal(torch.rand(3), expected)


@pytest.mark.parametrize(
    "call, pattern",
    [
        (lambda m, model: m.resume(), "no parts to restore"),
        (lambda m, model: m.resume({"model": model}, model=model), r"\['model'\] given in the mapping and"),
    ],
)
def test_resume_refuses_no_parts_and_a_name_given_twice(tmp_path, call, pattern):
    model, _ = parts()
    with pytest.raises(cl.CheckpointError, match=pattern):
        call(cl.CheckpointManager(tmp_path / "run", every_steps=1), model)


def test_resume_refuses_a_part_the_save_lacks_by_name_as_restore_latest_does(tmp_path):
    model, opt = parts()
    mgr = cl.CheckpointManager(tmp_path / "run", every_steps=1)
    mgr.save_if_due(1, {"model": model})
    with pytest.raises(cl.CheckpointError, match="optimizer"):
        cl.CheckpointManager(tmp_path / "run", every_steps=1).resume(model=model, optimizer=opt)


def test_a_manager_given_no_folder_saves_into_the_variable_else_checkpoints(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("CKPT_LESSON_CKPT_DIR", raising=False)
    assert cl.CheckpointManager(every_steps=1).run_dir == Path("checkpoints")
    monkeypatch.setenv("CKPT_LESSON_CKPT_DIR", str(tmp_path / "under-test"))
    assert cl.CheckpointManager(every_steps=1).run_dir == tmp_path / "under-test"
    # A folder the script names wins: the variable never moves it.
    assert cl.CheckpointManager(tmp_path / "named", every_steps=1).run_dir == tmp_path / "named"
    monkeypatch.setenv("CKPT_LESSON_CKPT_DIR", "s3://bucket/run")
    with pytest.raises(cl.CheckpointError, match=r"is a URL; pass it to the manager explicitly"):
        cl.CheckpointManager(every_steps=1)


def test_resume_restores_a_tensor_and_a_tuple_of_tensors_in_place_and_keeps_them_in_the_state(tmp_path):
    model, _ = parts()
    mgr = cl.CheckpointManager(tmp_path / "run", every_steps=1)
    hidden, count = (torch.zeros(2, 3), torch.zeros(2, 3)), torch.tensor(0)
    start, state = mgr.resume(model=model, hidden=hidden, count=count)
    assert start == 0 and state["hidden"] is hidden  # a first run keeps what it was given
    mgr.save_if_due(1, {**state, "hidden": (torch.full((2, 3), 1.0), torch.full((2, 3), 2.0)), "count": 7})
    mgr.save_if_due(2, {**state, "hidden": (torch.full((2, 3), 3.0), torch.full((2, 3), 4.0)), "count": 9})

    fresh = (torch.zeros(2, 3), torch.zeros(2, 3))
    start, state = cl.CheckpointManager(tmp_path / "run", every_steps=1).resume(
        model=model, hidden=fresh, count=0
    )
    assert start == 2 and state["hidden"] is fresh  # the same tuple, the same tensors, the saved values
    assert torch.equal(fresh[0], torch.full((2, 3), 3.0)) and torch.equal(fresh[1], torch.full((2, 3), 4.0))
    assert state["count"] == 9  # not a tensor: back in the state, as before


F32 = r"torch.float32 tensor"


@pytest.mark.parametrize(
    "given, pattern",
    [
        (
            (torch.zeros(2, 4), torch.zeros(2, 3)),
            rf"hidden\[0\] is a \(2, 4\) {F32}, the save of step 1 holds a \(2, 3\)",
        ),
        (
            (torch.zeros(2, 3), torch.zeros(2, 3, dtype=torch.float64)),
            r"hidden\[1\] is a \(2, 3\) torch.float64",
        ),
        ((torch.zeros(2, 3),) * 3, r"hidden is a tuple of 3, the save of step 1 holds a tuple of 2"),
        (torch.zeros(2, 3), rf"hidden is a \(2, 3\) {F32}, the save of step 1 holds a tuple of 2"),
    ],
)
def test_resume_refuses_a_tensor_value_unlike_the_saved_one_by_name_and_writes_none(tmp_path, given, pattern):
    model, _ = parts()
    mgr = cl.CheckpointManager(tmp_path / "run", every_steps=1)
    mgr.save_if_due(1, {"model": model, "hidden": (torch.ones(2, 3), torch.ones(2, 3)), "h0": torch.ones(1)})
    h0 = torch.zeros(1)
    with pytest.raises(cl.CheckpointError, match=pattern):
        cl.CheckpointManager(tmp_path / "run", every_steps=1).resume(model=model, h0=h0, hidden=given)
    assert torch.equal(h0, torch.zeros(1))  # checked before the first copy: nothing was written
    assert all(torch.equal(t, torch.zeros_like(t)) for t in ([given] if torch.is_tensor(given) else given))


@pytest.mark.parametrize("manager", [cl.CheckpointManager, cl.DistributedCheckpointManager])
def test_a_refused_tensor_value_leaves_the_model_optimizer_and_rng_as_they_were(tmp_path, manager):
    # The tensor check runs before the restore applies anything: a refusal restores nothing at all.
    model, opt = parts(seed=0)
    train(model, opt)
    mgr = manager(tmp_path / "run", every_steps=1)
    mgr.save_if_due(1, {"model": model, "optimizer": opt, "h": torch.ones(2)})
    mgr.close()
    fresh, fresh_opt = parts(seed=1)
    before = {k: v.clone() for k, v in fresh.state_dict().items()}
    torch.manual_seed(123)
    rng_before = torch.get_rng_state()
    with pytest.raises(cl.CheckpointError, match=r"h is a \(3,\) torch.float32 tensor, the save of step 1"):
        manager(tmp_path / "run", every_steps=1).resume(model=fresh, optimizer=fresh_opt, h=torch.zeros(3))
    assert all(torch.equal(before[k], v) for k, v in fresh.state_dict().items())
    assert fresh_opt.state_dict()["state"] == {}  # no moments restored onto the fresh optimizer
    assert torch.equal(torch.get_rng_state(), rng_before)


def test_resume_refuses_two_tensors_of_one_value_that_share_memory(tmp_path):
    model, _ = parts()
    mgr = cl.CheckpointManager(tmp_path / "run", every_steps=1)
    mgr.save_if_due(1, {"model": model, "hidden": (torch.ones(3), torch.full((3,), 2.0))})
    same = torch.zeros(3)
    with pytest.raises(cl.CheckpointError, match="two tensors of 'hidden' share memory"):
        cl.CheckpointManager(tmp_path / "run", every_steps=1).resume(model=model, hidden=(same, same))


def test_save_if_due_saves_the_last_step_off_the_cadence_then_closes_the_manager(tmp_path):
    model, opt = parts()
    mgr = cl.CheckpointManager(tmp_path / "run", every_steps=4)
    start, state = mgr.resume(model=model, optimizer=opt)
    saved = [mgr.save_if_due(step, state, last_step=6) is not None for step in range(start + 1, 7)]
    assert saved == [False, False, False, True, False, True] and mgr.all_steps() == [4, 6]
    with pytest.raises(cl.CheckpointError, match="closed"):  # closed after the last step's save
        mgr.save(7, state)
    assert cl.CheckpointManager(tmp_path / "run", every_steps=4).resume(model=model, optimizer=opt)[0] == 6


def test_a_distributed_manager_saves_its_last_step_and_closes_there_too(tmp_path):
    # One process without a process group: the same LoopMethods path a torchrun script takes.
    model, opt = parts()
    mgr = cl.DistributedCheckpointManager(tmp_path / "run", every_steps=4)
    start, state = mgr.resume(model=model, optimizer=opt)
    saved = [mgr.save_if_due(step, state, last_step=5) is not None for step in range(start + 1, 6)]
    assert saved == [False, False, False, True, True]
    with pytest.raises(cl.CheckpointError, match="this manager is closed"):
        mgr.save(6, state)
