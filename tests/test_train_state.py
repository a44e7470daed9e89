"""The positional form's one check: the file pairs and the manager refuse the same inputs, by part name.

Issue 31, why-item 1: ``save_checkpoint`` / ``load_checkpoint`` used to fail with a raw
``AttributeError`` for ``None`` as optimizer, an object without ``state_dict()`` or
a dict of models, where ``CheckpointManager`` named the part. Both now run
:func:`~ckpt_lesson.files.train_state.check_positional_objects`.
"""

from __future__ import annotations

import pytest
import torch

import ckpt_lesson as cl
from ckpt_lesson.files.train_state import FILE_STATE_API, check_positional_objects


def _build():
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    return model, opt, torch.optim.lr_scheduler.StepLR(opt, step_size=2)


class NoStateDict:
    pass


# (name, (model, optimizer, scheduler) from the built objects, the part the error must name)
BAD = [
    ("none optimizer", lambda m, o, s: (m, None, s), r"optimizer is None.*save_state\(path, step"),
    ("none model", lambda m, o, s: (None, o, s), r"model is None"),
    ("optimizer without state_dict", lambda m, o, s: (m, NoStateDict(), s), r"optimizer is a NoStateDict"),
    ("model without state_dict", lambda m, o, s: (NoStateDict(), o, s), r"model is a NoStateDict"),
    ("scheduler without state_dict", lambda m, o, s: (m, o, NoStateDict()), r"scheduler is a NoStateDict"),
    ("dict of models", lambda m, o, s: ({"gen": m, "disc": m}, o, s), r"model is a dict of 2 entries"),
]
IDS = [b[0] for b in BAD]


@pytest.mark.parametrize(("case", "objects", "pattern"), BAD, ids=IDS)
def test_save_checkpoint_names_the_bad_part_and_writes_nothing(tmp_path, case, objects, pattern):
    target = tmp_path / "c.pt"
    with pytest.raises(cl.CheckpointError, match=pattern) as info:
        cl.save_checkpoint(*objects(*_build()), cl.TrainState(step=1), target)
    assert str(target) in str(info.value)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(("case", "objects", "pattern"), BAD, ids=IDS)
def test_load_checkpoint_names_the_bad_part_and_changes_nothing(tmp_path, case, objects, pattern):
    model, opt, sched = _build()
    cl.save_checkpoint(model, opt, sched, cl.TrainState(step=1), tmp_path / "c.pt")
    live = _build()
    before = {k: v.clone() for k, v in live[0].state_dict().items()}
    with pytest.raises(cl.CheckpointError, match=pattern) as info:
        cl.load_checkpoint(tmp_path / "c.pt", *objects(*live))
    assert str(tmp_path / "c.pt") in str(info.value)
    assert all(torch.equal(v, live[0].state_dict()[k]) for k, v in before.items())


@pytest.mark.parametrize(("case", "objects", "pattern"), BAD, ids=IDS)
def test_the_sharded_pair_names_the_bad_part(tmp_path, case, objects, pattern):
    with pytest.raises(cl.CheckpointError, match=pattern):
        cl.save_sharded_checkpoint(*objects(*_build()), cl.TrainState(step=1), tmp_path / "new", num_shards=2)
    assert not (tmp_path / "new" / "index.json").exists()
    model, opt, sched = _build()
    cl.save_sharded_checkpoint(model, opt, sched, cl.TrainState(step=1), tmp_path / "ok", num_shards=2)
    with pytest.raises(cl.CheckpointError, match=pattern):
        cl.load_sharded_checkpoint(tmp_path / "ok", *objects(*_build()))


@pytest.mark.parametrize(("case", "objects", "pattern"), BAD, ids=IDS)
def test_the_manager_refuses_exactly_the_same_inputs(tmp_path, case, objects, pattern):
    part = pattern.split(" ")[0]
    with pytest.raises(cl.CheckpointError, match=part):
        cl.CheckpointManager(tmp_path / "a", every_steps=1).save(*objects(*_build()), cl.TrainState(step=1))
    model, opt, sched = _build()
    cl.CheckpointManager(tmp_path / "b", every_steps=1).save(model, opt, sched, cl.TrainState(step=1))
    with pytest.raises(cl.CheckpointError, match=part):
        cl.CheckpointManager(tmp_path / "b", every_steps=1).restore_latest(*objects(*_build()))


def test_none_as_scheduler_means_a_run_without_one_in_the_file_pair_as_in_the_manager(tmp_path):
    model, opt, _ = _build()
    cl.save_checkpoint(model, opt, None, cl.TrainState(step=2), tmp_path / "c.pt")
    cl.CheckpointManager(tmp_path / "run", every_steps=1).save(model, opt, None, cl.TrainState(step=2))
    live, live_opt, _ = _build()
    assert cl.load_checkpoint(tmp_path / "c.pt", live, live_opt, None).step == 2
    assert (
        cl.CheckpointManager(tmp_path / "run", every_steps=1).restore_latest(live, live_opt, None).step == 2
    )


def test_a_save_needs_only_state_dict_but_a_load_needs_load_state_dict_too():
    class SaveOnly:  # an asynchronous snapshot's stand-in: state_dict() and nothing else
        def state_dict(self):
            return {}

    model, _, _ = _build()
    check_positional_objects(model, SaveOnly(), None, loading=False, state_api=FILE_STATE_API)
    with pytest.raises(cl.CheckpointError, match=r"optimizer is a SaveOnly.*load_state_dict"):
        check_positional_objects(model, SaveOnly(), None, loading=True, state_api=FILE_STATE_API)
