"""A Hugging Face ``Trainer`` script that resumes from the newest checkpoint that verifies.

``resume-test`` passes it:

    python -m ckpt_lesson resume-test -- python examples/resume_hf.py

``--mistake no-resume`` forgets ``resume_from_checkpoint=`` (marked
``# MISTAKE`` below): every restart begins again at step 0, and resume-test
says so.

The Trainer restores weights, optimizer, scheduler, RNG (``rng_state.pth``)
and its counters by itself, and skips the batches of the interrupted epoch
that were already trained on, so saves may fall mid-epoch. What it does not do
is check what it resumes from: the highest-numbered ``checkpoint-N`` folder may
be one a kill cut short. :class:`~ckpt_lesson.integrations.hf.VerifiedCheckpointCallback`
records a manifest in each folder once the save is complete, and
:func:`~ckpt_lesson.integrations.hf.latest_verified_checkpoint` resumes from
the newest folder whose manifest verifies.

The model is a GPT-2 of about 3k parameters built from a config (nothing is
downloaded), dropout on, 3 epochs of 6 steps, a save every 4 steps. The
checkpoint folder (the Trainer's ``output_dir``) is ``$CKPT_LESSON_CKPT_DIR``
when set (``resume-test`` sets it), else ``--ckpt-dir``.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments
from transformers.utils import logging as hf_logging

from ckpt_lesson import log_step
from ckpt_lesson.integrations.hf import VerifiedCheckpointCallback, latest_verified_checkpoint

MISTAKES = ("no-resume",)
SEQUENCES, LENGTH, BATCH, EPOCHS, SAVE_EVERY = 48, 8, 8, 3, 4


class LogSteps(TrainerCallback):
    """Report each step's loss to resume-test (``logging_steps=1``: one log per optimizer step)."""

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            log_step(state.global_step, logs["loss"], grad_norm=logs["grad_norm"], lr=logs["learning_rate"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mistake", choices=MISTAKES, help="make one classic resume mistake")
    parser.add_argument("--ckpt-dir", default=os.environ.get("CKPT_LESSON_CKPT_DIR", "runs/resume_hf"))
    parser.add_argument("--seed", type=int, default=7)
    args = parser.parse_args(argv)
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()

    torch.set_num_threads(1)  # same thread count every run: reductions add up in the same order
    config = GPT2Config(vocab_size=32, n_positions=LENGTH, n_embd=16, n_layer=1, n_head=2)
    torch.manual_seed(args.seed)
    model = GPT2LMHeadModel(config)
    ids = torch.randint(0, 32, (SEQUENCES, LENGTH), generator=torch.Generator().manual_seed(args.seed))
    data = [{"input_ids": row, "labels": row} for row in ids]
    output_dir = Path(args.ckpt_dir)
    training = TrainingArguments(
        output_dir=str(output_dir), num_train_epochs=EPOCHS, per_device_train_batch_size=BATCH,
        save_steps=SAVE_EVERY, logging_steps=1, seed=args.seed, use_cpu=True, report_to=[],
        disable_tqdm=True, dataloader_num_workers=0,
    )  # fmt: skip
    callbacks = [VerifiedCheckpointCallback(), LogSteps()]
    trainer = Trainer(model=model, args=training, train_dataset=data, callbacks=callbacks)
    # The newest folder whose manifest verifies; None (a fresh start) when there is none yet.
    resume = latest_verified_checkpoint(output_dir) if output_dir.is_dir() else None
    if args.mistake == "no-resume":
        # MISTAKE (no-resume): without resume_from_checkpoint, every restart starts at step 0.
        resume = None
    trainer.train(resume_from_checkpoint=resume)
    return 0


if __name__ == "__main__":
    sys.exit(main())
