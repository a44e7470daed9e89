"""The Hugging Face Trainer's own resume, with nothing of ckpt_lesson in the save or the load.

Run by ``benchmarks/frameworks_table.py`` under ``resume-test``:

    python -m ckpt_lesson resume-test -- python examples/frameworks/hf_trainer.py --out {ckpt_dir}

The recipe is the Trainer's documented one: ``save_steps`` with the default
saving into ``output_dir``, then ``trainer.train(resume_from_checkpoint=True)``,
which resumes from the highest-numbered ``checkpoint-N`` folder there (the
Trainer raises when there is none, so a first run passes ``False``: the same
check its own example scripts make with ``get_last_checkpoint``).

A GPT-2 of about 3k parameters built from a config (nothing is downloaded),
dropout 0.1 (GPT-2's default), the Trainer's shuffled loader (a
``RandomSampler``), 3 epochs of 6 steps and a save every 4 steps, so the
saves at steps 4, 8 and 16 fall mid-epoch and the one at step 12 at an
epoch's end. The only ckpt_lesson line is ``log_step`` in the callback, which
does nothing outside ``resume-test``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments
from transformers.trainer_utils import get_last_checkpoint
from transformers.utils import logging as hf_logging

from ckpt_lesson import log_step

SEQUENCES, LENGTH, BATCH, EPOCHS, SAVE_EVERY = 48, 8, 8, 3, 4
#: Seconds each step waits before it reports, standing in for a real step's compute: a step of a few
#: milliseconds is over before resume-test's kill arrives, which then lands steps after its aim, and a
#: save that follows its step's report at once is not taken for the next step's.
STEP_SECONDS = 0.05


class LogSteps(TrainerCallback):
    """Report each optimizer step's loss to resume-test (``logging_steps=1``)."""

    def on_step_end(self, args, state, control, **kwargs):
        time.sleep(STEP_SECONDS)  # the step's compute; the Trainer then logs it, then saves

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            log_step(state.global_step, logs["loss"], grad_norm=logs["grad_norm"], lr=logs["learning_rate"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="runs/hf_trainer", help="the Trainer's output_dir")
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
        output_dir=args.out, num_train_epochs=EPOCHS, per_device_train_batch_size=BATCH,
        save_steps=SAVE_EVERY, logging_steps=1, seed=args.seed, use_cpu=True, report_to=[],
        disable_tqdm=True, dataloader_num_workers=0,
    )  # fmt: skip
    trainer = Trainer(model=model, args=training, train_dataset=data, callbacks=[LogSteps()])
    # True resumes from get_last_checkpoint(output_dir); with nothing saved yet it would raise.
    resume = os.path.isdir(args.out) and get_last_checkpoint(args.out) is not None
    trainer.train(resume_from_checkpoint=resume)
    return 0


if __name__ == "__main__":
    sys.exit(main())
