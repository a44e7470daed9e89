"""A Hugging Face ``Trainer`` script that resumes from the newest checkpoint that verifies.

``resume-test`` passes it:

    python -m ckpt_lesson resume-test -- python examples/resume_hf.py

examples/before/resume_hf.py is the script without ckpt_lesson; this file
changes five lines of it (``tests/test_recipes.py`` counts them): the import,
the callback, and ``resume_from_checkpoint=`` in ``train``.

``--mistake no-resume`` forgets ``resume_from_checkpoint=`` (the lines marked
MISTAKE): every restart begins again at step 0, and resume-test says so.

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
checkpoint folder is the Trainer's default ``output_dir`` (``trainer_output``),
or ``$CKPT_LESSON_CKPT_DIR`` when set (``resume-test`` sets it; the callback
then points the Trainer there).
"""

from __future__ import annotations

import argparse
import sys

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments
from transformers.utils import logging as hf_logging

import ckpt_lesson as cl
from ckpt_lesson.integrations.hf import VerifiedCheckpointCallback, latest_verified_checkpoint

SEQUENCES, LENGTH, BATCH, EPOCHS, SAVE_EVERY = 48, 8, 8, 3, 4


class LogSteps(TrainerCallback):
    """Report each step's loss to resume-test (``logging_steps=1``: one log per optimizer step)."""

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            cl.log_step(
                state.global_step, logs["loss"], grad_norm=logs["grad_norm"], lr=logs["learning_rate"]
            )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mistake", choices=("no-resume",), help="forget resume_from_checkpoint")  # MISTAKE
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
    training = TrainingArguments(
        num_train_epochs=EPOCHS, per_device_train_batch_size=BATCH,
        save_steps=SAVE_EVERY, logging_steps=1, seed=args.seed, use_cpu=True, report_to=[],
        disable_tqdm=True, dataloader_num_workers=0,
    )  # fmt: skip
    callbacks = [VerifiedCheckpointCallback(), LogSteps()]
    trainer = Trainer(model=model, args=training, train_dataset=data, callbacks=callbacks)
    if args.mistake == "no-resume":  # MISTAKE: without resume_from_checkpoint, every restart starts at 0
        trainer.train()  # MISTAKE
        return 0  # MISTAKE
    trainer.train(resume_from_checkpoint=latest_verified_checkpoint())  # None: a fresh start
    return 0


if __name__ == "__main__":
    sys.exit(main())
