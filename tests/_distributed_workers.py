"""Multi-rank helpers for the distributed tests: a launcher, a tiny model, and the rank programs.

Ranks are processes forked from a *forkserver* that imported torch once, so a
launch costs a fork and a gloo handshake (about a second), not a fresh Python
importing torch per rank. The forkserver itself never runs a torch op, so no
thread pool exists yet when it forks. Ranks meet through a ``FileStore`` (no
ports) and report through files in the test's temporary folder.

The launcher behaves like torchrun on failure: when one rank dies, the others
get a grace period to notice and exit on their own, then are killed.
"""

from __future__ import annotations

import json
import logging
import multiprocessing as mp
import os
import signal
import time
import traceback
import uuid
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

from ckpt_lesson import CheckpointError, TrainState
from ckpt_lesson.distributed import DistributedCheckpointManager

_CTX: Any = None


def _context() -> Any:
    global _CTX
    if _CTX is None:
        from multiprocessing import forkserver

        _CTX = mp.get_context("forkserver")
        _CTX.set_forkserver_preload([__name__])
        # Python 3.11's forkserver imports the preload modules before it applies the parent's
        # sys.path, so this folder (which pytest put on sys.path) must reach it via PYTHONPATH;
        # otherwise the preload fails silently and every rank imports torch anew (~2 s each).
        saved = os.environ.get("PYTHONPATH")
        os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(Path(__file__).parent), saved) if p)
        try:
            forkserver.ensure_running()
        finally:
            if saved is None:
                del os.environ["PYTHONPATH"]
            else:
                os.environ["PYTHONPATH"] = saved
    return _CTX


def launch(
    target: str, world: int, workdir: Path, *args: Any, grace: float = 20.0, limit: float = 120.0
) -> list[int]:
    """Run ``target(rank, world, *args)`` (a function of this module) on ``world`` ranks.

    Returns:
        Exit codes by rank: 0 ok, 1 raised, negative: killed by that signal.
    """
    store = Path(workdir) / f"store-{uuid.uuid4().hex[:8]}"
    ctx = _context()
    procs = [ctx.Process(target=_entry, args=(target, r, world, str(store), args)) for r in range(world)]
    for p in procs:
        p.start()
    started, first_exit = time.monotonic(), None
    while any(p.exitcode is None for p in procs):
        now = time.monotonic()
        if first_exit is None and any(p.exitcode not in (None, 0) for p in procs):
            first_exit = now
        late = first_exit is not None and now - first_exit > grace
        if late or now - started > limit:
            for p in procs:
                if p.exitcode is None:
                    os.kill(p.pid, signal.SIGKILL)  # our own child, by pid
        time.sleep(0.02)
    for p in procs:
        p.join()
    return [p.exitcode for p in procs]


def _entry(target: str, rank: int, world: int, store: str, args: tuple[Any, ...]) -> None:
    torch.set_num_threads(1)  # 2 cores shared by up to 4 ranks; also keeps losses reproducible
    dist.init_process_group(
        "gloo", init_method=f"file://{store}", rank=rank, world_size=world, timeout=timedelta(seconds=60)
    )
    try:
        globals()[target](rank, world, *args)
    except BaseException:
        traceback.print_exc()
        os._exit(1)  # skip interpreter teardown: a peer may be dead and gloo's destructors can block
    dist.destroy_process_group()


# ---------------------------------------------------------------- the model and its data


def make_run(kind: str, world: int, rank: int) -> tuple[Any, Any, Any, torch.Generator]:
    """A tiny MLP with dropout (so RNG matters), wrapped for ``kind``, with AdamW, StepLR, and a sampler."""
    if kind not in ("fsdp", "ddp", "plain"):
        raise ValueError(f"unknown kind {kind!r}")  # a typo here once trained an unwrapped model
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Dropout(0.1), torch.nn.Linear(16, 4)
    )
    if kind == "fsdp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        fully_shard(model, mesh=init_device_mesh("cpu", (world,)))
    elif kind == "ddp":
        model = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.9)
    sampler = torch.Generator().manual_seed(1000 + rank)  # each rank draws its own batches
    torch.manual_seed(77 + rank)  # and its own dropout masks
    return model, opt, sched, sampler


