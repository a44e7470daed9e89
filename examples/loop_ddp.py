"""A DistributedDataParallel loop on CPU (gloo), launched by torchrun, that resumes bit for bit.

    python -m ckpt_lesson resume-test -- torchrun --standalone --nproc_per_node=2 examples/loop_ddp.py

Each rank trains on its half of every global batch; DDP averages the
gradients, so the weights and the optimizer state are the same on every
rank. A ``DistributedCheckpointManager`` saves them: every rank calls
``resume`` and ``save_if_due`` (collectives), DCP writes the tensors once
across ranks, and each rank's generators go into a file of its own, so ranks
may seed differently. It takes the DDP-wrapped model as it is (its
``module.`` keys are normalised on save and on restore).
examples/before/loop_ddp.py is the loop without checkpoints; this file
changes five lines of it (``tests/test_recipes.py`` counts them): the
manager, the restore, the start step (a modified line, 2) and the save.
``save_if_due(..., last_step=args.steps)`` saves the last step whatever the
cadence and then closes the manager: it waits for that save's retention and
frees the manager's process groups, which must go before the default group
is destroyed.

``--mistake optimizer`` empties the optimizer's state after the restore (the
lines marked MISTAKE): a restart trains on with a fresh AdamW on every rank,
the first step after it still matches (the weights and generators came
back), the second does not, and ``resume-test`` says the optimizer state was
not restored.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import ckpt_lesson as cl

SAMPLES, GLOBAL_BATCH = 256, 32


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mistake", choices=("optimizer",), help="start AdamW afresh")  # MISTAKE
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--seed", type=int, default=11)
    args = parser.parse_args(argv)

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    torch.manual_seed(args.seed)  # the same seed on every rank: see the module docstring
    g = torch.Generator().manual_seed(args.seed)
    x = torch.randn(SAMPLES, 16, generator=g)
    y = x @ torch.randn(16, 1, generator=g) + 0.1 * torch.randn(SAMPLES, 1, generator=g)
    model = DDP(nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Dropout(0.1), nn.Linear(64, 1)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    mgr = cl.DistributedCheckpointManager(every_steps=5)  # $CKPT_LESSON_CKPT_DIR if set, else checkpoints/
    start, state = mgr.resume(model=model, optimizer=optimizer)  # every rank, the same save; 0: a first run
    if args.mistake == "optimizer":  # MISTAKE: a restart trains on with a fresh AdamW
        optimizer.state.clear()  # MISTAKE

    model.train()
    per_epoch = SAMPLES // GLOBAL_BATCH
    for step in range(start + 1, args.steps + 1):
        epoch, i = divmod(step - 1, per_epoch)  # like DistributedSampler: an order per (seed, epoch)
        order = torch.randperm(SAMPLES, generator=torch.Generator().manual_seed(args.seed * 1000 + epoch))
        batch = order[i * GLOBAL_BATCH : (i + 1) * GLOBAL_BATCH]
        mine = batch[rank::world]  # this rank's share of the global batch
        loss = nn.functional.mse_loss(model(x[mine]), y[mine])
        optimizer.zero_grad()
        loss.backward()  # DDP averages the gradients across ranks here
        optimizer.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean)  # the global batch's loss, so every rank's divergence shows
        if rank == 0:
            cl.log_step(step, mean.item() / world, sample_ids=batch)
        mgr.save_if_due(step, state, last_step=args.steps)  # every 5 steps and the last, then closes
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # Leave without the interpreter's teardown. Every save is published and every step logged by
    # now; what teardown would still destroy are gloo's native objects, in no set order, and in
    # this project's CI that aborted a rank after its work was done ("terminate called without an
    # active exception", SIGABRT), turning a good run into a crash.
    os._exit(code)
