"""The demo's negative controls: two deliberately naive resumes that must diverge.

A comparison that cannot fail proves nothing. :mod:`ckpt_lesson.course.demo`
shows that a real resume matches the baseline exactly; this module supplies
the runs that *should not* match: a resume that skips the RNG restore, one
that builds a fresh optimizer, and one that loses only the position inside the
epoch (notebook 05's own topic; the demo runs the first two). All "work" (no error, a plausible loss) and
both quietly turn into a different run, which is the point of showing them.

It also holds the two small helpers the demo and the controls share: keeping
the caller's generators intact around an in-process run, and the loss
comparison itself.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from ckpt_lesson.course.demo_worker import build_run
from ckpt_lesson.course.training import train
from ckpt_lesson.errors import CheckpointError
from ckpt_lesson.files.checkpoint import TrainState, read_checkpoint
from ckpt_lesson.files.rng import capture_rng_state, restore_rng_state

__all__ = [
    "ALL_CONTROL_KINDS",
    "CONTROL_KINDS",
    "caller_rng_preserved",
    "control_records",
    "max_loss_diff",
    "run_negative_control",
]

#: The two deliberately broken resumes the demo runs; each must diverge from the baseline.
CONTROL_KINDS = ("no_rng", "fresh_optimizer")
#: Every broken resume :func:`run_negative_control` knows: the demo's two, and one that restores
#: every bucket except the data position (notebook 05 runs it beside the demo's table).
ALL_CONTROL_KINDS = (*CONTROL_KINDS, "no_data_position")


@contextmanager
def caller_rng_preserved() -> Iterator[None]:
    """Run the body, then put back the caller's generators and torch thread count."""
    # In-process runs re-seed the global generators and pin torch to one
    # thread; put the caller's (a notebook's, a test's) world back afterwards.
    rng, threads = capture_rng_state(), torch.get_num_threads()
    try:
        yield
    finally:
        restore_rng_state(rng, allow_device_change=True)
        torch.set_num_threads(threads)


def max_loss_diff(a: list[float], b: list[float]) -> float:
    """The largest ``|a[i] - b[i]|``; 0.0 for two empty lists.

    Raises:
        CheckpointError: The lists differ in length (the runs covered different steps).
    """
    if len(a) != len(b):
        raise CheckpointError(
            f"cannot compare {len(a)} losses with {len(b)}; the runs covered different steps."
        )
    return max((abs(x - y) for x, y in zip(a, b, strict=True)), default=0.0)


def run_negative_control(
    kind: str, *, ckpt_path: str | os.PathLike[str], total_steps: int, seed: int
) -> list[float]:
    """Resume from a single-file checkpoint the *wrong* way; returns the losses after it.

    These are deliberately naive resumes (do not use them); the lesson compares
    their losses with the baseline's to show the divergence they cause:

    * ``"no_rng"``: seeds at the top of the script as usual and restores the
      model, optimizer and scheduler, but not the generators. Same batches,
      different dropout masks and jitter: "seeded" is not "restored".
    * ``"fresh_optimizer"``: restores the weights and generators but builds a
      new AdamW and schedule, so the moments restart at zero and the learning
      rate jumps back to its peak.
    * ``"no_data_position"``: restores model, optimizer, scheduler and
      generators, but starts the interrupted epoch over (``batch_in_epoch =
      0``), as a loader without saved state does: other batches, a different run.

    Runs in-process; the caller's RNG state and thread count are put back.

    Raises:
        CheckpointError: Unknown ``kind``, or the checkpoint cannot be read.

    Example:
        >>> bad = run_negative_control("no_rng", ckpt_path="ckpt/ckpt.pt",
        ...                            total_steps=30, seed=11)  # doctest: +SKIP
    """
    return [r.loss for r in control_records(kind, ckpt_path=ckpt_path, total_steps=total_steps, seed=seed)]


def control_records(
    kind: str, *, ckpt_path: str | os.PathLike[str], total_steps: int, seed: int
) -> list[Any]:
    """Like :func:`run_negative_control`, but the full step records (losses and sample ids)."""
    if kind not in ALL_CONTROL_KINDS:
        raise CheckpointError(f"unknown negative control {kind!r}; choose one of {ALL_CONTROL_KINDS}.")
    payload = read_checkpoint(ckpt_path)
    state = TrainState.from_dict(payload["state"], source=str(ckpt_path))
    if not 0 < state.step < total_steps:
        raise CheckpointError(
            f"{ckpt_path}: saved at step {state.step}, which is not before total_steps={total_steps}."
        )
    with caller_rng_preserved():
        data, model, optimizer, scheduler = build_run(seed, total_steps)
        model.load_state_dict(payload["model"])
        if kind == "no_rng":  # naive, do not use: the generators stay wherever seeding left them
            optimizer.load_state_dict(payload["optimizer"])
            scheduler.load_state_dict(payload["scheduler"])
        elif kind == "fresh_optimizer":  # naive, do not use: optimizer and scheduler start from scratch
            restore_rng_state(payload["rng"], allow_device_change=True)
        else:  # naive, do not use: every bucket but the data position, so the epoch starts over
            optimizer.load_state_dict(payload["optimizer"])
            scheduler.load_state_dict(payload["scheduler"])
            restore_rng_state(payload["rng"], allow_device_change=True)
            state.batch_in_epoch = 0
        return train(model, optimizer, scheduler, state, data, until_step=total_steps, seed=seed)
