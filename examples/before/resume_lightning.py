"""The Lightning script of examples/resume_lightning.py as it is written before ckpt_lesson.

A ``LightningModule``, a ``ModelCheckpoint`` saving every epoch into the
trainer's own folder, ``trainer.fit``. It logs each step with
``cl.log_step`` so that ``resume-test`` can compare runs; that call is the
only ckpt_lesson in it. ``tests/test_recipes.py`` counts the lines
examples/resume_lightning.py changes.
"""

from __future__ import annotations

import argparse
import logging
import sys
import warnings

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, Sampler, TensorDataset

import ckpt_lesson as cl

SAMPLES, BATCH, EPOCHS = 48, 8, 3


class EpochSampler(Sampler[int]):
    """The order of an epoch from ``(seed, epoch)`` alone; Lightning calls ``set_epoch`` each epoch."""

    def __init__(self, n: int, seed: int) -> None:
        self.n, self.seed, self.epoch = n, seed, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self):
        generator = torch.Generator().manual_seed(self.seed * 1000 + self.epoch)
        return iter(torch.randperm(self.n, generator=generator).tolist())

    def __len__(self) -> int:
        return self.n


class Tiny(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Dropout(0.2), nn.Linear(64, 1))

    def training_step(self, batch, batch_idx):
        x, y, _ = batch
        return nn.functional.mse_loss(self.net(x), y)

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
        # global_step counts optimizer steps and has already moved past this one.
        cl.log_step(self.trainer.global_step, outputs["loss"].item(), sample_ids=batch[2])

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=3e-3, weight_decay=0.01)


def make_data(seed: int) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(SAMPLES, 16, generator=g)
    y = torch.sin(x @ torch.randn(16, 1, generator=g))
    return TensorDataset(x, y, torch.arange(SAMPLES))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seed", type=int, default=7)
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore")  # Lightning's advice about workers and loggers, on every run
    logging.getLogger("lightning").setLevel(logging.ERROR)

    torch.set_num_threads(1)  # same thread count every run: reductions add up in the same order
    torch.manual_seed(args.seed)
    data = make_data(args.seed)
    loader = DataLoader(
        data, batch_size=BATCH, sampler=EpochSampler(SAMPLES, args.seed), generator=torch.Generator()
    )
    every_epoch = L.pytorch.callbacks.ModelCheckpoint(
        filename="{epoch}-{step}", every_n_epochs=1, save_top_k=-1
    )
    trainer = L.Trainer(
        max_epochs=EPOCHS, accelerator="cpu", devices=1,
        callbacks=[every_epoch], logger=False, enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0,
    )  # fmt: skip
    trainer.fit(Tiny(), loader)
    return 0


if __name__ == "__main__":
    sys.exit(main())
