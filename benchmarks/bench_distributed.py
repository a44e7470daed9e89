"""What do hashing, verification and the commit protocol cost on top of DCP? Two ranks, save and load.

Run from the repository root::

    python benchmarks/bench_distributed.py                # 32 MB of weights (+ AdamW), 7 rounds
    python benchmarks/bench_distributed.py --mb 64 --runs 7 --dir /some/disk

It re-launches itself under ``torchrun --nproc_per_node=2`` (gloo, CPU), builds an
FSDP2-sharded model with AdamW moments on each rank, and times, interleaved round
robin after one warm-up round:

* ``dcp.save``   ``get_state_dict`` then ``dcp.save`` (FileSystemWriter defaults) into a new folder
* ours, save     ``DistributedCheckpointManager.save``: the same DCP save through our writer (every
                 byte hashed while written), per-rank RNG and counters, the manifest, fsyncs,
                 publish by rename
* ``dcp.load``   ``get_state_dict``, ``dcp.load`` in place, ``set_state_dict``; no content check
* ours, load     ``restore_latest``: every file verified against the manifest first (the ranks
                 share the hashing), ``.metadata`` through the restricted unpickler, then the same
                 load and apply, plus each rank's RNG

A round's time is the slowest rank's (a save is done when every rank is done). Writes
``benchmarks/results_distributed.md`` with medians, ratios and the load average before and
after: on a shared machine that number says how far to trust the seconds. Not a test; CI does
not run it.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


def launch(argv: list[str]) -> int:
    """Start this script on 2 ranks under torchrun; returns its exit status."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MALLOC_MMAP_THRESHOLD_": "131072"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    return subprocess.run([*cmd, __file__, "--worker", *argv], env=env).returncode


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from ckpt_lesson import TrainState
    from ckpt_lesson.distributed import DistributedCheckpointManager

    warnings.filterwarnings("ignore", category=FutureWarning)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    side = int((args.mb * 2**20 / 4 / 4) ** 0.5)  # four square layers of float32
    model = torch.nn.Sequential(*(torch.nn.Linear(side, side, bias=False) for _ in range(4)))
    fully_shard(model, mesh=init_device_mesh("cpu", (world,)))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, side)).sum().backward()
    opt.step()  # moments exist: the optimizer state is twice the weights
    base = Path(args.dir)
    # Retention would delete the previous save inside the timed region; dcp.save has no such step.
    mgr = DistributedCheckpointManager(base / "ours", keep_last=args.runs + 2, every_steps=1)

    def plain_save(i: int) -> None:
        msd, osd = get_state_dict(model, opt)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=base / f"plain-{i}")

    def plain_load(i: int) -> None:
        msd, osd = get_state_dict(model, opt)
        dcp.load({"model": msd, "optim": osd}, checkpoint_id=base / f"plain-{i}")
        set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd)

    def ours_save(i: int) -> None:
        mgr.save(model, opt, None, TrainState(step=i + 1))

    def ours_load(i: int) -> None:
        restored = mgr.restore_latest(model, opt, None)
        if restored is None or restored.step != i + 1:
            raise RuntimeError(f"restored {restored and restored.step}, expected step {i + 1}")

    variants = {
        "dcp.save": plain_save,
        "ours, save": ours_save,
        "dcp.load": plain_load,
        "ours, load": ours_load,
    }
    times: dict[str, list[float]] = {name: [] for name in variants}
    load_before = os.getloadavg()
    for i in range(args.runs + 1):  # round 0 warms up and is dropped
        for name, run in variants.items():
            dist.barrier()
            start = time.perf_counter()
            run(i)
            took = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
            dist.all_reduce(took, op=dist.ReduceOp.MAX)  # done when the slowest rank is done
            if i:
                times[name].append(took.item())
        if rank == 0:
            shutil.rmtree(base / f"plain-{i - 1}", ignore_errors=True)
        dist.barrier()
    load_after = os.getloadavg()
    mgr.close()
    state_mb = sum(p.numel() * 4 for p in model.parameters()) * 3 / 2**20  # sharded total, x3 with AdamW
    if rank == 0:
        write_results(args, times, state_mb, world, load_before, load_after, torch.__version__)
    dist.destroy_process_group()


def write_results(
    args: argparse.Namespace,
    times: dict[str, list[float]],
    state_mb: float,
    world: int,
    load_before: tuple[float, float, float],
    load_after: tuple[float, float, float],
    torch_version: str,
) -> None:
    med = {name: statistics.median(t) for name, t in times.items()}
    cpus = os.cpu_count() or 1
    if max(load_before[0], load_after[0]) > cpus / 2:
        busy = (
            "**Measured under load**: other jobs shared these CPUs, so the seconds are pessimistic and "
            "the ratios are the numbers to read."
        )
    else:
        busy = "A fairly quiet machine; still, read the ratios rather than the seconds."
    rows = [
        ("dcp.save", "dcp.save", "files fsynced, dir not; no hashes, no commit record"),
        (
            "ours, save",
            "dcp.save",
            "bytes hashed while written; manifest last; fsync; publish by rename",
        ),
        ("dcp.load", "dcp.load", "not verified; `.metadata` and non-tensor values fully unpickled"),
        ("ours, load", "dcp.load", "every file verified first; restricted `.metadata`; weights-only values"),
    ]
    lines = [
        "# Distributed save/load benchmark (2 ranks)",
        "",
        f"State: an FSDP2-sharded model of {args.mb} MB of float32 weights plus its AdamW moments "
        f"(about {state_mb:.0f} MB in all, split over {world} ranks), gloo on CPU, one thread per rank. "
        f"Median of {args.runs} interleaved rounds after one warm-up round; the time of a round is the "
        "slowest rank's. Loads read from a warm page cache.",
        "",
        f"Machine: {os.cpu_count()} CPUs; torch {torch_version}; Python {platform.python_version()}; "
        f"load average {load_before[0]:.1f} before, {load_after[0]:.1f} after. " + busy,
        "",
        "| variant | median (s) | min (s) | max (s) | ratio | compared with | guarantees (from code) |",
        "|---|---:|---:|---:|---:|---|---|",
    ]
    for name, base, note in rows:
        t = times[name]
        ratio = med[name] / med[base]
        lines.append(
            f"| {name} | {med[name]:.3f} | {min(t):.3f} | {max(t):.3f} | {ratio:.2f}x | {base} | {note} |"
        )
    lines += [
        "",
        "Our save also writes each rank's RNG state and counters (a few kB) and agrees the step",
        "across ranks; our load also restores them. Retention keeps every save here (no deletion",
        "is timed). The hash is xxh3-128.",
        "",
    ]
    text = "\n".join(lines)
    (HERE / "results_distributed.md").write_text(text, encoding="utf-8")
    print(text)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=int, default=32, help="MB of float32 weights (AdamW adds twice that)")
    parser.add_argument("--runs", type=int, default=7, help="timed rounds (after one warm-up round)")
    parser.add_argument("--dir", default=None, help="folder for the saves (default: a temp folder)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return 0
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        argv = ["--mb", str(args.mb), "--runs", str(args.runs), "--dir", tmp]
        return launch(argv)


if __name__ == "__main__":
    raise SystemExit(main())
