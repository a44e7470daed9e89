"""The loop of examples/loop_amp.py as the AMP recipe writes it, before ckpt_lesson.

bf16 autocast on the CPU and a ``torch.amp.GradScaler("cpu")``; the data
order of an epoch comes from ``(seed, epoch)`` and the position from the
step. It logs each step with ``cl.log_step`` so that ``resume-test`` can
compare runs; that call is the only ckpt_lesson in it.
``tests/test_recipes.py`` counts the lines examples/loop_amp.py changes.
"""

from __future__ import annotations

import argparse
import sys

import torch
from torch import nn

import ckpt_lesson as cl

SAMPLES, BATCH = 512, 32


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--seed", type=int, default=3)
    parser.add_argument("--dtype", choices=("bfloat16", "float16"), default="bfloat16")
    args = parser.parse_args(argv)
    dtype = getattr(torch, args.dtype)

    torch.set_num_threads(1)
    torch.manual_seed(args.seed)
    g = torch.Generator().manual_seed(args.seed)
    x = torch.randn(SAMPLES, 64, generator=g)
    y = (x[:, :8].sum(dim=1) > 0).long() + 2 * (x[:, 8:16].sum(dim=1) > 0).long()  # four classes
    model = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Dropout(0.1), nn.Linear(128, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    # A short growth interval so that the scale moves within a few steps of this tiny run.
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=4)

    per_epoch = SAMPLES // BATCH
    for step in range(1, args.steps + 1):
        epoch, i = divmod(step - 1, per_epoch)  # the data position is a function of the step
        order = torch.randperm(SAMPLES, generator=torch.Generator().manual_seed(args.seed * 1000 + epoch))
        ids = order[i * BATCH : (i + 1) * BATCH]
        with torch.autocast("cpu", dtype=dtype):
            loss = nn.functional.cross_entropy(model(x[ids]), y[ids])
        scale = scaler.get_scale()  # the scale this step uses, logged below
        optimizer.zero_grad()
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(optimizer)  # skipped when a gradient overflowed
        scaler.update()
        cl.log_step(step, loss.item(), sample_ids=ids, scale=scale)
    return 0


if __name__ == "__main__":
    sys.exit(main())
