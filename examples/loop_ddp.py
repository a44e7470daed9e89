"""A DistributedDataParallel loop on CPU (gloo), launched by torchrun, that resumes bit for bit.

    python -m ckpt_lesson resume-test -- torchrun --standalone --nproc_per_node=2 examples/loop_ddp.py

Each rank trains on its half of every global batch; DDP averages the
gradients, so the weights and the optimizer state are the same on every
rank. Two ways to save them, both taking the DDP-wrapped model as it is
(its ``module.`` keys are normalised on save and on restore):

* ``--manager dcp`` (the default): a ``DistributedCheckpointManager``; every
  rank calls ``save`` and ``restore_latest`` (collectives), DCP writes the
  tensors once across ranks, and each rank's generators go into a file of
  its own, so ranks may seed differently;
* ``--manager rank0``: rank 0 saves alone with a ``CheckpointManager`` and
  every rank restores that one save. It then holds rank 0's generators
  only; every rank here seeds alike and draws alike (dropout of the same
  shapes), so they are every rank's and restoring them everywhere is exact.

``--mistake optimizer`` leaves the optimizer out of the state: a restart
gets a fresh AdamW on every rank, the first step after it still matches (the
weights and generators came back), the second does not, and ``resume-test``
says the optimizer state was not restored. It runs with ``--manager rank0``
for now: ``DistributedCheckpointManager`` does not yet take a state without
an optimizer part (torch's ``get_state_dict`` fails on ``None``).
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

MISTAKES = ("optimizer",)
SAMPLES, GLOBAL_BATCH, SAVE_EVERY = 256, 32, 5


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mistake", choices=MISTAKES, help="leave the optimizer out of the state")
    parser.add_argument("--ckpt-dir", default=os.environ.get("CKPT_LESSON_CKPT_DIR", "runs/loop_ddp"))
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--seed", type=int, default=11)
    parser.add_argument("--manager", choices=("dcp", "rank0"), default="dcp", help="who saves (see above)")
    args = parser.parse_args(argv)
    if args.mistake == "optimizer" and args.manager == "dcp":
        parser.error("--mistake optimizer needs --manager rank0 (the DCP manager needs an optimizer part)")

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    torch.manual_seed(args.seed)  # the same seed on every rank: see the module docstring
    g = torch.Generator().manual_seed(args.seed)
    x = torch.randn(SAMPLES, 16, generator=g)
    y = x @ torch.randn(16, 1, generator=g) + 0.1 * torch.randn(SAMPLES, 1, generator=g)
    model = DDP(nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Dropout(0.1), nn.Linear(64, 1)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    state = {"model": model, "optimizer": optimizer}  # RESUME: the DDP wrapper as it is
    if args.mistake == "optimizer":
        del state["optimizer"]  # MISTAKE (optimizer): a restart trains on with a fresh AdamW

    if args.manager == "dcp":
        mgr = cl.DistributedCheckpointManager(args.ckpt_dir, keep_last=2, every_steps=SAVE_EVERY)  # RESUME
    else:
        # Rank 0 opens the folder first (a manager tidies what a killed save left behind when it
        # opens it); the others open it once that is done, only to restore.
        if rank == 0:
            mgr = cl.CheckpointManager(args.ckpt_dir, keep_last=2, every_steps=SAVE_EVERY)
        dist.barrier()
        if rank != 0:
            mgr = cl.CheckpointManager(args.ckpt_dir, keep_last=2, every_steps=SAVE_EVERY)
    restored = mgr.restore_latest(state)  # RESUME: every rank, the same save
    start = restored.step if restored is not None else 0  # RESUME

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
        if step % SAVE_EVERY == 0 and (args.manager == "dcp" or rank == 0):
            mgr.save(step, state)  # RESUME
    mgr.close()  # DCP: its own process groups go before the default one; a folder: retention ends
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
