"""The optimizer fit check: per-parameter state is held to its parameter's shape, flat state is not.

LBFGS keeps whole-model flat tensors (``d``, ``prev_flat_grad``, the lists
``old_dirs`` and ``old_stps``) under its first parameter's entry. Before the
save recorded which keys are per-parameter, every LBFGS save was accepted and
then refused by the restore ("'d' of model.0.weight has shape (41,) but the
parameter has (4, 8)"). Each test here restores a run trained with LBFGS and
continues it, bit for bit, against a run that was never interrupted.
"""

from __future__ import annotations

import pytest
import torch

from ckpt_lesson.files.checkpoint import TrainState, load_checkpoint, save_checkpoint
from ckpt_lesson.files.payload import BINDING_KEY, PARAM_SHAPED_KEY, optimizer_state_with_bindings
from ckpt_lesson.runs.manager import CheckpointManager

STEPS, RESUME_AT = 6, 3


def same(a, b) -> bool:
    """Deep equality where tensors must be bitwise equal (and of the same dtype and shape)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        both = isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
        return both and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    return a == b


class LbfgsRun:
    """A small seeded regression trained with LBFGS (full batch, a closure per step)."""

    def __init__(self, seed: int) -> None:
        torch.manual_seed(seed)
        self.model = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1))
        self.optimizer = torch.optim.LBFGS(self.model.parameters(), lr=0.5, history_size=3, max_iter=4)
        data = torch.Generator().manual_seed(123)  # the same data whatever the seed of the weights
        self.x = torch.randn(16, 8, generator=data)
        self.y = torch.randn(16, 1, generator=data)
        self.losses: list[float] = []

    def closure(self) -> torch.Tensor:
        self.optimizer.zero_grad()
        loss = ((self.model(self.x) - self.y) ** 2).mean()
        loss.backward()
        return loss

    def train(self, steps: int) -> None:
        for _ in range(steps):
            self.losses.append(self.optimizer.step(self.closure).item())


@pytest.fixture(scope="module")
def uninterrupted() -> LbfgsRun:
    run = LbfgsRun(0)
    run.train(STEPS)
    return run


def save_restore(form: str, saved: LbfgsRun, fresh: LbfgsRun, tmp_path) -> None:
    """Save ``saved`` in one of the public forms and restore it into ``fresh``."""
    if form == "save_checkpoint":
        save_checkpoint(saved.model, saved.optimizer, None, TrainState(step=RESUME_AT), tmp_path / "x.pt")
        assert load_checkpoint(tmp_path / "x.pt", fresh.model, fresh.optimizer, None).step == RESUME_AT
        return
    mmap = form.endswith("mapped")
    mgr = CheckpointManager(tmp_path / "run", every_steps=1, num_shards=2 if "sharded" in form else None)
    if form.startswith("state"):
        mgr.save(RESUME_AT, {"model": saved.model, "optimizer": saved.optimizer})
        restored = mgr.restore_latest({"model": fresh.model, "optimizer": fresh.optimizer}, mmap=mmap)
    else:
        mgr.save(saved.model, saved.optimizer, None, TrainState(step=RESUME_AT))
        restored = mgr.restore_latest(fresh.model, fresh.optimizer, None, mmap=mmap)
    assert restored.step == RESUME_AT
    mgr.close()


@pytest.mark.parametrize(
    "form",
    ["state mapped", "state read", "state sharded mapped", "positional mapped", "positional read",
     "save_checkpoint"],
)  # fmt: skip
def test_an_lbfgs_run_restores_exactly_and_continues_bit_for_bit(tmp_path, uninterrupted, form):
    saved = LbfgsRun(0)
    saved.train(RESUME_AT)
    flat = saved.optimizer.state_dict()["state"][0]
    assert flat["d"].shape != saved.model[0].weight.shape and len(flat["old_dirs"]) > 0  # the case at hand
    fresh = LbfgsRun(1)  # other weights, no optimizer state: everything must come from the save
    save_restore(form, saved, fresh, tmp_path)
    assert same(fresh.optimizer.state_dict(), saved.optimizer.state_dict())
    assert same(fresh.model.state_dict(), saved.model.state_dict())
    fresh.train(STEPS - RESUME_AT)
    assert fresh.losses == uninterrupted.losses[RESUME_AT:]
    assert same(fresh.model.state_dict(), uninterrupted.model.state_dict())


def test_the_save_records_only_the_keys_that_hold_their_parameters_shape():
    adamw = LbfgsRun(0)
    adamw.optimizer = torch.optim.AdamW(adamw.model.parameters(), lr=0.1)
    adamw.closure()
    adamw.optimizer.step()
    [group] = optimizer_state_with_bindings(adamw.model, adamw.optimizer)["param_groups"]
    assert group[BINDING_KEY][PARAM_SHAPED_KEY] == ["exp_avg", "exp_avg_sq"]  # not the scalar step
    lbfgs = LbfgsRun(0)
    lbfgs.train(2)
    [group] = optimizer_state_with_bindings(lbfgs.model, lbfgs.optimizer)["param_groups"]
    assert group[BINDING_KEY][PARAM_SHAPED_KEY] == []  # d, prev_flat_grad: the whole model, flat


@pytest.mark.parametrize("form", ["positional", "state"])
def test_a_dataset_description_the_loader_would_refuse_is_refused_before_anything_is_written(tmp_path, form):
    import numpy as np

    from ckpt_lesson.errors import CheckpointError
    from ckpt_lesson.files.payload import build_state_payload

    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = {"fingerprint": np.zeros(2), "order_seed": 1}
    with pytest.raises(CheckpointError, match=r"data\['fingerprint'\] is a numpy.ndarray"):
        if form == "positional":
            save_checkpoint(model, opt, None, TrainState(), tmp_path / "x.pt", data=data)
        else:
            build_state_payload(1, {"model": model}, data=data)
    assert not (tmp_path / "x.pt").exists()
