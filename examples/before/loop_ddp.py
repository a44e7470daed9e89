"""The loop of examples/loop_ddp.py as a DDP tutorial script writes it, before ckpt_lesson.

Launched by torchrun on CPU (gloo); each rank trains on its half of every
global batch, the data order of an epoch from ``(seed, epoch)`` as
``DistributedSampler`` has it. Rank 0 logs each step with ``cl.log_step`` so
that ``resume-test`` can compare runs; that call is the only ckpt_lesson in
it. ``tests/test_recipes.py`` counts the lines examples/loop_ddp.py changes.

    torchrun --standalone --nproc_per_node=2 examples/before/loop_ddp.py
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

    model.train()
    per_epoch = SAMPLES // GLOBAL_BATCH
    for step in range(1, args.steps + 1):
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
