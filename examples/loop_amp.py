"""A mixed-precision loop: bf16 autocast on the CPU and a ``GradScaler`` as one more part of the state.

examples/before/loop_amp.py is the loop as the AMP recipe writes it: the
forward pass under ``torch.autocast("cpu", dtype=torch.bfloat16)``, the loss
scaled before ``backward`` and unscaled before the step by a
``torch.amp.GradScaler("cpu")``. The scaler has state of its own (its scale,
and how many good steps it has seen since it last grew); a restart that
rebuilds it fresh starts from the initial scale again. It has
``state_dict()``/``load_state_dict()``, so it is one more part, restored in
place like the model. This file adds five lines (``tests/test_recipes.py``
counts them):

    python -m ckpt_lesson resume-test -- python examples/loop_amp.py

``--mistake scaler`` puts the scaler back to its initial state after the
restore (the lines marked MISTAKE). The loop logs the scale each step used
(a metric), and ``resume-test`` names it: back at its first-step value at the
first step after a restart.

With bf16, whose range is fp32's, scaling by a power of two rarely changes
the numbers; with float16 (``--dtype float16``) a lost scale changes which
steps overflow and are skipped.
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
    parser.add_argument("--mistake", choices=("scaler",), help="start the scaler afresh")  # MISTAKE
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
    mgr = cl.CheckpointManager(every_steps=10)  # into $CKPT_LESSON_CKPT_DIR if set, else checkpoints/
    start, state = mgr.resume(model=model, optimizer=optimizer, scaler=scaler)  # in place; 0: a first run
    if args.mistake == "scaler":  # MISTAKE: a resumed run starts again from the initial scale
        fresh = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=4)  # MISTAKE
        scaler.load_state_dict(fresh.state_dict())  # MISTAKE

    per_epoch = SAMPLES // BATCH
    for step in range(start + 1, args.steps + 1):
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
        mgr.save_if_due(step, state)  # every 10 steps
    return 0


if __name__ == "__main__":
    sys.exit(main())
