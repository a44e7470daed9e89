"""Write the golden set: saves made by this code, committed so later code must still restore them.

Run from the repository root (it rewrites ``tests/golden/files/``):

    PYTHONPATH=$PWD python tests/golden/make_golden.py

Every tensor is built from integer arithmetic (``arange`` scaled by powers of
two), never from a matrix product or a training step, so the expected values
that ``tests/test_golden_saves.py`` recomputes are the same bits on any CPU.
The optimizer's moments and the scheduler's position are set through
``load_state_dict`` for the same reason. Regenerate only on purpose: the point
of the set is that it was written by older code.
"""

from __future__ import annotations

import random
import shutil
import sys
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
FILES = HERE / "files"
RNG_SEED = 1234
MANAGED_STEPS = (2, 4, 6)


def seed_all(seed: int = RNG_SEED) -> None:
    """The generators every save records; a restore must bring back exactly this state."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def _ramp(shape: tuple[int, ...], offset: float) -> torch.Tensor:
    n = 1
    for d in shape:
        n *= d
    return ((torch.arange(n, dtype=torch.float32) - 3) / 8 + offset).reshape(shape)


def build(step: int = 3) -> tuple[torch.nn.Module, torch.optim.Optimizer, Any]:
    """The model, optimizer and scheduler as they are at ``step`` (all values exact in float32)."""
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    with torch.no_grad():
        for i, p in enumerate(model.parameters()):
            p.copy_(_ramp(tuple(p.shape), i + step / 4))
    opt = torch.optim.AdamW(model.parameters(), lr=0.5)
    sd = opt.state_dict()
    sd["state"] = {
        i: {
            "step": torch.tensor(float(step)),
            "exp_avg": _ramp(tuple(p.shape), -i / 2),
            "exp_avg_sq": _ramp(tuple(p.shape), 4.0).abs() / 16,
        }
        for i, p in enumerate(model.parameters())
    }
    opt.load_state_dict(sd)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # stepping the schedule without optimizer steps is the point here
        for _ in range(step):
            sched.step()
    return model, opt, sched


def values() -> dict[str, Any]:
    """The plain values of the state-API save."""
    return {
        "best": 0.25,
        "hidden": torch.arange(6, dtype=torch.float32).reshape(2, 3) / 4,
        "tags": ["warmup", "decay"],
        "counts": {"seen": 12, "skipped": 1},
    }


def train_state(step: int) -> Any:
    from ckpt_lesson.files.train_state import TrainState

    return TrainState(
        step=step, epoch=step // 4, batch_in_epoch=step % 4, losses=[1.0 / (k + 1) for k in range(step)]
    )


def make(out: Path = FILES) -> list[Path]:
    """Write every golden save under ``out`` (emptied first); returns the committed paths."""
    import ckpt_lesson as cl

    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    model, opt, sched = build()
    seed_all()
    cl.save_checkpoint(model, opt, sched, train_state(3), out / "single.pt")
    seed_all()
    cl.save_sharded_checkpoint(model, opt, sched, train_state(3), out / "sharded", num_shards=2)
    seed_all()
    cl.write_legacy_v1_checkpoint(model, opt, sched, train_state(3), out / "lesson_v1.pt")
    seed_all()
    cl.save_state(
        out / "state_values.pt", 3, {"model": model, "optimizer": opt, "scheduler": sched, **values()}
    )
    with cl.CheckpointManager(out / "managed", keep_last=len(MANAGED_STEPS), every_steps=1) as mgr:
        for step in MANAGED_STEPS:
            model, opt, sched = build(step)
            seed_all()
            mgr.save(model, opt, sched, train_state(step))
        mgr.wait_retention()
    # Only what a finished run leaves: no staging folders or temp files.
    for leftover in [*out.rglob(".staging*"), *out.rglob("*.tmp")]:
        shutil.rmtree(leftover) if leftover.is_dir() else leftover.unlink()
    return sorted(p for p in out.rglob("*") if p.is_file())


if __name__ == "__main__":
    for path in make():
        print(f"{path.relative_to(HERE)}  {path.stat().st_size} bytes")
    sys.exit(0)
