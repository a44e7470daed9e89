"""Notebook 05's capstone: the learner's functions from 01-05 in one loop, SIGKILLed, resumed.

The loop is notebook 05's ``train_loop`` with a save after every step. Each process picks its
functions with :func:`~ckpt_lesson.course.carry.yours`: the learner's ``next_batch_ids`` (05) and
``save_checkpoint`` / ``load_checkpoint`` (03, which call the learner's ``capture_rng_state`` /
``restore_rng_state`` from 01 and ``atomic_save`` from 02), else the package's. Three runs:

* the baseline, uninterrupted, in the notebook's process;
* a child process that saves after step ``cut``, says so, and is killed with SIGKILL while it
  waits (no handler, no ``finally``: as on a pre-empted machine);
* a fresh child process that scrambles every generator, loads the checkpoint the killed one left
  and trains to the end, then writes its losses and final weights for the comparison.

Run as ``python -m ckpt_lesson.course.capstone {train,resume} FOLDER`` (the notebook does it).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from ckpt_lesson.course.carry import yours
from ckpt_lesson.course.kill_child import _run_and_kill
from ckpt_lesson.course.training import (
    SyntheticRegression,
    make_model,
    make_optimizer_and_scheduler,
    seed_everything,
)
from ckpt_lesson.errors import CheckpointError
from ckpt_lesson.files.checkpoint import TrainState

__all__ = ["SEED", "BATCH", "TOTAL", "CUT", "run_capstone", "train_loop"]

SEED, BATCH, TOTAL, CUT = 11, 16, 30, 12  # notebook 05's run: the cut is mid-epoch 0


def train_loop(model, optimizer, scheduler, state, data, *, until_step, next_batch_ids, save=None):
    """Notebook 05's loop; ``save(state)``, when given, runs after every step."""
    while state.step < until_step:
        ids = next_batch_ids(state, data, seed=SEED, batch_size=BATCH)
        x = data.x[ids]
        jitter = np.random.normal(0.0, 0.01, size=tuple(x.shape)).astype(np.float32)
        model.train()
        loss = nn.functional.mse_loss(model(x + torch.from_numpy(jitter)), data.y[ids])
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        scheduler.step()
        state.step += 1
        state.batch_in_epoch += 1
        state.losses.append(loss.item())
        if save is not None:
            save(state)


def _objects():
    model = make_model()
    return (model, *make_optimizer_and_scheduler(model, total_steps=TOTAL))


def _child(mode: str, folder: Path) -> None:
    """One process of the capstone: ``train`` (killed after step CUT's save) or ``resume``."""
    next_batch_ids = yours("next_batch_ids")
    save_checkpoint, load_checkpoint = yours("save_checkpoint", "load_checkpoint")
    data = SyntheticRegression(seed=SEED)
    ckpt = folder / "ckpt.pt"
    if mode == "train":
        seed_everything(SEED)
        model, optimizer, scheduler = objects = _objects()

        def save(state):
            save_checkpoint(*objects, state, ckpt)
            if state.step == CUT:  # saved: tell the parent, then wait for the SIGKILL
                (folder / "saved.marker").touch()
                time.sleep(600)

        train_loop(model, optimizer, scheduler, TrainState(), data, until_step=TOTAL,
                   next_batch_ids=next_batch_ids, save=save)  # fmt: skip
        return
    seed_everything(1234)  # a new process: other generator states until the restore
    model, optimizer, scheduler = _objects()
    state = load_checkpoint(ckpt, model, optimizer, scheduler)
    print(f"resumed from step {state.step}: epoch {state.epoch}, batch {state.batch_in_epoch}")
    train_loop(model, optimizer, scheduler, state, data, until_step=TOTAL, next_batch_ids=next_batch_ids)
    torch.save(model.state_dict(), folder / "resumed_weights.pt")
    (folder / "resumed_losses.json").write_text(json.dumps(list(state.losses)))


def run_capstone(folder: str | os.PathLike[str], *, timeout_s: float = 120) -> dict[str, Any]:
    """Baseline here, a SIGKILLed run and its resume in fresh processes; see the module docstring.

    Args:
        folder: An empty folder for the checkpoint and the resumed run's results.
        timeout_s: How long each child may take.

    Returns:
        ``baseline`` and ``resumed`` (30 losses each), ``same_weights`` (bool) and ``lines``
        (what the resuming process printed: whose functions ran, where it resumed).

    Raises:
        CheckpointError: A child ended other than as planned (its last error line is in the message).

    Example:
        >>> run_capstone("ckpt_work/05_mid_epoch_resume/capstone")["same_weights"]  # doctest: +SKIP
        True
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    argv = [sys.executable, "-m", "ckpt_lesson.course.capstone"]
    problem = _run_and_kill([*argv, "train", str(folder)], folder / "saved.marker", timeout_s)
    if problem is not None:
        raise CheckpointError(f"capstone: the training process was not killed after step {CUT}: {problem}")
    done = subprocess.run([*argv, "resume", str(folder)], capture_output=True, text=True, timeout=timeout_s)
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise CheckpointError(f"capstone: the resuming process failed: {last}")
    seed_everything(SEED)  # the baseline: the same functions, never interrupted
    model, optimizer, scheduler = _objects()
    baseline = TrainState()
    with contextlib.redirect_stdout(io.StringIO()):  # the child already said whose functions run
        next_batch_ids = yours("next_batch_ids")
    train_loop(model, optimizer, scheduler, baseline, SyntheticRegression(seed=SEED), until_step=TOTAL,
               next_batch_ids=next_batch_ids)  # fmt: skip
    resumed = json.loads((folder / "resumed_losses.json").read_text())
    weights = torch.load(folder / "resumed_weights.pt", weights_only=True)
    same = all(torch.equal(weights[k], v) for k, v in model.state_dict().items())
    return {"baseline": baseline.losses, "resumed": resumed, "same_weights": same,
            "lines": done.stdout.strip().splitlines()}  # fmt: skip


if __name__ == "__main__":
    _child(sys.argv[1], Path(sys.argv[2]))
