"""Rank programs for the distributed state-API tests (run by ``launch`` on 2 gloo ranks)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ckpt_lesson.cli.rank_programs import make_run, train_step
from ckpt_lesson.distributed import DistributedCheckpointManager


def w_state_api_train(rank: int, world: int, out: str, kind: str) -> None:
    """Train 6 steps, saving step 3 through the state API; record the losses of steps 4-6."""
    model, opt, sched, sampler = make_run(kind, world, rank)
    mgr = DistributedCheckpointManager(Path(out) / kind, keep_last=2, every_steps=3)
    hidden = torch.full((2,), float(rank))
    losses = []
    for step in range(1, 7):
        losses.append(train_step(model, opt, sched, sampler))
        hidden = hidden + 1
        if step == 3:
            state = {
                "model": model,
                "optimizer": opt,
                "sched": sched,
                "sampler": sampler.get_state(),
                "h": hidden,
            }
            mgr.save(step, state)
    mgr.close()
    (Path(out) / kind / f"train-{rank}.json").write_text(json.dumps(losses[3:]))


def w_state_api_resume(rank: int, world: int, out: str, kind: str) -> None:
    """Restore through the state API in fresh processes and train steps 4-6."""
    model, opt, sched, sampler = make_run(kind, world, rank)
    torch.manual_seed(999)  # a resume must not depend on how this process seeded itself
    mgr = DistributedCheckpointManager(Path(out) / kind, keep_last=2, every_steps=3)
    restored = mgr.restore_latest(
        {"model": model, "optimizer": opt, "sched": sched, "sampler": None, "h": None}
    )
    sampler.set_state(restored.values["sampler"])
    losses = [train_step(model, opt, sched, sampler) for _ in range(restored.step + 1, 7)]
    mgr.close()
    result = {"step": restored.step, "losses": losses, "h": restored.values["h"].tolist()}
    (Path(out) / kind / f"resume-{rank}.json").write_text(json.dumps(result))
