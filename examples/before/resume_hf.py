"""The Trainer script of examples/resume_hf.py as it is written before ckpt_lesson.

A GPT-2 built from a config, ``TrainingArguments`` with the default
``output_dir`` and a save every 4 steps, ``trainer.train()``. A callback logs
each step with ``cl.log_step`` so that ``resume-test`` can compare runs; that
call is the only ckpt_lesson in it. ``tests/test_recipes.py`` counts the
lines examples/resume_hf.py changes.
"""

from __future__ import annotations

import argparse
import sys

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments
from transformers.utils import logging as hf_logging

import ckpt_lesson as cl

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
    callbacks = [LogSteps()]
    trainer = Trainer(model=model, args=training, train_dataset=data, callbacks=callbacks)
    trainer.train()
    return 0


if __name__ == "__main__":
    sys.exit(main())
