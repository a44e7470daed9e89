"""Rank programs for the distributed state-API tests (run by ``launch`` on 2 gloo ranks)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ckpt_lesson.distributed import DistributedCheckpointManager
from ckpt_lesson.faults.rank_programs import make_run, train_step


def w_state_api_train(rank: int, world: int, out: str, kind: str) -> None:
    """Train 6 steps, saving step 3 through the state API; record the losses of steps 4-6."""
    model, opt, sched, sampler = make_run(kind, world, rank)
    mgr = DistributedCheckpointManager(Path(out) / kind, keep_last=2, every_steps=3)
    hidden = torch.full((2,), float(rank))
    losses = []
    for step in range(1, 7):
        losses.append(train_step(model, opt, sched, sampler))
        hidden = hidden + 1
        if step == 3:
            state = {
                "model": model,
                "optimizer": opt,
                "sched": sched,
                "sampler": sampler.get_state(),
                "h": hidden,
            }
            mgr.save(step, state)
    mgr.close()
    (Path(out) / kind / f"train-{rank}.json").write_text(json.dumps(losses[3:]))


def w_state_api_resume(rank: int, world: int, out: str, kind: str) -> None:
    """Restore through the state API in fresh processes and train steps 4-6."""
    model, opt, sched, sampler = make_run(kind, world, rank)
    torch.manual_seed(999)  # a resume must not depend on how this process seeded itself
    mgr = DistributedCheckpointManager(Path(out) / kind, keep_last=2, every_steps=3)
    restored = mgr.restore_latest(
        {"model": model, "optimizer": opt, "sched": sched, "sampler": None, "h": None}
    )
    sampler.set_state(restored.values["sampler"])
    losses = [train_step(model, opt, sched, sampler) for _ in range(restored.step + 1, 7)]
    mgr.close()
    result = {"step": restored.step, "losses": losses, "h": restored.values["h"].tolist()}
    (Path(out) / kind / f"resume-{rank}.json").write_text(json.dumps(result))


def _equal(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    return all(
        torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values(), strict=True)
    )


def w_wrapped_round_trips(rank: int, world: int, out: str) -> None:
    """DDP- and compile-wrapped saves restore into plain models and the reverse, in every saver."""
    import ckpt_lesson as cl

    def fresh(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(seed)
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
        return model, torch.optim.AdamW(model.parameters(), lr=1e-2)

    wraps = {
        "ddp": torch.nn.parallel.DistributedDataParallel,
        "compiled": lambda m: torch.compile(m, backend="eager"),
        "ddp+compiled": lambda m: torch.compile(
            torch.nn.parallel.DistributedDataParallel(m), backend="eager"
        ),
    }
    results = {}
    for name, wrap in wraps.items():
        for direction in ("wrapped->plain", "plain->wrapped"):
            src, src_opt = fresh(1)
            dst, dst_opt = fresh(2)
            saved_as = wrap(src) if direction == "wrapped->plain" else src
            loaded_as = dst if direction == "wrapped->plain" else wrap(dst)
            base = Path(out) / f"{name}-{direction.replace('>', '')}"
            ok = {}
            state = {"model": saved_as, "optimizer": src_opt}
            cl.CheckpointManager(base / "single", every_steps=1).save(1, state)
            cl.CheckpointManager(base / "single", every_steps=1).restore_latest(
                {"model": loaded_as, "optimizer": dst_opt}
            )
            ok["CheckpointManager"] = _equal(src, dst)
            dst, dst_opt = fresh(2)
            loaded_as = dst if direction == "wrapped->plain" else wrap(dst)
            cl.save_state(base / "pair.pt", 1, state)
            cl.load_state(base / "pair.pt", {"model": loaded_as, "optimizer": dst_opt})
            ok["save_state/load_state"] = _equal(src, dst)
            dst, dst_opt = fresh(2)
            loaded_as = dst if direction == "wrapped->plain" else wrap(dst)
            mgr = DistributedCheckpointManager(base / "dcp", every_steps=1)
            mgr.save(1, state)
            mgr.restore_latest({"model": loaded_as, "optimizer": dst_opt})
            mgr.close()
            ok["DistributedCheckpointManager"] = _equal(src, dst)
            results[f"{name} {direction}"] = ok
    if rank == 0:
        (Path(out) / "wrapped.json").write_text(json.dumps(results))
