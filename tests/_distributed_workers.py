"""Rank programs of the multi-rank tests that the package's fault campaign does not need.

The launcher, the tiny model and the fault programs live in the package
(:mod:`ckpt_lesson.faults.rank_launch`, :mod:`ckpt_lesson.faults.rank_programs`), so
``python -m ckpt_lesson chaos --ranks 2`` and these tests run the same code.
What stays here trains a run uninterrupted and resumes it on other world sizes.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import torch

from ckpt_lesson import CheckpointError, TrainState
from ckpt_lesson.distributed import DistributedCheckpointManager
from ckpt_lesson.faults.rank_launch import launch
from ckpt_lesson.faults.rank_programs import full_state, make_run, train_step, write_json

__all__ = [
    "launch",
    "make_run",
    "native_threads",
    "train_step",
    "w_close_frees_threads",
    "w_resume",
    "w_retention_after_bit_flip",
    "w_train_and_save",
]


def w_train_and_save(rank: int, world: int, out: str) -> None:
    """Train 6 steps uninterrupted, saving steps 2 (sync) and 4 (async for FSDP2); record everything."""
    for kind in ("fsdp", "ddp"):
        run = Path(out) / kind
        model, opt, sched, sampler = make_run(kind, world, rank)
        mgr = DistributedCheckpointManager(run, keep_last=3, every_steps=2)
        state, saved = TrainState(), {}
        for step in range(1, 7):
            state.losses.append(train_step(model, opt, sched, sampler))
            state.step = step
            if step in (2, 4) and mgr.should_save(step):
                ref = full_state(model, opt)
                if rank == 0:
                    torch.save(ref, run / f"ref-{step}.pt")
                data = {"sampler": sampler.get_state(), "batches": step}
                saved[step] = {
                    "sampler": sampler.get_state().tolist(),
                    "torch_rng": torch.get_rng_state().tolist(),
                }
                if kind == "fsdp" and step == 4:
                    mgr.save_async(model, opt, sched, state, data_state=data)
                else:
                    mgr.save(model, opt, sched, state, data_state=data)
        mgr.close()
        write_json(run / f"train-rank{rank}.json", {"losses": state.losses, "saved": saved})


def w_resume(rank: int, world: int, out: str, names: list[str]) -> None:
    """Restore each run on this world size; record what came back and, on 2 ranks, train on to step 6.

    A run's folder name starts with its kind (``fsdp``, ``ddp``); ``fsdp_flipped`` is an FSDP2 run.
    """
    for name in names:
        run = Path(out) / name
        model, opt, sched, sampler = make_run(name.split("_")[0], world, rank)
        torch.manual_seed(999)  # a different stream: only a real restore gives the saved one back
        mgr = DistributedCheckpointManager(run, keep_last=3, every_steps=2)
        report: dict[str, Any] = {"refusal": None}
        logs = _capture_logs()
        try:
            restored = mgr.restore_latest(model, opt, sched)
        except CheckpointError as exc:
            report["refusal"] = {"type": type(exc).__name__, "message": str(exc)}
            restored = mgr.restore_latest(model, opt, sched, on_world_size_change="reseed", reseed_base=5)
        report.update(
            step=restored.step,
            resharded=restored.resharded,
            reseed=restored.reseed,
            skipped=restored.skipped,
            counters=restored.state.to_dict(),
            warnings=[r.getMessage() for r in logs.records],
        )
        ref = torch.load(run / f"ref-{restored.step}.pt", weights_only=True) if rank == 0 else None
        mine = full_state(model, opt)
        if rank == 0:
            report["differences"] = _diff(ref, mine)
            report["tensors_compared"] = _count_tensors(mine)
        if not restored.resharded:
            report["sampler"] = restored.data_state["sampler"].tolist()
            report["torch_rng"] = torch.get_rng_state().tolist()
            sampler.set_state(restored.data_state["sampler"])
            state = restored.state
            while state.step < 6:
                state.losses.append(train_step(model, opt, sched, sampler))
                state.step += 1
            report["losses"] = state.losses
        mgr.close()
        write_json(run / f"resume-w{world}-rank{rank}.json", report)


class _ListHandler(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def _capture_logs() -> _ListHandler:
    handler = _ListHandler()
    logging.getLogger("ckpt_lesson.distributed").addHandler(handler)
    return handler


def _count_tensors(obj: Any) -> int:
    if isinstance(obj, dict):
        return sum(_count_tensors(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_count_tensors(v) for v in obj)
    return int(isinstance(obj, torch.Tensor))


def _diff(ref: Any, mine: Any, path: str = "") -> list[str]:
    """Every place where two nested states differ (empty: bitwise equal)."""
    if isinstance(ref, dict) and isinstance(mine, dict):
        if set(ref) != set(mine):
            return [f"{path}: keys {sorted(set(ref) ^ set(mine))[:4]}"]
        return [d for k in ref for d in _diff(ref[k], mine[k], f"{path}.{k}")]
    if isinstance(ref, (list, tuple)) and isinstance(mine, (list, tuple)) and len(ref) == len(mine):
        return [
            d for i, (a, b) in enumerate(zip(ref, mine, strict=True)) for d in _diff(a, b, f"{path}[{i}]")
        ]
    if isinstance(ref, torch.Tensor) and isinstance(mine, torch.Tensor):
        same = ref.dtype == mine.dtype and ref.shape == mine.shape and torch.equal(ref, mine)
        return [] if same else [path]
    return [] if ref == mine else [f"{path}: {ref!r} != {mine!r}"]


def native_threads() -> list[str]:
    """Names of this process's native threads (gloo names its own: pt_gloo_runloop, gloo_tcp_loop)."""
    tasks = Path("/proc/self/task")
    return sorted((tasks / t / "comm").read_text().strip() for t in os.listdir(tasks))


