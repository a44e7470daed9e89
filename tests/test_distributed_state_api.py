"""The state API on many ranks: DDP and FSDP2 on 2 gloo ranks resume bit for bit."""

from __future__ import annotations

import json

import pytest
import torch
from _distributed_local import save_locally
from _state_api_workers import w_state_api_resume, w_state_api_train

import ckpt_lesson as cl
from ckpt_lesson.distributed import DistributedCheckpointManager
from ckpt_lesson.faults.rank_launch import launch


@pytest.mark.parametrize("kind", ["ddp", "fsdp"])
def test_a_state_api_save_on_two_ranks_resumes_bit_for_bit(tmp_path, kind):
    assert launch(w_state_api_train, 2, tmp_path, str(tmp_path), kind) == [0, 0]
    assert launch(w_state_api_resume, 2, tmp_path, str(tmp_path), kind) == [0, 0]
    for rank in (0, 1):
        trained = json.loads((tmp_path / kind / f"train-{rank}.json").read_text())
        resumed = json.loads((tmp_path / kind / f"resume-{rank}.json").read_text())
        assert resumed["step"] == 3 and resumed["losses"] == trained  # exact, per rank
        assert resumed["h"] == [rank + 3.0, rank + 3.0]  # each rank gets its own values back


def test_two_modules_are_refused_with_the_fix(tmp_path):
    mgr = DistributedCheckpointManager(tmp_path, keep_last=2, every_steps=1)
    with pytest.raises(cl.CheckpointError, match="one nn.Module part.*ModuleDict"):
        mgr.save(1, {"g": torch.nn.Linear(2, 2), "d": torch.nn.Linear(2, 2)})
    mgr.close()


def test_a_positional_save_is_refused_by_a_state_api_restore_naming_the_difference(tmp_path):
    save_locally(tmp_path, steps=(2,))
    model = torch.nn.Sequential(
        torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Dropout(0.1), torch.nn.Linear(16, 4)
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    mgr = DistributedCheckpointManager(tmp_path, keep_last=5, every_steps=2)
    # The positional save holds a scheduler in DCP's shared state; the state API keeps it per rank.
    with pytest.raises(cl.StateMismatchError, match="saved with a scheduler"):
        mgr.restore_latest({"model": model, "optimizer": opt})
    mgr.close()


def test_wrapped_saves_restore_into_plain_models_and_the_reverse_in_every_saver(tmp_path):
    from _state_api_workers import w_wrapped_round_trips

    assert launch(w_wrapped_round_trips, 1, tmp_path, str(tmp_path)) == [0]
    results = json.loads((tmp_path / "wrapped.json").read_text())
    assert len(results) == 6
    failed = {case: [saver for saver, ok in savers.items() if not ok] for case, savers in results.items()}
    assert failed == {case: [] for case in results}


def test_a_model_without_an_optimizer_saves_and_restores_through_dcp(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    mgr = DistributedCheckpointManager(tmp_path, keep_last=2, every_steps=1)
    mgr.save(4, {"model": model, "ema_decay": 0.99})
    mgr.close()
    fresh = torch.nn.Linear(3, 2)
    mgr = DistributedCheckpointManager(tmp_path, keep_last=2, every_steps=1)
    restored = mgr.restore_latest({"model": fresh, "ema_decay": None})
    mgr.close()
    assert restored.step == 4 and restored.values == {"ema_decay": 0.99}
    assert torch.equal(fresh.weight, model.weight) and torch.equal(fresh.bias, model.bias)


@pytest.mark.parametrize("given", ["optimizer is None", "scheduler left out", "an extra scheduler"])
def test_a_restore_refused_for_its_part_names_leaves_the_weights_and_moments_untouched(tmp_path, given):
    # The part check used to run after DCP had loaded into the live model and optimizer (and after the
    # load template had created a fresh optimizer's moments): now the rank's blob is read and checked first.
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1)
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    mgr = DistributedCheckpointManager(tmp_path, keep_last=2, every_steps=1)
    mgr.save(4, {"model": model, "optimizer": opt, "scheduler": sched})
    mgr.close()
    fresh = torch.nn.Linear(3, 2)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=0.1)
    state = {
        "model": fresh,
        "optimizer": fresh_opt,
        "scheduler": torch.optim.lr_scheduler.StepLR(fresh_opt, 1),
    }
    if given == "optimizer is None":
        state["optimizer"], pattern = None, r"part 'optimizer'.*holds None"
    elif given == "an extra scheduler":
        state["warmup"], pattern = torch.optim.lr_scheduler.StepLR(fresh_opt, 2), r"parts \['warmup'\]"
    else:
        del state["scheduler"]
        pattern = r"parts \['scheduler'\]"
    before = [p.clone() for p in fresh.parameters()]
    mgr = DistributedCheckpointManager(tmp_path, keep_last=2, every_steps=1)
    with pytest.raises(cl.StateMismatchError, match=pattern):
        mgr.restore_latest(state)
    mgr.close()
    assert all(torch.equal(a, b) for a, b in zip(before, fresh.parameters(), strict=True))
    assert fresh_opt.state_dict()["state"] == {}  # no moments loaded either
