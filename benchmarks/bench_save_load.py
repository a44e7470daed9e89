"""What does safety cost? Time our save/load paths against plain torch.save/torch.load.

Run from the repository root::

    python benchmarks/bench_save_load.py              # 128 MB state dict, 5 runs each
    python benchmarks/bench_save_load.py --mb 256 --runs 7 --dir /some/disk

Writes ``benchmarks/results.md`` (a table of medians and ratios plus the
machine) and prints the same table. Not a test and not run by CI: timings
depend on the disk, the page cache and whatever else the machine is doing.

Compared, all on the same state dict, in the same process, interleaved
round-robin so that drift (other jobs, cache pressure) hits every variant alike:

* ``torch.save``                      plain save, no fsync (what most code does)
* ``torch.save + fsync``              plain save, then fsync of file and directory (fair baseline)
* ``atomic_save``                     ours: temp file, sha256 hashed while writing, footer,
                                      fsync, ``os.replace``, fsync of the directory
* ``save_checkpoint`` / ``save_sharded_checkpoint(4)``  the full payload (model + optimizer + RNG ...)
* ``torch.load(weights_only=True)``   plain load from the page cache
* ``load_verified_file``              ours: one sha256 pass checking the footer, then the same load
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

import ckpt_lesson as cl
from ckpt_lesson.checkpoint import load_verified_file

HERE = Path(__file__).resolve().parent


def make_state(mb: int) -> dict[str, torch.Tensor]:
    """``mb`` megabytes of float32 weights in 16 tensors (a mid-sized model's state dict)."""
    g = torch.Generator().manual_seed(0)
    per = mb * 2**20 // 4 // 16
    return {f"layer{i}.weight": torch.randn(per, generator=g) for i in range(16)}


def make_model(mb: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A model with about ``mb`` MB of weights and an AdamW that has taken one step (moments exist)."""
    side = int((mb * 2**20 / 4 / 8) ** 0.5)
    model = torch.nn.Sequential(*[torch.nn.Linear(side, side, bias=False) for _ in range(8)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    return model, opt


def fsync_file_and_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    cl.fsync_dir(path.parent)


def machine() -> str:
    cpu = "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return (
        f"{os.cpu_count()} CPUs ({cpu}); torch {torch.__version__}; Python {platform.python_version()}; "
        f"{platform.system()} {platform.release()}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=int, default=128, help="size of the state dict in MB (default 128)")
    parser.add_argument("--runs", type=int, default=5, help="runs per variant; the median is reported")
    parser.add_argument("--dir", default=None, help="folder on the disk to measure (default: here)")
    parser.add_argument("--out", default=str(HERE / "results.md"), help="where to write the results table")
    args = parser.parse_args()

    torch.set_num_threads(1)
    root = Path(tempfile.mkdtemp(prefix="bench-", dir=args.dir or HERE))
    try:
        results = run(root, args.mb, args.runs)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    table = render(results, args.mb, args.runs)
    print(table)
    Path(args.out).write_text(table)


def run(root: Path, mb: int, runs: int) -> dict[str, list[float]]:
    sd = make_state(mb)
    model, opt = make_model(mb)
    state = cl.TrainState(step=1)
    plain, ours = root / "plain.pt", root / "ours.pt"
    counter = iter(range(10**9))

    def sharded() -> None:
        cl.save_sharded_checkpoint(model, opt, None, state, root / f"sh-{next(counter)}", num_shards=4)

    full_plain = root / "full-plain.pt"

    def plain_full() -> None:
        payload = {"model": model.state_dict(), "optimizer": opt.state_dict(), "state": state.to_dict()}
        torch.save(payload, full_plain)
        fsync_file_and_dir(full_plain)

    variants: dict[str, Callable[[], object]] = {
        "torch.save": lambda: torch.save(sd, plain),
        "torch.save + fsync": lambda: (torch.save(sd, plain), fsync_file_and_dir(plain)),
        "atomic_save": lambda: cl.atomic_save(sd, ours),
        "torch.save + fsync, model+AdamW": plain_full,
        "save_checkpoint, model+AdamW": lambda: cl.save_checkpoint(model, opt, None, state, root / "full.pt"),
        "save_sharded_checkpoint (4), model+AdamW": sharded,
        "torch.load(weights_only=True)": lambda: torch.load(plain, weights_only=True),
        "load_verified_file": lambda: load_verified_file(ours),
    }
    for fn in variants.values():  # warm-up: files exist, page cache warm, lazy imports done
        fn()
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(runs):
        for name, fn in variants.items():
            for old in root.glob("sh-*"):
                shutil.rmtree(old)
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return times


#: variant -> (size multiple of --mb, the variant it is compared with)
ROWS = {
    "torch.save": (1, "torch.save + fsync"),
    "torch.save + fsync": (1, "torch.save + fsync"),
    "atomic_save": (1, "torch.save + fsync"),
    "torch.save + fsync, model+AdamW": (3, "torch.save + fsync, model+AdamW"),
    "save_checkpoint, model+AdamW": (3, "torch.save + fsync, model+AdamW"),
    "save_sharded_checkpoint (4), model+AdamW": (3, "save_checkpoint, model+AdamW"),
    "torch.load(weights_only=True)": (1, "torch.load(weights_only=True)"),
    "load_verified_file": (1, "torch.load(weights_only=True)"),
}


def render(times: dict[str, list[float]], mb: int, runs: int) -> str:
    med = {k: statistics.median(v) for k, v in times.items()}
    lines = [
        "# Save/load benchmark",
        "",
        f"State dict: {mb} MB of float32 (16 tensors). The model+AdamW rows save {mb} MB of weights plus",
        f"{2 * mb} MB of AdamW moments (about {3 * mb} MB). Median of {runs} interleaved runs after one",
        "warm-up round; loads read from a warm page cache.",
        "",
        f"Machine: {machine()}.",
        "",
        "| variant | median (s) | MB/s | ratio | compared with |",
        "|---|---:|---:|---:|---|",
    ]
    for name, t in med.items():
        size, base = ROWS[name]
        ratio = t / med[base]
        lines.append(f"| {name} | {t:.3f} | {size * mb / t:.0f} | {ratio:.2f}x | {base} |")
    lines += [
        "",
        "Read the ratios, not the seconds: on a shared VM the disk and the neighbours move absolute",
        "times between runs. The fair baseline for our saves is `torch.save + fsync` of the same bytes",
        "(both durable); what remains is the sha256 computed while writing, the footer, the temp file",
        "and its rename. For loads, the extra is one sha256 pass over the file before the unpickler",
        "sees it.",
        "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