def w_close_frees_threads(rank: int, world: int, out: str) -> None:
    """Count native threads before a manager exists, while it is open, and after close()."""
    model, opt, sched, sampler = make_run("fsdp", world, rank)
    before = native_threads()
    mgr = DistributedCheckpointManager(Path(out) / "run", keep_last=2, every_steps=1)
    opened = native_threads()
    state = TrainState()
    for step in (1, 2):
        state.losses.append(train_step(model, opt, sched, sampler))
        state.step = step
        if step == 1:
            mgr.save(model, opt, sched, state)
        else:
            mgr.save_async(model, opt, sched, state)  # DCP's executor thread, then close() waits
    mgr.close()
    after = native_threads()
    write_json(Path(out) / f"threads-rank{rank}.json", {"before": before, "opened": opened, "after": after})


def w_retention_after_bit_flip(rank: int, world: int, out: str) -> None:
    """keep_last=2: save steps 2 and 4, flip one byte of step 4 (same size), save 6; rank 0 lists the run."""
    import torch.distributed as dist

    model, opt, sched, sampler = make_run("fsdp", world, rank)
    run = Path(out) / "run"
    mgr = DistributedCheckpointManager(run, keep_last=2, every_steps=2)
    state = TrainState()
    for step in range(1, 7):
        state.losses.append(train_step(model, opt, sched, sampler))
        state.step = step
        if step == 6 and rank == 0:  # bit rot in the save that step 6's retention would lean on
            part = sorted((run / "step-00000004").glob("__*.distcp"))[-1]
            data = bytearray(part.read_bytes())
            data[len(data) // 2] ^= 0xFF
            part.write_bytes(bytes(data))
        if step == 6:
            dist.barrier()
        if step % 2 == 0:
            mgr.save(model, opt, sched, state)
    mgr.close()
    if rank == 0:
        write_json(Path(out) / "listing.json", sorted(p.name for p in run.iterdir()))
