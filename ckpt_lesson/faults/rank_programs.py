"""What each rank runs in the multi-rank fault campaign: a tiny FSDP2 run, killed during a save.

Every run is the same: train, save step 2, then save step 4 and SIGKILL ranks
at a chosen event of :class:`~ckpt_lesson.distributed.DistributedCheckpointManager`
(the events fire inside DCP's writing and ``finish``, so also in an
asynchronous save's background thread). A later launch restores every run,
trains on to step 6 and records what it restored and each loss, beside an
uninterrupted run of the same length. The tests reuse the model
(:func:`make_run`, :func:`train_step`) and the helpers here.

With ``chaos --store URL --ranks N`` the saves go to a bucket instead
(``store``: one prefix per killed run); the reports stay in the local run
folder. Credentials and endpoint come from the ranks' environment (``AWS_*``).
"""

from __future__ import annotations

import functools
import json
import os
import signal
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

from ckpt_lesson.distributed import DistributedCheckpointManager
from ckpt_lesson.errors import CheckpointError
from ckpt_lesson.files.checkpoint import TrainState
from ckpt_lesson.files.storage import is_store_url
from ckpt_lesson.runs.commit import COMMIT_MARKER, MARKER_LOCK
from ckpt_lesson.runs.scan import scan_checkpoints

__all__ = [
    "SAVE_STEPS",
    "STORE_LEASE_SECONDS",
    "TOTAL_STEPS",
    "full_state",
    "make_run",
    "train_step",
    "w_check",
    "w_fault",
    "write_json",
]

#: Steps every run saves; the save of the last one is the one interrupted.
SAVE_STEPS = (2, 4)
#: Steps a restored run trains to, so its losses can be compared with the uninterrupted run's.
TOTAL_STEPS = 6
#: The lease of a killed run's save in a bucket: its save takes well under a second, and nothing
#: else cleans the run while it lives, so the restoring launch may remove its upload soon after.
STORE_LEASE_SECONDS = 1.0


def _manager(where: str | Path, **kwargs: Any) -> DistributedCheckpointManager:
    """The campaign's manager on a run folder, or on a run's bucket prefix (with the short lease)."""
    if is_store_url(where):
        kwargs["lease_seconds"] = STORE_LEASE_SECONDS
    return DistributedCheckpointManager(where, keep_last=3, every_steps=SAVE_STEPS[0], **kwargs)


def make_run(kind: str, world: int, rank: int) -> tuple[Any, Any, Any, torch.Generator]:
    """A tiny MLP with dropout (so RNG matters), wrapped for ``kind``, with AdamW, StepLR, and a sampler.

    Args:
        kind: ``"fsdp"`` (FSDP2 over a CPU mesh), ``"ddp"`` or ``"plain"``.
        world: Ranks in the run (the FSDP2 mesh size).
        rank: This rank (seeds its sampler and dropout).

    Returns:
        ``(model, optimizer, scheduler, sampler)``.

    Raises:
        ValueError: An unknown ``kind``.

    Example:
        >>> model, opt, sched, sampler = make_run("plain", 1, 0)
    """
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


@functools.cache
def _data() -> tuple[torch.Tensor, torch.Tensor]:
    # Made on first use, not at import: the forkserver imports this module and must run no torch op.
    gen = torch.Generator().manual_seed(123)
    x = torch.randn(64, 8, generator=gen)
    return x, x @ torch.randn(8, 4, generator=gen)


def train_step(model: Any, opt: Any, sched: Any, sampler: torch.Generator) -> float:
    """One optimizer step on a batch of 4 drawn with ``sampler``; returns the loss."""
    x, y = _data()
    idx = torch.randint(0, 64, (4,), generator=sampler)
    loss = torch.nn.functional.mse_loss(model(x[idx]), y[idx])
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


def write_json(path: str | os.PathLike[str], obj: Any) -> None:
    """Write ``obj`` as JSON by rename, so a reader never sees half a report."""
    tmp = Path(f"{path}.tmp")
    tmp.write_text(json.dumps(obj))
    os.replace(tmp, path)


