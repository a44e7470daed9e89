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
from typing import Any, NamedTuple

import torch

from ckpt_lesson.bench.async_cases import async_cases
from ckpt_lesson.bench.probes import (
    drop_from_page_cache,
    peak_rss_reset,
    peak_rss_since_reset,
    resident_fraction,
)
from ckpt_lesson.files.atomic import atomic_save, fsync_dir
from ckpt_lesson.files.checkpoint import TrainState, build_payload, load_checkpoint, save_checkpoint
from ckpt_lesson.files.sharded import save_sharded_checkpoint
from ckpt_lesson.runs.manager import CheckpointManager

__all__ = ["PAIRS", "Sample", "Workload", "make_cases"]

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
    ("async_stall", "dcp_async_persistent_stall", "our stall vs DCP async_save's, persistent stager"),
    ("dcp_async_stall", "manager_save", "DCP async_save stall (default stager) vs a managed save"),
    ("dcp_async_persistent_stall", "manager_save", "DCP async_save stall (persistent stager) vs the same"),
    ("async_steps", "steps_alone", "3 training steps during our background save vs with no save"),
    ("async_steps_nice", "steps_alone", "the same with AsyncCheckpointer(writer_nice=10)"),
    ("dcp_async_steps", "steps_alone", "3 steps during DCP async_save (default stager) vs no save"),
    ("dcp_async_persistent_steps", "steps_alone", "3 steps during DCP async_save (persistent stager)"),
    (
        "load_checkpoint",
        "torch_load_apply",
        "verified restore (mmap=False: read into memory) + 1 step vs torch.load + load_state_dicts",
    ),
    (
        "load_checkpoint_mmap",
        "torch_load_apply",
        "the same restore, load_checkpoint(mmap=True): weights copied from the file mapping",
    ),
    ("load_checkpoint_cold", "torch_load_apply_cold", "verified restore, file evicted from the page cache"),
    ("load_checkpoint_mmap_cold", "torch_load_apply_cold", "mapped verified restore, file evicted"),
]


class Sample(NamedTuple):
    """One timed run of a case."""

    seconds: float
    #: Most resident memory held above the start, in bytes (``None`` where not measured).
    peak_extra: int | None = None
    #: Fraction of the loaded file in the page cache when the load began (loads only).
    resident: float | None = None


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


def _timed(fn: Callable[[], Any], resident: float | None = None) -> Sample:
    base = peak_rss_reset()
    start = time.perf_counter()
    fn()
    seconds = time.perf_counter() - start
    peak = peak_rss_since_reset()
    extra = None if base is None or peak is None else max(0, peak - base)
    return Sample(seconds, extra, resident)


def make_cases(w: Workload) -> dict[str, Callable[[Path], Sample | float]]:
    """Every case by name; each takes a fresh, empty folder and returns seconds."""
    weights = {"model": w.model.state_dict(), "optimizer": w.optimizer.state_dict()}

    def payload() -> dict[str, Any]:
        return build_payload(w.model, w.optimizer, w.scheduler, w.state)

    def manager(d: Path, verify: bool) -> Sample:
        mgr = CheckpointManager(d / "run", every_steps=1, verify_on_save=verify)
        return _timed(lambda: mgr.save(w.model, w.optimizer, w.scheduler, w.state))

    def restore(d: Path, ours: bool, mmap: bool = False, cold: bool = False) -> Sample:
        path = d / "c.pt"
        if ours:
            save_checkpoint(w.model, w.optimizer, w.scheduler, w.state, path)
        else:
            _plain_durable_save(payload(), path)
        # Just written, the file is in the page cache: a warm restore, as right after a save.
        # A cold one (a new machine, or a save long evicted) first drops the file's pages.
        if cold:
            drop_from_page_cache(path)

        def load() -> None:
            if ours:
                load_checkpoint(path, w.model, w.optimizer, w.scheduler, mmap=mmap)
            else:
                p = torch.load(path, weights_only=True)
                w.model.load_state_dict(p["model"])
                w.optimizer.load_state_dict(p["optimizer"])
                w.scheduler.load_state_dict(p["scheduler"])
            w.step()  # costs that a lazy load defers are charged here

        return _timed(load, resident_fraction(path))

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
        "torch_load_apply": lambda d: restore(d, False),
        "load_checkpoint": lambda d: restore(d, True, mmap=False),
        "load_checkpoint_mmap": lambda d: restore(d, True, mmap=True),
        "torch_load_apply_cold": lambda d: restore(d, False, cold=True),
        "load_checkpoint_cold": lambda d: restore(d, True, mmap=False, cold=True),
        "load_checkpoint_mmap_cold": lambda d: restore(d, True, mmap=True, cold=True),
        **async_cases(w),
    }
