"""accelerate's own resume, with nothing of ckpt_lesson in the save or the load.

Run by ``benchmarks/frameworks_table.py`` under ``resume-test``:

    python -m ckpt_lesson resume-test -- python examples/frameworks/accelerate_state.py --out {ckpt_dir}

The recipe is accelerate's documented one (its ``by_feature/checkpointing.py``
example): ``accelerator.save_state(f"{out}/step_{n}")`` every few steps; at
start, ``load_state`` of the newest ``step_N`` folder, the epoch and the
position in it computed from N, and ``accelerator.skip_first_batches`` for the
rest of the interrupted epoch. ``save_state`` writes the model, optimizer,
scheduler and the RNG states; ``load_state`` restores them.

A small MLP with dropout 0.2, a ``DataLoader(shuffle=True)`` prepared by the
accelerator, 3 epochs of 6 steps and a save every 4 steps, so the saves at
steps 4, 8 and 16 fall mid-epoch and the one at step 12 at an epoch's end.
The only ckpt_lesson line is ``log_step``, which does nothing outside
``resume-test``.
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from ckpt_lesson import log_step

SAMPLES, BATCH, EPOCHS, SAVE_EVERY = 48, 8, 3, 4
#: Seconds each step waits before it reports, standing in for a real step's compute: a step of a few
#: milliseconds is over before resume-test's kill arrives, which then lands steps after its aim, and a
#: save that follows its step's report at once is not taken for the next step's.
STEP_SECONDS = 0.05


def newest_save(out: Path) -> tuple[Path, int] | None:
    """The ``step_N`` folder with the highest N, and N (the example's naming)."""
    named = [p for p in out.glob("step_*") if p.is_dir() and re.fullmatch(r"step_\d+", p.name)]
    found = [(int(p.name[5:]), p) for p in named]
    if not found:
        return None
    step, path = max(found)
    return path, step


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="runs/accelerate_state", help="where save_state writes")
    parser.add_argument("--seed", type=int, default=7)
    args = parser.parse_args(argv)

    torch.set_num_threads(1)  # same thread count every run: reductions add up in the same order
    accelerator = Accelerator(cpu=True)
    set_seed(args.seed)
    g = torch.Generator().manual_seed(args.seed)
    x = torch.randn(SAMPLES, 16, generator=g)
    y = torch.sin(x @ torch.randn(16, 1, generator=g))
    loader = DataLoader(TensorDataset(x, y, torch.arange(SAMPLES)), batch_size=BATCH, shuffle=True)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Dropout(0.2), nn.Linear(64, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.LinearLR(optimizer, 1.0, 0.1, total_iters=EPOCHS * len(loader))
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)

    step, first_epoch, skip = 0, 0, 0
    out = Path(args.out)
    found = newest_save(out)
    if found is not None:
        accelerator.load_state(str(found[0]))
        step = found[1]
        first_epoch, skip = divmod(step, len(loader))

    model.train()
    for epoch in range(first_epoch, EPOCHS):
        # Only the interrupted epoch skips what it already trained on; later ones use the loader.
        batches = accelerator.skip_first_batches(loader, skip) if epoch == first_epoch and skip else loader
        for xb, yb, ids in batches:
            loss = nn.functional.mse_loss(model(xb), yb)
            optimizer.zero_grad()
            accelerator.backward(loss)
            optimizer.step()
            scheduler.step()
            step += 1
            time.sleep(STEP_SECONDS)
            log_step(step, loss.item(), sample_ids=ids)  # reported, then saved at once
            if step % SAVE_EVERY == 0:
                accelerator.save_state(str(out / f"step_{step}"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
