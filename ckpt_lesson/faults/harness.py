"""Fault injection: kill real training processes at the worst moments and check the restore.

A resume path is only trustworthy if it has been *crashed into*, many times, at
the points where a crash hurts: half-way through a file, after some shards but
not all, after the parts but before the commit, during retention. This
harness runs managed training (:class:`~ckpt_lesson.runs.manager.CheckpointManager`
plus the teaching harness) in child processes, SIGKILLs each one at a planned
point, then lets a new process restore and go on. For every kill it checks
three things, all exactly:

a. **the choice**: before the kill the harness *predicts* which save must be
   restored (the interrupted save if it was already published, else the newest
   one before it) and compares with the manager's ``last_restore``;
b. **the trajectory**: every step any process executed, before or after a
   kill, has the loss and sample ids of the uninterrupted run (``==``), and the
   finished run's loss history equals it;
c. **no corrupt load**: the restored weights hash to the uninterrupted run's
   weights at that step, and the restored loss history is its prefix.

Children are *forked* from the harness process, which has already imported
torch and run one warm-up step: a child starts in milliseconds instead of the
seconds a fresh interpreter needs, so hundreds of kills fit in minutes. Each
child seeds everything and rebuilds every object from the run directory, so
nothing but the files on disk carries over (torch uses one thread here, so the
fork inherits no worker pool). The preemption test and the 300-step
acceptance test use real fresh interpreters as well.

Kill points (``POINTS``): ``save_end``, ``published`` and ``retention_delete``
(the interrupted save is complete: it must be chosen); ``mid_part`` (after N
bytes of a part), ``after_shards`` (after k of the shard files),
``parts_complete``, ``manifest_written`` (the save is lost: the previous one
must be chosen); ``between_saves`` (killed after a step with no save);
``bitrot`` (killed after a save, then one byte of that save is flipped on disk,
so the restorer must detect it and fall back); ``manifest_rot`` (the same, but
the flipped byte is in the save's ``manifest.json``: the commit record's own
checksum must call it damage, not a contract refusal). Which kills to make, many runs
of them drawn from a seed, and the table that sums them up are
:mod:`ckpt_lesson.faults.campaign`.
"""

from __future__ import annotations

import hashlib
import logging
import multiprocessing
import os
import signal
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ckpt_lesson.faults.kill_plan import POINTS, KillPlan, RunConfig, predict_restored_step
from ckpt_lesson.files.checkpoint import TrainState

__all__ = [
    "POINTS",
    "Baseline",
    "KillOutcome",
    "KillPlan",
    "RunConfig",
    "compute_baseline",
    "predict_restored_step",
    "run_kill_sequence",
]


