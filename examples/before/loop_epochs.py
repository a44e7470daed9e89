"""The epoch loop of examples/loop_epochs.py as a public training script writes it, before ckpt_lesson.

A shuffled ``DataLoader`` with workers, ``Adadelta``, ``StepLR`` stepped once
per epoch, a ``--start-epoch`` flag (as the ImageNet example has) and a print
every ``--log-interval`` steps. It logs each step with ``cl.log_step`` so
that ``resume-test`` can compare runs; that call is the only ckpt_lesson in it.
``tests/test_recipes.py`` counts the lines examples/loop_epochs.py changes.
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

    step = 0
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
        scheduler.step()
    return 0


if __name__ == "__main__":
    sys.exit(main())
