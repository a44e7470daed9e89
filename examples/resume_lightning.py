"""A Lightning training script that resumes exactly, through ``VerifiedCheckpointIO``.

``resume-test`` passes it:

    python -m ckpt_lesson resume-test -- python examples/resume_lightning.py

examples/before/resume_lightning.py is the script without ckpt_lesson; this
file changes four lines of it (``tests/test_recipes.py`` counts them): the
import, ``plugins=[VerifiedCheckpointIO()]``, and ``ckpt_path=`` in ``fit``.

``--mistake no-resume`` forgets ``ckpt_path=`` in ``trainer.fit`` (the lines
marked MISTAKE): every restart begins again at step 0, and resume-test says so.

What Lightning restores by itself from a checkpoint: weights, optimizer and
scheduler state, the loop counters (epoch, step). What it does not, and this
script adds:

* **the RNG.** Lightning stores no generator state in its checkpoints, so a
  resumed run would draw different dropout masks. ``VerifiedCheckpointIO``
  adds every generator to each checkpoint and restores it when ``fit`` loads
  the file (``rng=True``, its default): nothing to write here.
* **the data order.** ``shuffle=True`` draws an epoch's order from the global
  RNG; here the order of an epoch depends on ``(seed, epoch)`` only (Lightning
  calls ``set_epoch`` on the sampler), and the DataLoader gets its own
  generator so that starting an epoch draws nothing from the global one.
* **which checkpoint.** Saves happen at epoch ends: Lightning 2.6 resumes
  mid-epoch only with a loader that has ``state_dict``/``load_state_dict``
  (it warns "your dataloader is not resumable" otherwise, in
  ``training_epoch_loop.py``). ``latest_verified_checkpoint`` names the newest
  file whose integrity footer verifies; the plugin writes every file atomically.

The checkpoint folder is the trainer's own (``checkpoints/`` here: there is
no logger), or ``$CKPT_LESSON_CKPT_DIR`` when set (``resume-test`` sets it;
the plugin then saves there). Tiny on purpose: 3 epochs of 6 steps of a
small MLP; nearly all of its run time is importing Lightning.
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
from ckpt_lesson.integrations.lightning import VerifiedCheckpointIO, latest_verified_checkpoint

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
    parser.add_argument("--mistake", choices=("no-resume",), help="forget ckpt_path")  # MISTAKE
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
        plugins=[VerifiedCheckpointIO()],
        callbacks=[every_epoch], logger=False, enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0,
    )  # fmt: skip
    if args.mistake == "no-resume":  # MISTAKE: without ckpt_path, fit starts from step 0 on every restart
        trainer.fit(Tiny(), loader)  # MISTAKE
        return 0  # MISTAKE
    trainer.fit(Tiny(), loader, ckpt_path=latest_verified_checkpoint())  # newest that verifies; None: fresh
    return 0


if __name__ == "__main__":
    sys.exit(main())