def _weights_hash(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(t.detach().contiguous().numpy().tobytes())
    return h.hexdigest()


def _objects(cfg: RunConfig) -> tuple[Any, Any, Any, Any]:
    from ckpt_lesson.course.training import (
        SyntheticRegression,
        make_model,
        make_optimizer_and_scheduler,
        seed_everything,
    )

    seed_everything(cfg.seed)
    data = SyntheticRegression(seed=cfg.seed)
    model = make_model()
    opt, sched = make_optimizer_and_scheduler(model, total_steps=cfg.total_steps)
    return data, model, opt, sched


@dataclass(frozen=True)
class Baseline:
    """The uninterrupted run: per-step (loss, ids) and the weights hash at each step."""

    losses: list[float]
    ids: list[tuple[int, ...]]
    weights: dict[int, str]


def compute_baseline(cfg: RunConfig) -> Baseline:
    """Train once without any save or kill (this also warms torch up before forking)."""
    from ckpt_lesson.course.training import train

    data, model, opt, sched = _objects(cfg)
    state, ids, weights = TrainState(), [], {}

    def after(st: TrainState, rec: Any) -> None:
        ids.append(rec.sample_ids)
        weights[st.step] = _weights_hash(model)

    train(model, opt, sched, state, data, until_step=cfg.total_steps, seed=cfg.seed,
          batch_size=cfg.batch_size, after_step=after)  # fmt: skip
    return Baseline(list(state.losses), ids, weights)


#: In a child: tells the harness that a kill trigger fired, just before the SIGKILL. A SIGKILL from
#: anywhere else (the harness after SILENCE_S without progress, the kernel's OOM killer on a loaded
#: machine) is not a kill at the planned point, and the prediction must not be judged against it.
_announce: Any = None
#: The longest a child may stay silent (no step, no restore) before the harness kills it as hung.
#: A save to a bucket on a loaded 2-core machine can wait out one botocore read timeout (60 s)
#: and its retry: 120 s was too close to that.
SILENCE_S = 300


def _suicide() -> None:
    if _announce is not None:
        _announce()
    os.kill(os.getpid(), signal.SIGKILL)


def _arm(plan: KillPlan | None) -> Any:
    """Install this process's kill trigger; returns the manager event hook."""
    if plan is None:
        return None
    armed = {"on": False, "bytes": 0, "files": 0}
    if plan.point == "mid_part":
        from ckpt_lesson.files import integrity

        original_write = integrity.FooterWriter.write

        def write(self: Any, data: Any) -> int:
            if armed["on"]:
                n = len(memoryview(data).cast("B"))
                if armed["bytes"] + n >= plan.arg:
                    # Write the bytes up to the kill point, so a torn file is really on disk.
                    original_write(self, bytes(memoryview(data).cast("B")[: plan.arg - armed["bytes"]]))
                    self.flush()
                    _suicide()
                armed["bytes"] += n
            return original_write(self, data)

        integrity.FooterWriter.write = write  # type: ignore[method-assign]
    if plan.point == "after_shards":
        from ckpt_lesson.files import sharded

        original_save = sharded.atomic_save

        def counting_save(payload: Any, path: Any, **kwargs: Any) -> Any:
            digest = original_save(payload, path, **kwargs)
            if armed["on"] and Path(path).name.startswith("model.shard-"):
                armed["files"] += 1
                if armed["files"] >= plan.arg:
                    _suicide()
            return digest

        sharded.atomic_save = counting_save  # type: ignore[assignment]

    def hook(name: str, info: dict[str, Any]) -> None:
        if info.get("step") is None:
            return
        if name == "save_begin" and info["step"] == plan.step:
            armed["on"] = True
        if name == "retention_delete" and armed["on"] and plan.point == "retention_delete":
            _suicide()
        if name == plan.point and info["step"] == plan.step:
            _suicide()
        if name == "save_end" and info["step"] == plan.step and plan.point in ("bitrot", "manifest_rot"):
            _suicide()

    return hook


def _life(run_dir: Path, cfg: RunConfig, plan: KillPlan | None, conn: Any, store: Any = None) -> None:
    """One training process: ``run_managed_training`` with its kill trigger armed.

    ``store``: a :class:`~ckpt_lesson.faults.store_kills.StoreTarget` when the run saves to a bucket
    (then ``run_dir`` holds only this machine's scratch, and the bucket is the run).
    """
    global _announce

    def announce() -> None:
        conn.send(("kill",))  # in the pipe before the SIGKILL: the harness reads it after the death

    _announce = announce
    try:
        from ckpt_lesson.course.managed import run_managed_training

        # The manager logs every skip and cleanup; the harness reports them itself, in its table.
        quiet = logging.getLogger("ckpt_lesson")
        quiet.addHandler(logging.NullHandler())
        quiet.propagate = False
        hook = _arm(plan) if store is None else store.arm(plan, run_dir)
        location: Any = run_dir if store is None else store.url
        restored_losses = _restored_losses if store is None else store.restored_losses

        def on_restore(model: torch.nn.Module, info: dict[str, Any] | None) -> None:
            info = info or {}
            losses = restored_losses(info)
            skipped = len(info.get("skipped", []))
            conn.send(("restored", info.get("step"), skipped, _weights_hash(model), losses))

        def after(st: TrainState, rec: Any) -> None:
            conn.send(("step", rec.step, rec.loss, rec.sample_ids))
            if plan is not None and plan.point == "between_saves" and st.step == plan.step:
                _suicide()

        out = run_managed_training(
            location, total_steps=cfg.total_steps, seed=cfg.seed, every_steps=cfg.every_steps,
            keep_last=cfg.keep_last, num_shards=cfg.num_shards, batch_size=cfg.batch_size,
            on_event=hook, after_step=after, on_restore=on_restore,
        )  # fmt: skip
        conn.send(("done", out["losses"]))
    except BaseException as exc:  # report, never hang the harness
        conn.send(("error", f"{type(exc).__name__}: {exc}"))
        os._exit(3)
    conn.close()


def _restored_losses(info: dict[str, Any]) -> list[float]:
    """The loss history the restore put back (read from the chosen save, independently)."""
    from ckpt_lesson.files.checkpoint import load_verified_file

    path = info.get("path")
    if not path:
        return []
    target = Path(path)
    file = target / "checkpoint.pt" if (target / "checkpoint.pt").exists() else target / "meta.pt"
    payload, _ = load_verified_file(file)
    return list(payload["state"]["losses"])


def _flip_byte_of_newest(run_dir: Path, step: int) -> None:
    step_dir = run_dir / f"step-{step:08d}"
    victim = max((p for p in step_dir.iterdir() if p.suffix == ".pt"), key=lambda p: p.stat().st_size)
    raw = bytearray(victim.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    victim.write_bytes(bytes(raw))


def _flip_byte_of_manifest(run_dir: Path, step: int) -> None:
    # '"rng"' -> '"rnf"' when present: the flip that once turned a damaged record into a refusal.
    path = run_dir / f"step-{step:08d}" / "manifest.json"
    raw = bytearray(path.read_bytes())
    at = raw.find(b'"rng"')
    raw[at + 3 if at >= 0 else len(raw) // 2] ^= 0x01
    path.write_bytes(bytes(raw))


@dataclass
class KillOutcome:
    """What happened around one kill."""

    plan: KillPlan
    predicted: int | None
    chosen: int | None = None
    killed: bool = False
    wrong_choice: bool = False
    corrupt_load: bool = False
    skipped: int = 0
    incomplete_found: int = 0
    error: str | None = None


def _spawn(
    run_dir: Path, cfg: RunConfig, plan: KillPlan | None, store: Any = None
) -> tuple[list[tuple[Any, ...]], int | None]:
    ctx = multiprocessing.get_context("fork")
    parent, child = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_life, args=(run_dir, cfg, plan, child, store))
    proc.start()
    child.close()
    messages = []
    while True:
        if not parent.poll(SILENCE_S):
            proc.kill()
            messages.append(("error", f"child made no progress for {SILENCE_S} s"))
            break
        try:
            messages.append(parent.recv())
        except EOFError:
            break
    proc.join(30)
    return messages, proc.exitcode


def _check_restore(msg: tuple[Any, ...], base: Baseline) -> bool:
    """True when the restored weights and loss history are the uninterrupted run's."""
    _, step, _, weights, losses = msg
    if step is None:
        return not losses
    return weights == base.weights.get(step) and losses == base.losses[:step]


def run_kill_sequence(
    run_dir: Path, cfg: RunConfig, plans: list[KillPlan], base: Baseline, store: Any = None
) -> tuple[list[KillOutcome], int, bool]:
    """Kill one process per plan, then finish the run in a last process.

    ``store`` (a :class:`~ckpt_lesson.faults.store_kills.StoreTarget`): the processes save to its
    bucket prefix instead of ``run_dir``; damage is done to the objects there.

    Returns:
        ``(outcomes, trajectory_differences, finished_equal)``.
    """
    from ckpt_lesson.runs.scan import scan_checkpoints

    outcomes: list[KillOutcome] = []
    diffs = 0
    finished_equal = False
    pending: KillOutcome | None = None
    for plan in [*plans, None]:
        if pending is not None and store is not None:
            pending.incomplete_found = store.incomplete_found()
        elif pending is not None and run_dir.exists():
            pending.incomplete_found = sum(1 for r in scan_checkpoints(run_dir) if r.status == "incomplete")
        messages, code = _spawn(run_dir, cfg, plan, store)
        life_error = None
        for msg in messages:
            if msg[0] == "restored" and pending is not None:
                pending.chosen, pending.skipped = msg[1], msg[2]
                pending.wrong_choice = msg[1] != pending.predicted
                pending.corrupt_load = not _check_restore(msg, base)
            elif msg[0] == "restored" and not _check_restore(msg, base):
                diffs += 1
            elif msg[0] == "step":
                _, step, loss, ids = msg
                diffs += int(loss != base.losses[step - 1] or ids != base.ids[step - 1])
            elif msg[0] == "done":
                finished_equal = msg[1] == base.losses
            elif msg[0] == "error":
                life_error = msg[1]
        if plan is None:
            if life_error and pending is not None:
                pending.error = life_error
            break
        outcome = KillOutcome(plan, predict_restored_step(plan, cfg.every_steps), error=life_error)
        # Killed at its point: the trigger announced it, then the process died by SIGKILL. Only then
        # does the prediction say which save the next restore must choose.
        fired = any(msg[0] == "kill" for msg in messages)
        outcome.killed = fired and code == -signal.SIGKILL
        outcomes.append(outcome)
        if not outcome.killed:
            missed = f"kill point {plan.point} at step {plan.step} was never reached"
            if code == -signal.SIGKILL:
                missed = (
                    f"killed by a SIGKILL that was not the kill trigger, before {plan.point} at step "
                    f"{plan.step} (the harness after {SILENCE_S} s without progress, or the OOM killer); "
                    "no restore to judge"
                )
            outcome.error = outcome.error or missed
            return outcomes, diffs, finished_equal
        if store is not None:
            store.damage(plan)
        elif plan.point == "bitrot":
            _flip_byte_of_newest(run_dir, plan.step)
        elif plan.point == "manifest_rot":
            _flip_byte_of_manifest(run_dir, plan.step)
        pending = outcome
    return outcomes, diffs, finished_equal