_DATA = torch.Generator().manual_seed(123)
_X = torch.randn(64, 8, generator=_DATA)
_Y = _X @ torch.randn(8, 4, generator=_DATA)


def train_step(model: Any, opt: Any, sched: Any, sampler: torch.Generator) -> float:
    idx = torch.randint(0, 64, (4,), generator=sampler)
    loss = torch.nn.functional.mse_loss(model(_X[idx]), _Y[idx])
    opt.zero_grad()
    loss.backward()
    opt.step()
    sched.step()
    return loss.item()


def full_state(model: Any, opt: Any) -> dict[str, Any]:
    """Full (unsharded) model and optimizer state on rank 0, ``{}`` elsewhere; collective."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model_sd, optim_sd = get_state_dict(model, opt, options=options)
    return {"model": model_sd, "optim": optim_sd}


def write_json(path: Path, obj: Any) -> None:
    tmp = Path(f"{path}.tmp")
    tmp.write_text(json.dumps(obj))
    os.replace(tmp, path)


# ---------------------------------------------------------------- rank programs


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


def w_fault(rank: int, world: int, run_dir: str, scenario: dict[str, Any]) -> None:
    """Save step 2, then kill ranks at ``scenario["event"]`` during the save of step 4.

    ``scenario``: ``event`` (a manager event), ``at`` (the rank whose event fires),
    ``kill`` (``"self"``, ``"all"`` or a list of ranks) and ``mode`` (``"sync"``/``"async"``).
    Survivors record how their save ended.
    """
    run = Path(run_dir)
    pids = run / "pids"
    pids.mkdir(parents=True, exist_ok=True)
    (pids / str(rank)).write_text(str(os.getpid()))
    dist.barrier()
    pid_of = {r: int((pids / str(r)).read_text()) for r in range(world)}
    armed = False

    def hook(name: str, info: dict[str, Any]) -> None:
        if not armed or name != scenario["event"] or info["rank"] != scenario["at"]:
            return
        kill = scenario["kill"]
        victims = [rank] if kill == "self" else list(range(world)) if kill == "all" else list(kill)
        for r in sorted(victims, key=lambda r: r == rank):  # this process last
            os.kill(pid_of[r], signal.SIGKILL)

    model, opt, sched, sampler = make_run("fsdp", world, rank)
    mgr = DistributedCheckpointManager(run, keep_last=3, every_steps=2, on_event=hook)
    state = TrainState()
    outcome = "returned"
    for step in range(1, 5):
        state.losses.append(train_step(model, opt, sched, sampler))
        state.step = step
        if step == 4:
            armed = True
        if not mgr.should_save(step):
            continue
        try:
            if step == 4 and scenario["mode"] == "async":
                mgr.save_async(model, opt, sched, state)
                train_step(model, opt, sched, sampler)  # training goes on while the save is written
                mgr.wait()
            else:
                mgr.save(model, opt, sched, state)
        except CheckpointError as exc:
            outcome = f"{type(exc).__name__}: {exc}"
    write_json(run / f"outcome-rank{rank}.json", {"outcome": outcome})
    if outcome != "returned":
        os._exit(3)  # a peer is gone: leave without collective teardown


def w_restore_all(rank: int, world: int, runs: list[str]) -> None:
    """Open a manager on each run (cleaning what dead writers left) and restore the latest save."""
    for run_dir in runs:
        run = Path(run_dir)
        model, opt, sched, _ = make_run("fsdp", world, rank)
        before = _staging(run)  # only rank 0's view is exact: its manager is the one that cleans
        mgr = DistributedCheckpointManager(run, keep_last=3, every_steps=2)
        restored = mgr.restore_latest(model, opt, sched)
        report = {
            "step": restored.step,
            "skipped": restored.skipped,
            "staging_before": before,
            "staging_after": _staging(run),
        }
        write_json(run / f"restored-rank{rank}.json", report)
        mgr.close()


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


def _staging(run: Path) -> list[str]:
    return sorted(p.name for p in run.iterdir() if p.name.startswith(".staging"))


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
