"""Rank programs of the object-store tests of DistributedCheckpointManager (launched with 2 gloo ranks).

Each rank reaches the moto server itself, with the options the test hands it
(a rank's environment is the forkserver's, fixed before the test's server started).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch
from _distributed_workers import _count_tensors, _diff, make_run, train_step

from ckpt_lesson import CheckpointError, TrainState
from ckpt_lesson.distributed import DistributedCheckpointManager
from ckpt_lesson.faults.rank_programs import full_state, write_json

KIND = "fsdp"


def w_save_and_restore(rank: int, world: int, url: str, options: dict[str, Any], out: str) -> None:
    """Save steps 2, 4 (async) positionally and 6 with the state API; restore 4 and 6 into fresh objects."""
    events: list[str] = []
    model, opt, sched, sampler = make_run(KIND, world, rank)
    mgr = DistributedCheckpointManager(
        url, storage_options=options, keep_last=3, every_steps=2, on_event=lambda n, i: events.append(n)
    )
    state, refs = TrainState(), {}
    for step in range(1, 5):
        state.losses.append(train_step(model, opt, sched, sampler))
        state.step = step
        if mgr.should_save(step):
            refs[step] = full_state(model, opt)
            data = {"sampler": sampler.get_state(), "batches": step}
            if step == 4:
                mgr.save_async(model, opt, sched, state, data_state=data)
            else:
                first = mgr.save(model, opt, sched, state, data_state=data)
    mgr.close()
    report: dict[str, Any] = {"first": first, "events": sorted(set(events))}

    fresh, fresh_opt, fresh_sched, _ = make_run(KIND, world, rank)
    torch.manual_seed(999)
    mgr = DistributedCheckpointManager(url, storage_options=options, keep_last=3, every_steps=2)
    restored = mgr.restore_latest(fresh, fresh_opt, fresh_sched)
    mine = full_state(fresh, fresh_opt)
    report.update(step=restored.step, path=restored.path, batches=restored.data_state["batches"])
    report["differences"] = _diff(refs[4], mine) if rank == 0 else []
    report["tensors"] = _count_tensors(mine)

    # The state API on the same run: save step 6, restore it into fresh objects.
    parts = {"model": fresh, "optimizer": fresh_opt, "scheduler": fresh_sched, "note": {"rank": rank}}
    train_step(fresh, fresh_opt, fresh_sched, sampler)
    ref6 = full_state(fresh, fresh_opt)
    report["saved6"] = mgr.save(6, parts)
    mgr.close()
    again, again_opt, again_sched, _ = make_run(KIND, world, rank)
    mgr = DistributedCheckpointManager(url, storage_options=options, keep_last=3, every_steps=2)
    back = mgr.restore_latest(
        {"model": again, "optimizer": again_opt, "scheduler": again_sched, "note": None}
    )
    mine6 = full_state(again, again_opt)  # collective: every rank calls it
    report["state_api"] = {
        "step": back.step,
        "note": back.values["note"],
        "differences": _diff(ref6, mine6) if rank == 0 else [],
        "scheduler": again_sched.state_dict() == fresh_sched.state_dict(),
    }
    mgr.close()
    write_json(Path(out) / f"round-rank{rank}.json", report)


def w_restore(rank: int, world: int, url: str, options: dict[str, Any], out: str, name: str) -> None:
    """Restore the run into fresh objects; record the step and what was skipped."""
    model, opt, sched, _ = make_run(KIND, world, rank)
    mgr = DistributedCheckpointManager(url, storage_options=options, keep_last=3, every_steps=2)
    report: dict[str, Any] = {"error": None}
    try:
        restored = mgr.restore_latest(model, opt, sched)
        report.update(step=restored.step, skipped=restored.skipped)
    except CheckpointError as exc:
        report["error"] = {"type": type(exc).__name__, "message": str(exc)}
    report["committed"] = mgr.saves.published()
    mgr.close()
    write_json(Path(out) / f"{name}-rank{rank}.json", report)


def w_zombie(rank: int, world: int, url: str, options: dict[str, Any], out: str) -> None:
    """Save step 8, pausing rank 0 between manifest and marker until the test says go (a stalled zombie)."""

    def pause(name: str, info: dict[str, Any]) -> None:
        if name == "manifest_written" and info["rank"] == 0:
            (Path(out) / "paused").touch()
            deadline = time.monotonic() + 90
            while not (Path(out) / "go").exists() and time.monotonic() < deadline:
                time.sleep(0.05)

    model, opt, sched, sampler = make_run(KIND, world, rank)
    train_step(model, opt, sched, sampler)
    mgr = DistributedCheckpointManager(
        url, storage_options=options, keep_last=5, every_steps=2, on_event=pause
    )
    report: dict[str, Any] = {"error": None}
    try:
        report["saved"] = mgr.save(8, {"model": model, "optimizer": opt})
    except CheckpointError as exc:
        report["error"] = {"type": type(exc).__name__, "message": str(exc)}
    mgr.close()
    write_json(Path(out) / f"zombie-rank{rank}.json", report)


def w_open(rank: int, world: int, url: str, options: dict[str, Any], out: str) -> None:
    """Open a manager on ``url``; record the error each rank gets."""
    report: dict[str, Any] = {"error": None}
    try:
        DistributedCheckpointManager(url, storage_options=options, every_steps=2).close()
    except CheckpointError as exc:
        report["error"] = {"type": type(exc).__name__, "message": str(exc)}
    write_json(Path(out) / f"open-rank{rank}.json", report)


def w_save_then_resume(rank: int, world: int, url: str, options: dict[str, Any], out: str) -> None:
    """Save steps 2 and 4; then, as a restarted job would, restore and train a step (scan, report)."""
    model, opt, sched, sampler = make_run(KIND, world, rank)
    with DistributedCheckpointManager(url, storage_options=options, keep_last=3, every_steps=2) as mgr:
        state = TrainState()
        for step in range(1, 5):
            state.losses.append(train_step(model, opt, sched, sampler))
            state.step = step
            if mgr.should_save(step):
                mgr.save(model, opt, sched, state, data_state={"sampler": sampler.get_state()})
    fresh, fresh_opt, fresh_sched, fresh_sampler = make_run(KIND, world, rank)
    with DistributedCheckpointManager(url, storage_options=options, keep_last=3, every_steps=2) as mgr:
        restored = mgr.restore_latest(fresh, fresh_opt, fresh_sched)
        fresh_sampler.set_state(restored.data_state["sampler"])
        train_step(fresh, fresh_opt, fresh_sched, fresh_sampler)
        saved = mgr.should_save(restored.step + 1)  # the end of the first step after the restore
    write_json(Path(out) / f"resume-rank{rank}.json", {"step": restored.step, "saved": saved})
