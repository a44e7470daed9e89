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
