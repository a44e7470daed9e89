"""Lightning's stock checkpoint writer against ``VerifiedCheckpointIO``: time and peak memory.

Run from the repository root::

    python benchmarks/bench_lightning.py               # about 157 MB, 5 repetitions
    python benchmarks/bench_lightning.py --layers 48 --reps 7

The checkpoint is shaped like one Lightning writes for an AdamW run: a
``state_dict`` of weights and ``optimizer_states`` holding two moments per
weight. Each repetition saves and loads it with both writers, in a shuffled
order, each save into a fresh file. Peak memory is the most *Python-allocated*
memory during a save (``tracemalloc``, which sees the stock writer's in-memory
buffer; measured in a separate pass, since tracing slows the timed runs). Prints
a markdown table with the machine and the load average before and after.
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import shutil
import statistics
import tempfile
import time
import tracemalloc
from pathlib import Path

import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO

from ckpt_lesson.integrations.lightning import VerifiedCheckpointIO


def lightning_like_checkpoint(layers: int, width: int) -> dict:
    gen = torch.Generator().manual_seed(0)
    weights = {f"layer{i}.weight": torch.randn(width, width, generator=gen) for i in range(layers)}
    moments = {
        i: {"exp_avg": torch.randn(width, width, generator=gen), "exp_avg_sq": torch.rand(width, width)}
        for i in range(layers)
    }
    return {
        "epoch": 3,
        "global_step": 1200,
        "state_dict": weights,
        "optimizer_states": [
            {"state": moments, "param_groups": [{"lr": 1e-3, "params": list(range(layers))}]}
        ],
    }


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def peak_python_mb(fn) -> float:
    tracemalloc.start()
    try:
        fn()
        return tracemalloc.get_traced_memory()[1] / 1e6
    finally:
        tracemalloc.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=13, help="weight matrices (1024 x 1024 each)")
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    checkpoint = lightning_like_checkpoint(args.layers, args.width)
    writers = {"stock": TorchCheckpointIO(), "ours": VerifiedCheckpointIO()}
    load_before = os.getloadavg()
    root = Path(tempfile.mkdtemp(prefix="bench-lightning-"))
    times: dict[str, list[float]] = {f"{w} {op}": [] for w in writers for op in ("save", "load")}
    size = 0
    try:
        for rep in range(args.reps + 1):  # the first round warms up and is not recorded
            order = list(writers)
            random.Random(rep).shuffle(order)
            for name in order:
                path = root / f"{rep}-{name}" / "last.ckpt"
                save = timed(lambda: writers[name].save_checkpoint(checkpoint, path))  # noqa: B023
                load = timed(lambda: writers[name].load_checkpoint(path))  # noqa: B023
                size = path.stat().st_size
                if rep:
                    times[f"{name} save"].append(save)
                    times[f"{name} load"].append(load)
                shutil.rmtree(path.parent)
        peaks = {}
        for name, io in writers.items():
            path = root / f"peak-{name}" / "last.ckpt"
            peaks[name] = peak_python_mb(lambda: io.save_checkpoint(checkpoint, path))  # noqa: B023
    finally:
        shutil.rmtree(root, ignore_errors=True)
    load_after = os.getloadavg()
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"machine: {platform.platform()}, {os.cpu_count()} CPUs, torch {torch.__version__}")
    before, after = [round(x, 2) for x in load_before], [round(x, 2) for x in load_after]
    print(f"load average before {before}, after {after}")
    print(f"checkpoint: {size / 1e6:.0f} MB on disk, median of {args.reps}\n")
    print("| writer | save s | load s | peak Python MB during a save |")
    print("|---|---:|---:|---:|")
    for name in writers:
        print(
            f"| {name} | {med[name + ' save']:.3f} | {med[name + ' load']:.3f} | "
            f"{peaks[name]:.1f} ({peaks[name] * 1e6 / size:.3f}x the file) |"
        )


if __name__ == "__main__":
    main()
