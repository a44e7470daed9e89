"""A small GAN, DCGAN-loop style: two models, two optimizers, no scheduler.

The generator learns to draw points on a ring of eight Gaussian blobs. Every
step updates the discriminator first (real points against detached fakes),
then the generator through the updated discriminator. The training state is
four parts, restored in place and saved by name; nothing is special about
having two of each. examples/before/loop_gan.py is the loop without
checkpoints; this file adds five lines (``tests/test_recipes.py`` counts them):

    python -m ckpt_lesson resume-test -- python examples/loop_gan.py

``--mistake one-optimizer`` empties the discriminator's Adam after the
restore (the lines marked MISTAKE). The first step after a restart still
matches (its loss is measured before any update), the second does not, and
``resume-test`` says the optimizer state was not restored.

The step's logged loss is the discriminator's, measured before the step's
updates; the generator's loss of the same step is printed, not logged: it
is measured after the discriminator's update, so a lost optimizer would
show in it one step early and look like lost randomness.
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
    parser.add_argument("--mistake", choices=("one-optimizer",), help="start optD afresh")  # MISTAKE
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
    mgr = cl.CheckpointManager(every_steps=10)  # into $CKPT_LESSON_CKPT_DIR if set, else checkpoints/
    start, state = mgr.resume(netG=netG, netD=netD, optG=optG, optD=optD)  # in place; 0: a first run
    if args.mistake == "one-optimizer":  # MISTAKE: a resumed run gets a fresh Adam for D
        optD.state.clear()  # MISTAKE

    for step in range(start + 1, args.steps + 1):
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
        mgr.save_if_due(step, state)  # every 10 steps
    return 0


if __name__ == "__main__":
    sys.exit(main())
