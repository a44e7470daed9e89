"""The variants ``python -m ckpt_lesson bench`` times, each paired with its plain-PyTorch baseline.

Every case is a function ``case(workdir) -> seconds`` that does its own setup
outside the timed region and writes into a folder nobody used before (a fresh
file every repetition: rewriting one file would time the page cache's reuse of
its pages, not a save). A *pair* names a variant and the baseline it is
divided by; the runner measures both in the same repetition, so a slow patch
of the machine slows both, and reports the median of the per-repetition ratios.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ckpt_lesson.files.atomic import atomic_save, fsync_dir
from ckpt_lesson.files.checkpoint import TrainState, build_payload, load_checkpoint, save_checkpoint
from ckpt_lesson.files.sharded import save_sharded_checkpoint
from ckpt_lesson.runs.async_save import AsyncCheckpointer
from ckpt_lesson.runs.manager import CheckpointManager

__all__ = ["PAIRS", "Workload", "make_cases"]

#: (variant, baseline, what the ratio means)
PAIRS: list[tuple[str, str, str]] = [
    ("atomic_save", "torch_save_fsync", "atomic_save vs torch.save + fsync of file and folder"),
    ("atomic_save_sha256", "torch_save_fsync", "the same with sha256 (the previous default)"),
    (
        "save_checkpoint",
        "payload_torch_save_fsync",
        "save_checkpoint vs the same dict via torch.save + fsync",
    ),
    ("manager_save", "payload_torch_save_fsync", "CheckpointManager.save (verify_on_save) vs plain"),
    ("manager_save_noverify", "payload_torch_save_fsync", "CheckpointManager.save, verify_on_save=False"),
    ("sharded_4", "save_checkpoint", "save_sharded_checkpoint, 4 shards, vs one file"),
    ("sharded_8", "save_checkpoint", "save_sharded_checkpoint, 8 shards, vs one file"),
    ("async_stall", "manager_save", "training thread blocked by save_async vs a synchronous managed save"),
    (
        "load_checkpoint",
        "torch_load_apply",
        "verified restore + 1 optimizer step vs torch.load + load_state_dicts",
    ),
]


class Workload:
    """A model, AdamW with moments and a scheduler holding about ``size_mb`` MB of state in total.

    Parameters are a third of the bytes, AdamW's two moments the rest, as in
    real training.
    """

    def __init__(self, size_mb: float) -> None:
        width = 1024
        rows = max(1, int(size_mb * 1e6 / 3 / 4 / width))
        gen = torch.Generator().manual_seed(0)
        self.model = torch.nn.Sequential(
            *[torch.nn.Linear(width, rows // 4 or 1, bias=True) for _ in range(4)]
        )
        with torch.no_grad():
            for p in self.model.parameters():
                p.copy_(torch.randn(p.shape, generator=gen))
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-3)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda s: 1.0)
        self.step()  # creates the moments
        self.state = TrainState(step=1)
        self.bytes = sum(
            t.numel() * t.element_size()
            for t in [*self.model.state_dict().values(), *_tensors(self.optimizer.state_dict())]
        )

    def step(self) -> None:
        for p in self.model.parameters():
            p.grad = torch.ones_like(p)
        self.optimizer.step()
        self.scheduler.step()


def _tensors(tree: Any) -> list[torch.Tensor]:
    if isinstance(tree, torch.Tensor):
        return [tree]
    if isinstance(tree, dict):
        return [t for v in tree.values() for t in _tensors(v)]
    if isinstance(tree, (list, tuple)):
        return [t for v in tree for t in _tensors(v)]
    return []


def _plain_durable_save(obj: Any, path: Path) -> None:
    torch.save(obj, path)
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    fsync_dir(path.parent)


def _timed(fn: Callable[[], Any]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def make_cases(w: Workload) -> dict[str, Callable[[Path], float]]:
    """Every case by name; each takes a fresh, empty folder and returns seconds."""
    weights = {"model": w.model.state_dict(), "optimizer": w.optimizer.state_dict()}

    def payload() -> dict[str, Any]:
        return build_payload(w.model, w.optimizer, w.scheduler, w.state)

    def manager(d: Path, verify: bool) -> float:
        mgr = CheckpointManager(d / "run", every_steps=1, verify_on_save=verify)
        return _timed(lambda: mgr.save(w.model, w.optimizer, w.scheduler, w.state))

    def async_stall(d: Path) -> float:
        mgr = CheckpointManager(d / "run", every_steps=1)
        with AsyncCheckpointer(mgr) as ckpt:
            ckpt.save_async(w.model, w.optimizer, w.scheduler, TrainState(step=1))
            ckpt.wait()  # a first save fills the buffers, as in a long run
            stall = _timed(lambda: ckpt.save_async(w.model, w.optimizer, w.scheduler, TrainState(step=2)))
        return stall

    def restore(d: Path, ours: bool) -> float:
        path = d / "c.pt"
        if ours:
            save_checkpoint(w.model, w.optimizer, w.scheduler, w.state, path)
        else:
            _plain_durable_save(payload(), path)
        # Just written, so the file is in the page cache: a warm restore, as right after a save.

        def load() -> None:
            if ours:
                load_checkpoint(path, w.model, w.optimizer, w.scheduler)
            else:
                p = torch.load(path, weights_only=True)
                w.model.load_state_dict(p["model"])
                w.optimizer.load_state_dict(p["optimizer"])
                w.scheduler.load_state_dict(p["scheduler"])
            w.step()  # costs that a lazy load defers are charged here

        return _timed(load)

    return {
        "torch_save_fsync": lambda d: _timed(lambda: _plain_durable_save(weights, d / "w.pt")),
        "atomic_save": lambda d: _timed(lambda: atomic_save(weights, d / "w.pt")),
        "atomic_save_sha256": lambda d: _timed(lambda: atomic_save(weights, d / "w.pt", algo="sha256")),
        "payload_torch_save_fsync": lambda d: _timed(lambda: _plain_durable_save(payload(), d / "c.pt")),
        "save_checkpoint": lambda d: _timed(
            lambda: save_checkpoint(w.model, w.optimizer, w.scheduler, w.state, d / "c.pt")
        ),
        "manager_save": lambda d: manager(d, True),
        "manager_save_noverify": lambda d: manager(d, False),
        "sharded_4": lambda d: _timed(
            lambda: save_sharded_checkpoint(w.model, w.optimizer, w.scheduler, w.state, d / "s", num_shards=4)
        ),
        "sharded_8": lambda d: _timed(
            lambda: save_sharded_checkpoint(w.model, w.optimizer, w.scheduler, w.state, d / "s", num_shards=8)
        ),
        "async_stall": async_stall,
        "torch_load_apply": lambda d: restore(d, False),
        "load_checkpoint": lambda d: restore(d, True),
    }
