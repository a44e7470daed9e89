"""What ``VerifiedCheckpointCallback`` adds to a Hugging Face ``Trainer`` save: time and memory.

Run from the repository root::

    python benchmarks/bench_hf.py                 # GPT-2 of about 25M parameters, 5 saves
    python benchmarks/bench_hf.py --layers 8 --saves 7

A GPT-2 built from a config (nothing downloaded) trains with a save every step.
A timing callback placed before ours measures the Trainer's own save (from
``on_step_end``, which the Trainer calls just before ``_save_checkpoint``, to
``on_save``, which it calls just after) and then our ``on_save`` (fsync and hash
every file, write the manifest). Peak memory of our ``on_save`` is the most
Python-allocated memory during it (``tracemalloc``; it hashes in 1 MiB chunks).
Prints a markdown table with the machine and the load average.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import tempfile
import time
import tracemalloc

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments
from transformers.utils import logging as hf_logging

from ckpt_lesson.integrations.hf import VerifiedCheckpointCallback


class Timed(TrainerCallback):
    """Times the Trainer's save (step end to on_save) and then ours (its on_save)."""

    def __init__(self, ours: VerifiedCheckpointCallback) -> None:
        self.ours, self.stock, self.added, self.peaks, self.sizes = ours, [], [], [], []
        self._t = 0.0

    def on_step_end(self, args, state, control, **kwargs):
        self._t = time.perf_counter()

    def on_save(self, args, state, control, **kwargs):
        self.stock.append(time.perf_counter() - self._t)
        tracemalloc.start()
        start = time.perf_counter()
        self.ours.on_save(args, state, control, **kwargs)
        self.added.append(time.perf_counter() - start)
        self.peaks.append(tracemalloc.get_traced_memory()[1])
        tracemalloc.stop()
        folder = os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
        self.sizes.append(sum(e.stat().st_size for e in os.scandir(folder) if e.is_file()))
        return control


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--saves", type=int, default=5)
    args = parser.parse_args()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    config = GPT2Config(vocab_size=8192, n_positions=64, n_embd=args.width, n_layer=args.layers, n_head=8)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(config)
    ids = torch.randint(0, 8192, (64, 32), generator=torch.Generator().manual_seed(0))
    data = [{"input_ids": row, "labels": row} for row in ids]
    timer = Timed(VerifiedCheckpointCallback())
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="bench-hf-") as out:
        targs = TrainingArguments(
            output_dir=out, max_steps=args.saves + 1, save_steps=1, per_device_train_batch_size=4,
            report_to=[], disable_tqdm=True, logging_strategy="no", use_cpu=True, seed=0,
            save_total_limit=2,
        )  # fmt: skip
        Trainer(model=model, args=targs, train_dataset=data, callbacks=[timer]).train()
    load_after = os.getloadavg()
    stock, added = timer.stock[1:], timer.added[1:]  # the first save warms up
    size = statistics.median(timer.sizes)
    before, after = [round(x, 2) for x in load_before], [round(x, 2) for x in load_after]
    print(f"machine: {platform.platform()}, {os.cpu_count()} CPUs, torch {torch.__version__}")
    print(f"load average before {before}, after {after}")
    print(f"checkpoint folder: {size / 1e6:.0f} MB, median of {len(stock)} saves\n")
    print("| Trainer save s | + our on_save s | added | peak Python MB in our on_save |")
    print("|---:|---:|---:|---:|")
    s, a = statistics.median(stock), statistics.median(added)
    print(f"| {s:.3f} | {a:.3f} | {a / s:.2f}x | {max(timer.peaks) / 1e6:.1f} |")


if __name__ == "__main__":
    main()