def w_fault(
    rank: int, world: int, run_dir: str, kill: dict[str, Any] | None, store: str | None = None
) -> None:
    """Save every step of :data:`SAVE_STEPS`; during the last save, SIGKILL ranks.

    ``kill``: ``event`` (a manager event), ``at`` (the rank whose event fires),
    ``victims`` (ranks to kill, this one last), ``mode`` (``"sync"``/``"async"``) and
    ``publish`` (the manager's ``"rename"``/``"marker"``);
    ``None`` saves without killing. Survivors record how their save ended in
    ``outcome-rank{rank}.json``. ``store``: save to this bucket prefix, not to ``run_dir``.
    """
    run = Path(run_dir)
    pids = run / "pids"
    pids.mkdir(parents=True, exist_ok=True)
    (pids / str(rank)).write_text(str(os.getpid()))
    dist.barrier()
    pid_of = {r: int((pids / str(r)).read_text()) for r in range(world)}
    armed = False

    def hook(name: str, info: dict[str, Any]) -> None:
        if kill is None or not armed or name != kill["event"] or info["rank"] != kill["at"]:
            return
        for r in sorted(kill["victims"], key=lambda r: r == rank):  # this process last
            os.kill(pid_of[r], signal.SIGKILL)

    model, opt, sched, sampler = make_run("fsdp", world, rank)
    publish = kill["publish"] if kill is not None else "marker" if store else "rename"
    mgr = _manager(store or run, on_event=hook, publish=publish)
    state = TrainState()
    outcome = "returned"
    for step in range(1, SAVE_STEPS[-1] + 1):
        state.losses.append(train_step(model, opt, sched, sampler))
        state.step = step
        armed = step == SAVE_STEPS[-1]
        if step not in SAVE_STEPS:
            continue
        data = {"sampler": sampler.get_state()}
        try:
            if armed and kill is not None and kill["mode"] == "async":
                mgr.save_async(model, opt, sched, state, data_state=data)
                train_step(model, opt, sched, sampler)  # training goes on while the save is written
                mgr.wait()
            else:
                mgr.save(model, opt, sched, state, data_state=data)
        except CheckpointError as exc:
            outcome = f"{type(exc).__name__}: {exc}"
    write_json(run / f"outcome-rank{rank}.json", {"outcome": outcome})
    if outcome != "returned":
        os._exit(3)  # a peer is gone: leave without collective teardown
    mgr.close()


def w_check(
    rank: int, world: int, baseline_dir: str, runs: list[str], stores: list[str] | None = None
) -> None:
    """Train the uninterrupted run, then restore each killed run and train it on; record both.

    The uninterrupted run saves like the killed ones (so both do the same work)
    and writes ``losses-rank{rank}.json``. For each run, opening a manager
    removes what dead writers left; the report ``restored-rank{rank}.json``
    holds the restored step, the skipped saves, the staging folders before and
    after, and the losses up to :data:`TOTAL_STEPS`. ``stores``: each run's
    bucket prefix, when the runs saved to a bucket (their uploads no marker
    names count as staging).
    """
    model, opt, sched, sampler = make_run("fsdp", world, rank)
    mgr = DistributedCheckpointManager(Path(baseline_dir), keep_last=3, every_steps=SAVE_STEPS[0])
    state = TrainState()
    for step in range(1, TOTAL_STEPS + 1):
        state.losses.append(train_step(model, opt, sched, sampler))
        state.step = step
        if step in SAVE_STEPS:
            mgr.save(model, opt, sched, state, data_state={"sampler": sampler.get_state()})
    mgr.close()
    write_json(Path(baseline_dir) / f"losses-rank{rank}.json", state.losses)
    for i, run_dir in enumerate(runs):
        run = Path(run_dir)
        where = run if stores is None else stores[i]
        model, opt, sched, sampler = make_run("fsdp", world, rank)
        torch.manual_seed(999)  # a different stream: only a real restore gives the saved one back
        before = _staging(where)  # only rank 0's view is exact: its manager is the one that cleans
        mgr = _manager(where)
        report: dict[str, Any] = {"step": None, "skipped": [], "losses": [], "error": None}
        try:
            restored = mgr.restore_latest(model, opt, sched)
        except CheckpointError as exc:  # every rank gets the same verdict: the ranks stay in step
            restored, report["error"] = None, f"{type(exc).__name__}: {exc}"
        if restored is not None:
            sampler.set_state(restored.data_state["sampler"])
            state = restored.state
            while state.step < TOTAL_STEPS:
                state.losses.append(train_step(model, opt, sched, sampler))
                state.step += 1
            report.update(step=restored.step, skipped=restored.skipped, losses=state.losses)
        if stores is not None:  # a restore writes nothing to a bucket: cleaning is a writer's job
            mgr.clean_uploads()  # type: ignore[attr-defined]  (rank 0; what the next save does first)
        report.update(staging_before=before, staging_after=_staging(where))
        mgr.close()
        write_json(run / f"restored-rank{rank}.json", report)


def _staging(run: Path | str) -> list[str]:
    """Unpublished folders: staging folders, marker-mode folders without their marker, uploads no
    ``COMMIT`` names in a bucket (``scan``'s rows for them)."""
    if isinstance(run, str):
        return [r.path.name for r in scan_checkpoints(run) if r.path.name.startswith(".uncommitted-")]
    unmarked = [
        p for p in run.glob("step-*") if (p / MARKER_LOCK).exists() and not (p / COMMIT_MARKER).exists()
    ]
    return sorted(
        [p.name for p in run.iterdir() if p.name.startswith(".staging")] + [p.name for p in unmarked]
    )
