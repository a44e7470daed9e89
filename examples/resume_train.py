"""A plain-PyTorch training script that resumes exactly, and five classic ways to get it wrong.

Run it as it is and it survives any kill: ``resume-test`` passes it.

    python -m ckpt_lesson resume-test -- python examples/resume_train.py

Add ``--mistake NAME`` and it makes one classic mistake, marked ``# MISTAKE``
in the code below, each a line or two away from the correct version:

    rng                  seeds the RNG again after restoring it (dropout masks change)
    fresh-optimizer      builds a new AdamW after the restore (its moments are lost)
    epoch-restart        restarts the data loader at the start of the epoch
    torch-save           torch.save straight over the previous checkpoint (not atomic)
    accumulation-window  saves in the middle of a gradient-accumulation window

What makes the correct version exact:

* every generator is in the checkpoint (``CheckpointManager`` saves and
  restores them) and nothing reseeds after the restore;
* the optimizer's state is saved and restored with the model;
* the data order of an epoch depends only on ``(seed, epoch)``, and the
  checkpoint records how many batches of the epoch were consumed, so a
  resumed run rebuilds the same order and skips exactly those;
* saves are atomic (``CheckpointManager`` publishes a finished folder with
  one rename) and happen only after an optimizer step;
* on ``SIGTERM`` (a spot machine's notice) it finishes the step, saves, and
  exits with 75 ("preempted, restart me").

``--accumulate N`` trains with N micro-batches per optimizer step; its saves
wait for the end of the window. The checkpoint folder is ``$CKPT_LESSON_CKPT_DIR`` when set (``resume-test``
sets it), else ``--ckpt-dir``. Tiny on purpose: 40 steps of a small MLP on
256 synthetic samples, one thread, a few seconds including the torch import.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, Sampler, TensorDataset

from ckpt_lesson import (
    PREEMPTED_EXIT_CODE,
    CheckpointManager,
    PreemptionHandler,
    TrainState,
    capture_rng_state,
    log_step,
    restore_rng_state,
)

MISTAKES = ("rng", "fresh-optimizer", "epoch-restart", "torch-save", "accumulation-window")
SAMPLES, BATCH, SAVE_EVERY = 256, 16, 10


class EpochOrder(Sampler[int]):
    """The sample order of one epoch, from ``(seed, epoch)`` alone, starting at ``start``.

    A DataLoader with ``shuffle=True`` draws its order from the global RNG when
    the epoch's iterator is created: a run resumed mid-epoch cannot get that
    order back. This sampler can: same seed and epoch, same order, and
    ``start`` skips the samples the interrupted run already trained on.
    """

    def __init__(self, n: int, seed: int, epoch: int, start: int = 0) -> None:
        generator = torch.Generator().manual_seed(seed * 1000 + epoch)
        self.order = torch.randperm(n, generator=generator)[start:].tolist()

    def __iter__(self):
        return iter(self.order)

    def __len__(self) -> int:
        return len(self.order)


def make_data(seed: int) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(SAMPLES, 32, generator=g)
    y = torch.sin(x @ torch.randn(32, 1, generator=g)) + 0.1 * torch.randn(SAMPLES, 1, generator=g)
    return TensorDataset(x, y, torch.arange(SAMPLES))


def make_model() -> nn.Module:
    return nn.Sequential(nn.Linear(32, 256), nn.ReLU(), nn.Dropout(0.2), nn.Linear(256, 256), nn.ReLU(),
                         nn.Dropout(0.2), nn.Linear(256, 1))  # fmt: skip


def make_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)


# ---------------------------------------------------------------- the torch-save mistake's save and load


def naive_save(path: Path, model, optimizer, state: TrainState) -> None:
    # MISTAKE (torch-save): torch.save opens the file, truncating the previous checkpoint to
    # zero bytes, then writes the new one. A kill in between leaves neither.
    blob = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "state": state.to_dict(),
            "rng": capture_rng_state()}  # fmt: skip
    torch.save(blob, path)


def naive_load(path: Path, model, optimizer) -> TrainState | None:
    if not path.exists():
        return None
    blob = torch.load(path, weights_only=True)  # a truncated file raises here, on every restart
    model.load_state_dict(blob["model"])
    optimizer.load_state_dict(blob["optimizer"])
    restore_rng_state(blob["rng"])
    return TrainState.from_dict(blob["state"])


# ---------------------------------------------------------------- training


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mistake", choices=MISTAKES, help="make one classic resume mistake")
    parser.add_argument("--ckpt-dir", default=os.environ.get("CKPT_LESSON_CKPT_DIR", "runs/resume_train"))
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--accumulate", type=int, default=1, help="micro-batches per optimizer step (>= 1)")
    args = parser.parse_args(argv)
    mistake = args.mistake
    # The accumulation mistake needs accumulation: 4 micro-batches per update, unless told otherwise.
    accumulate = 4 if mistake == "accumulation-window" and args.accumulate == 1 else args.accumulate
    if accumulate < 1:
        parser.error("--accumulate must be >= 1")

    torch.set_num_threads(1)  # same thread count every run: reductions add up in the same order
    torch.manual_seed(args.seed)
    data = make_data(args.seed)
    model = make_model()
    optimizer = make_optimizer(model)
    # A bucket URL (s3://BUCKET/PREFIX) moves the durable copy off this machine; a path keeps it here.
    ckpt_dir = args.ckpt_dir if "://" in args.ckpt_dir else Path(args.ckpt_dir)
    naive_path = Path(args.ckpt_dir) / "checkpoint.pt"
    manager = None
    if mistake == "torch-save":
        ckpt_dir.mkdir(parents=True, exist_ok=True)
        state = naive_load(naive_path, model, optimizer) or TrainState()
    else:
        # every_steps is required; the loop below decides (a save must wait for an update boundary).
        manager = CheckpointManager(ckpt_dir, keep_last=2, every_steps=SAVE_EVERY)
        # Restores model, optimizer and every RNG, and returns the counters (None: a fresh start).
        state = manager.restore_latest(model, optimizer, None) or TrainState()

    if mistake == "rng":
        # MISTAKE (rng): seeding after the restore throws away the generator state it just put back.
        torch.manual_seed(args.seed)
    if mistake == "fresh-optimizer":
        # MISTAKE (fresh-optimizer): a new AdamW; its moments and step count start from zero again.
        optimizer = make_optimizer(model)

    def save() -> None:
        if manager is None:
            naive_save(naive_path, model, optimizer, state)
        else:
            manager.save(model, optimizer, None, state)

    last_saved = state.step
    model.train()
    with PreemptionHandler(grace_seconds=10.0) as preemption:
        while state.step < args.steps:
            start = state.batch_in_epoch * BATCH
            if mistake == "epoch-restart":
                # MISTAKE (epoch-restart): the loader starts the epoch over; the batches this epoch
                # already trained on come again, and the rest of the order shifts.
                start, state.batch_in_epoch = 0, 0
            order = EpochOrder(len(data), args.seed, state.epoch, start)
            # generator=: each time an epoch's iterator starts, DataLoader draws a seed for its
            # workers (even with none) from the generator it is given, by default the *global*
            # one. A resumed run starts an iterator mid-epoch, one draw more than the
            # uninterrupted run, and every dropout mask after that shifts. Its own generator
            # leaves the global stream alone.
            loader = DataLoader(data, batch_size=BATCH, sampler=order, generator=torch.Generator())
            for x, y, ids in loader:
                loss = nn.functional.mse_loss(model(x), y)
                (loss / accumulate).backward()
                state.step += 1
                state.batch_in_epoch += 1
                if state.step % accumulate == 0:  # an optimizer step closes the accumulation window
                    optimizer.step()
                    optimizer.zero_grad()
                state.losses.append(loss.item())
                log_step(state.step, loss.item(), sample_ids=ids)

                # A save is due every SAVE_EVERY steps, but waits for the end of the accumulation
                # window: gradients accumulated so far live in .grad, which no checkpoint holds.
                at_boundary = state.step % accumulate == 0
                due = state.step - last_saved >= SAVE_EVERY and at_boundary
                if mistake == "accumulation-window":
                    # MISTAKE (accumulation-window): saving without waiting for the window to close.
                    due = state.step - last_saved >= SAVE_EVERY
                if due or (preemption.requested and at_boundary):
                    last_saved = state.step
                    save()
                if preemption.requested and at_boundary:
                    return PREEMPTED_EXIT_CODE  # saved: a supervisor restarts us and we resume
                if state.step >= args.steps:
                    break
            else:  # the epoch ran out: the next one has its own order
                state.epoch += 1
                state.batch_in_epoch = 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
