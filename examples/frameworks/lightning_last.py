"""Lightning's own resume, with nothing of ckpt_lesson in the save or the load.

Run by ``benchmarks/frameworks_table.py`` under ``resume-test``:

    python -m ckpt_lesson resume-test -- python examples/frameworks/lightning_last.py --out {ckpt_dir}

The recipe is Lightning's documented one: ``ModelCheckpoint(save_last=True,
every_n_train_steps=4)`` and ``trainer.fit(..., ckpt_path="last")``, which
resumes from ``last.ckpt`` (Lightning warns and starts fresh when there is
none yet).

A small MLP with dropout 0.2, a ``DataLoader(shuffle=True)``, 3 epochs of 6
steps and a save every 4 steps, so the saves at steps 4, 8 and 16 fall
mid-epoch and the one at step 12 at an epoch's end. The only ckpt_lesson line
is ``log_step``, which does nothing outside ``resume-test``.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
import warnings

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from ckpt_lesson import log_step

SAMPLES, BATCH, EPOCHS, SAVE_EVERY = 48, 8, 3, 4
#: Seconds each step waits before it reports, standing in for a real step's compute: a step of a few
#: milliseconds is over before resume-test's kill arrives, which then lands steps after its aim, and a
#: save that follows its step's report at once is not taken for the next step's.
STEP_SECONDS = 0.05


class Tiny(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Dropout(0.2), nn.Linear(64, 1))

    def training_step(self, batch, batch_idx):
        x, y, ids = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        # Reported here, before ModelCheckpoint's on_train_batch_end saves this step: a save then
        # follows the report of its step, as resume-test expects (global_step counts finished steps).
        time.sleep(STEP_SECONDS)
        log_step(self.trainer.global_step + 1, loss.item(), sample_ids=ids)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=3e-3, weight_decay=0.01)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="runs/lightning_last", help="the checkpoint folder")
    parser.add_argument("--seed", type=int, default=7)
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore")  # Lightning's advice about workers and loggers, on every run
    logging.getLogger("lightning").setLevel(logging.ERROR)

    torch.set_num_threads(1)  # same thread count every run: reductions add up in the same order
    L.seed_everything(args.seed, verbose=False)
    g = torch.Generator().manual_seed(args.seed)
    x = torch.randn(SAMPLES, 16, generator=g)
    y = torch.sin(x @ torch.randn(16, 1, generator=g))
    loader = DataLoader(TensorDataset(x, y, torch.arange(SAMPLES)), batch_size=BATCH, shuffle=True)
    checkpoint = L.pytorch.callbacks.ModelCheckpoint(
        dirpath=args.out, save_last=True, every_n_train_steps=SAVE_EVERY
    )
    trainer = L.Trainer(
        max_epochs=EPOCHS, accelerator="cpu", devices=1, callbacks=[checkpoint], logger=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
    )  # fmt: skip
    trainer.fit(Tiny(), loader, ckpt_path="last")
    return 0


if __name__ == "__main__":
    sys.exit(main())
