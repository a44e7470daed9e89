"""An epoch loop over a shuffled DataLoader with StepLR per epoch, resumable mid-epoch in five lines.

examples/before/loop_epochs.py is the loop as a public script writes it: a
``DataLoader(shuffle=True)`` with workers, ``StepLR`` stepped once per epoch, a
``--start-epoch`` flag. This file adds five lines (``tests/test_recipes.py``
counts them; the lines marked MISTAKE are the negative control's): a manager,
the state with the loader made resumable (``cl.resumable`` keeps the epoch,
the batches of it consumed and the seed its order derives from), the restore,
the start epoch, and a save where the loop already prints:

    python -m ckpt_lesson resume-test -- python examples/loop_epochs.py

``--mistake loader`` keeps a plain shuffled DataLoader, its position unsaved,
and starts the epoch the step falls in over again: a restart trains on
another order (a plain DataLoader draws each epoch's order from the global
generator when the epoch starts), and ``resume-test`` FAILs naming the loader.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F
from torch import nn
from torch.optim.lr_scheduler import StepLR
from torch.utils.data import DataLoader, Dataset

import ckpt_lesson as cl

BATCH = 32


class Blobs(Dataset):
    """Four classes of points in 16 dimensions; each fetch adds a little noise (an augmentation)."""

    def __init__(self, seed: int, n: int = 500) -> None:
        g = torch.Generator().manual_seed(seed)
        self.y = torch.randint(4, (n,), generator=g)
        self.x = torch.randn(n, 16, generator=g) + 2.0 * F.one_hot(self.y, 16).float()

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int):
        return self.x[i] + 0.1 * torch.randn(16), self.y[i], i


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.drop, self.fc2 = nn.Linear(16, 64), nn.Dropout(0.25), nn.Linear(64, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.log_softmax(self.fc2(self.drop(F.relu(self.fc1(x)))), dim=1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--start-epoch", type=int, default=0, help="manual epoch number (for restarts)")
    parser.add_argument("--mistake", choices=("loader",), help="leave the loader's position out")  # MISTAKE
    parser.add_argument("--lr", type=float, default=1.0)
    parser.add_argument("--gamma", type=float, default=0.7)
    parser.add_argument("--log-interval", type=int, default=5)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args(argv)

    torch.set_num_threads(1)
    torch.manual_seed(args.seed)
    train_set = Blobs(args.seed)
    train_loader = DataLoader(
        train_set, batch_size=BATCH, shuffle=True, num_workers=min(2, os.cpu_count() or 1)
    )
    model = Net()
    optimizer = torch.optim.Adadelta(model.parameters(), lr=args.lr)
    scheduler = StepLR(optimizer, step_size=1, gamma=args.gamma)
    mgr = cl.CheckpointManager(os.environ.get("CKPT_LESSON_CKPT_DIR", "runs/loop_epochs"), every_steps=5)
    state = dict(model=model, optimizer=optimizer, scheduler=scheduler, loader=cl.resumable(train_loader))
    if args.mistake == "loader":  # MISTAKE
        del state["loader"]  # MISTAKE: the position is not saved, and the loop iterates a plain loader
        train_loader = DataLoader(train_set, batch_size=BATCH, shuffle=True, num_workers=2)  # MISTAKE

    step = 0
    step = getattr(mgr.restore_latest(state), "step", step)  # everything in state, RNG too; None: a first run
    if args.mistake == "loader":  # MISTAKE
        train_loader.epoch = step // len(train_loader)  # MISTAKE: the epoch the step falls in, begun afresh
    args.start_epoch = train_loader.epoch  # the epoch in progress at the save (0 on a first run)
    for epoch in range(args.start_epoch, args.epochs):
        model.train()
        for data, target, ids in train_loader:
            optimizer.zero_grad()
            loss = F.nll_loss(model(data), target)
            loss.backward()
            optimizer.step()
            step += 1
            cl.log_step(step, loss.item(), sample_ids=ids, lr=scheduler.get_last_lr()[0])
            if step % args.log_interval == 0:
                print(f"epoch {epoch} step {step} loss {loss.item():.4f}")
                mgr.save(step, state)
        scheduler.step()
    return 0


if __name__ == "__main__":
    sys.exit(main())
