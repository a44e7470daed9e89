"""What the state API costs against the positional form: managed saves and restores, paired.

Run from the repository root::

    python benchmarks/bench_state_api.py               # about 128 MB of weights + AdamW moments
    python benchmarks/bench_state_api.py --mb 512 --rounds 7

Both forms write through the same ``CheckpointManager`` (``keep_last=2``,
default options) into fresh run folders. Each round times one positional save
(``mgr.save(model, opt, sched, TrainState)``) and one state-API save
(``mgr.save(step, {...})``) of the same objects, in alternating order, then one
restore of each into fresh objects. The table gives medians and the ratio
state API / positional; the machine and the load average before and after are
printed with it, since other work on the machine moves these figures.
Also times ``model_state`` of a ``torch.compile``'d model (torch's
``get_model_state_dict``) against a plain ``state_dict()``.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch

import ckpt_lesson as cl
from ckpt_lesson.files.train_state import load_model_state, model_state


def build(mb: int) -> tuple[torch.nn.Module, torch.optim.Optimizer, object]:
    # Weights are a third of the bytes once AdamW has its two moments.
    width = int((mb * 2**20 / 3 / 4 / 8) ** 0.5)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=False) for _ in range(8)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, width)).sum().backward()
    opt.step()
    return model, opt, torch.optim.lr_scheduler.StepLR(opt, 10)


def save(mgr: cl.CheckpointManager, form: str, step: int, model, opt, sched) -> None:
    if form == "pos":
        mgr.save(model, opt, sched, cl.TrainState(step=step))
    else:
        mgr.save(step, {"model": model, "optimizer": opt, "sched": sched})


def restore(mgr: cl.CheckpointManager, form: str, model, opt, sched) -> None:
    if form == "pos":
        mgr.restore_latest(model, opt, sched)
    else:
        mgr.restore_latest({"model": model, "optimizer": opt, "sched": sched})


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mb", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    load_before = os.getloadavg()
    model, opt, sched = build(args.mb)
    times: dict[str, list[float]] = {k: [] for k in ("save_pos", "save_api", "restore_pos", "restore_api")}
    with tempfile.TemporaryDirectory(dir=".") as tmp:
        for r in range(args.rounds):
            runs = {k: Path(tmp) / f"{k}-{r}" for k in ("pos", "api")}
            mgrs = {k: cl.CheckpointManager(p, keep_last=2, every_steps=1) for k, p in runs.items()}
            order = ("pos", "api") if r % 2 == 0 else ("api", "pos")
            for k in order:
                for step in (1, 2, 3):  # three saves: retention deletes on the third
                    times[f"save_{k}"].append(
                        timed(lambda mgr=mgrs[k], k=k, s=step: save(mgr, k, s, model, opt, sched))
                    )
            for k in order:
                m2, o2, s2 = build(args.mb)
                times[f"restore_{k}"].append(
                    timed(lambda mgr=mgrs[k], k=k, m=(m2, o2, s2): restore(mgr, k, *m))
                )
    compiled = torch.compile(model, backend="eager")
    # The first call of torch's helpers imports torch.distributed.checkpoint (0.4-0.8 s here, once per
    # process); warmed up here, so the rows below are the steady cost.
    load_model_state(compiled, model_state(compiled))
    plain_sd = statistics.median(timed(model.state_dict) for _ in range(20))
    wrapped_sd = statistics.median(timed(lambda: model_state(compiled)) for _ in range(20))
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    plain_load = statistics.median(timed(lambda: model.load_state_dict(sd)) for _ in range(5))
    wrapped_load = statistics.median(timed(lambda: load_model_state(compiled, sd)) for _ in range(5))
    med = {k: statistics.median(v) for k, v in times.items()}
    print(
        f"machine: {platform.node()} {platform.machine()}, {os.cpu_count()} cores; torch {torch.__version__}"
    )
    print(f"load average before {load_before[0]:.2f}, after {os.getloadavg()[0]:.2f}; state {args.mb} MB")
    print()
    print("| operation | positional (s) | state API (s) | ratio |")
    print("|---|---|---|---|")
    for op in ("save", "restore"):
        pos, api = med[op + "_pos"], med[op + "_api"]
        print(f"| managed {op} | {pos:.3f} | {api:.3f} | {api / pos:.2f}x |")
    print()
    print("| operation | plain model | compiled model (torch's helper) | ratio |")
    print("|---|---|---|---|")
    print(f"| model state dict | {plain_sd * 1e3:.2f} ms | {wrapped_sd * 1e3:.2f} ms | - |")
    print(f"| model load | {plain_load:.3f} s | {wrapped_load:.3f} s | {wrapped_load / plain_load:.2f}x |")


if __name__ == "__main__":
    main()
