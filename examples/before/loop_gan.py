"""The loop of examples/loop_gan.py as a DCGAN-style script writes it, before ckpt_lesson.

Two models, two Adam optimizers, the discriminator updated first, then the
generator. It logs each step with ``cl.log_step`` so that ``resume-test`` can
compare runs; that call is the only ckpt_lesson in it.
``tests/test_recipes.py`` counts the lines examples/loop_gan.py changes.
"""

from __future__ import annotations

import argparse
import math
import sys

import torch
from torch import nn

import ckpt_lesson as cl

SAMPLES, BATCH, NOISE = 512, 32, 8


def ring(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    angle = torch.randint(8, (SAMPLES,), generator=g) * (2 * math.pi / 8)
    centres = torch.stack([torch.cos(angle), torch.sin(angle)], dim=1) * 2.0
    return centres + 0.05 * torch.randn(SAMPLES, 2, generator=g)


def mlp(n_in: int, n_out: int) -> nn.Module:
    return nn.Sequential(nn.Linear(n_in, 64), nn.LeakyReLU(0.2), nn.Linear(64, 64), nn.LeakyReLU(0.2),
                         nn.Linear(64, n_out))  # fmt: skip


def batch_ids(seed: int, step: int) -> torch.Tensor:
    # The epoch's order comes from (seed, epoch) alone and the position from the step, so a
    # resumed run finds its place in the data without any loader state.
    per_epoch = SAMPLES // BATCH
    epoch, i = divmod(step - 1, per_epoch)
    order = torch.randperm(SAMPLES, generator=torch.Generator().manual_seed(seed * 1000 + epoch))
    return order[i * BATCH : (i + 1) * BATCH]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--seed", type=int, default=5)
    args = parser.parse_args(argv)

    torch.set_num_threads(1)
    torch.manual_seed(args.seed)
    data = ring(args.seed)
    netG, netD = mlp(NOISE, 2), mlp(2, 1)
    optG = torch.optim.Adam(netG.parameters(), lr=2e-3, betas=(0.5, 0.999))
    optD = torch.optim.Adam(netD.parameters(), lr=2e-3, betas=(0.5, 0.999))
    criterion = nn.BCEWithLogitsLoss()

    for step in range(1, args.steps + 1):
        ids = batch_ids(args.seed, step)
        real = data[ids]
        ones, zeros = torch.ones(BATCH, 1), torch.zeros(BATCH, 1)
        # (1) the discriminator: real points up, fakes down
        fake = netG(torch.randn(BATCH, NOISE))
        lossD = criterion(netD(real), ones) + criterion(netD(fake.detach()), zeros)
        optD.zero_grad()
        lossD.backward()
        optD.step()
        # (2) the generator: fool the discriminator that was just updated
        lossG = criterion(netD(fake), ones)
        optG.zero_grad()
        lossG.backward()
        optG.step()
        cl.log_step(step, lossD.item(), sample_ids=ids)
        if step % 10 == 0:
            print(f"step {step}: loss_D {lossD.item():.4f} loss_G {lossG.item():.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
