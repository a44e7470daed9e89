"""Shared fixtures: a tiny, fully seeded training run that any test can build.

``tiny_run(seed)`` returns a :class:`TinyRun` holding seeded data, model,
optimizer, scheduler and a fresh :class:`TrainState`. Everything is small
(64 samples, a 32-unit MLP), so a dozen steps take milliseconds.
"""

from __future__ import annotations

import os
import signal
import sys
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

from ckpt_lesson.course.training import (
    StepRecord,
    SyntheticRegression,
    make_model,
    make_optimizer_and_scheduler,
    seed_everything,
    train,
)
from ckpt_lesson.files.checkpoint import TrainState, load_checkpoint, save_checkpoint
from ckpt_lesson.files.integrity import FileDigest

TINY_N = 64
TINY_BATCH = 8


@dataclass
class TinyRun:
    """One small training run: seeded objects plus helpers to train, save and load."""

    seed: int
    data: SyntheticRegression
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: Any
    state: TrainState = field(default_factory=TrainState)

    def train(self, until_step: int, **kwargs: Any) -> list[StepRecord]:
        """Train up to ``until_step`` (the run's seed is the order seed)."""
        return train(
            self.model,
            self.optimizer,
            self.scheduler,
            self.state,
            self.data,
            until_step=until_step,
            seed=self.seed,
            batch_size=TINY_BATCH,
            **kwargs,
        )

    def save(self, path: str | os.PathLike[str]) -> FileDigest:
        return save_checkpoint(self.model, self.optimizer, self.scheduler, self.state, path)

    def load(self, path: str | os.PathLike[str]) -> TrainState:
        """Restore from ``path`` and continue from the saved state."""
        self.state = load_checkpoint(path, self.model, self.optimizer, self.scheduler)
        return self.state


def build_tiny_run(seed: int = 0, *, with_scheduler: bool = True, hidden: int = 32) -> TinyRun:
    """Seed every generator, then build data, model, optimizer and scheduler."""
    seed_everything(seed)
    data = SyntheticRegression(n=TINY_N, in_dim=8, seed=seed)
    model = make_model(in_dim=8, hidden=hidden)
    optimizer, scheduler = make_optimizer_and_scheduler(model, total_steps=50)
    return TinyRun(seed, data, model, optimizer, scheduler if with_scheduler else None)


@pytest.fixture
def tiny_run() -> Callable[..., TinyRun]:
    """Factory fixture: ``tiny_run(seed=0, with_scheduler=True, hidden=32) -> TinyRun``."""
    return build_tiny_run


@pytest.fixture(autouse=True)
def signal_handlers_left_as_found(request):
    """Put SIGINT/SIGTERM handlers back after each test, and warn naming a test that changed them.

    A handler left behind changes what later tests see (a second Ctrl-C that no longer raises), so a
    leak shows in the warnings summary with the test's name instead of failing an unrelated test.
    """
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    yield
    for sig, handler in before.items():
        now = signal.getsignal(sig)
        if now is not handler and handler is not None:
            warnings.warn(f"{request.node.nodeid} left the {sig.name} handler set to {now!r}", stacklevel=1)
            signal.signal(sig, handler)


@pytest.fixture(autouse=True)
def no_resume_test_variables(monkeypatch):
    """A test run inside resume-test must not report its own steps (or save) where resume-test said."""
    monkeypatch.delenv("CKPT_LESSON_STEP_LOG", raising=False)
    monkeypatch.delenv("CKPT_LESSON_CKPT_DIR", raising=False)


@pytest.fixture
def fake_command():
    """``fake_command(*args)``: ``python tests/fake_train.py ARGS...`` as a command for resume-test."""
    fake = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fake_train.py")

    def command(*extra: str) -> list[str]:
        return [sys.executable, fake, *extra]

    return command


# The object-store fixtures (a local moto S3 server and a bucket per test).
from _s3_server import s3_bucket, s3_endpoint  # noqa: E402, F401
