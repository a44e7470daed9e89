"""Fault injection: kill real training processes at the worst moments and check the restore.

A resume path is only trustworthy if it has been *crashed into*, many times, at
the points where a crash hurts: half-way through a file, after some shards but
not all, after the parts but before the commit, during retention. This
harness runs managed training (:class:`~ckpt_lesson.manager.CheckpointManager`
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
so the restorer must detect it and fall back). Random kills draw a point and a
step from a seeded generator.
"""

from __future__ import annotations

import argparse
import hashlib
import logging
import multiprocessing
import os
import random
import shutil
import signal
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from .checkpoint import TrainState
from .errors import CheckpointError
from .report import read_recovery_log

__all__ = [
    "POINTS",
    "Baseline",
    "CampaignResult",
    "KillOutcome",
    "KillPlan",
    "RunConfig",
    "compute_baseline",
    "predict_restored_step",
    "run_campaign",
    "run_kill_sequence",
]

#: Kill point -> whether the interrupted save survives (is complete and published).
POINTS: dict[str, bool] = {
    "save_end": True,
    "published": True,
    "retention_delete": True,
    "mid_part": False,
    "after_shards": False,
    "parts_complete": False,
    "manifest_written": False,
    "between_saves": True,
    "bitrot": False,
}
_SHARDED_ONLY = {"after_shards"}


@dataclass(frozen=True)
class KillPlan:
    """Where to kill one process: at ``point`` of the save of ``step`` (or after ``step``).

    ``arg`` is the byte count for ``mid_part`` and the shard count for ``after_shards``.
    """

    step: int
    point: str
    arg: int = 0


@dataclass(frozen=True)
class RunConfig:
    """One simulated run; every process of it uses the same settings."""

    total_steps: int = 40
    every_steps: int = 5
    keep_last: int = 2
    num_shards: int | None = None
    seed: int = 11
    batch_size: int = 16


def predict_restored_step(plan: KillPlan, every_steps: int) -> int | None:
    """The step a correct restorer must choose after ``plan``'s kill (``None``: fresh start).

    Every save step below the killed step was published (each process re-saves
    the steps after the one it restored), so the newest good save is the killed
    save itself when it was complete, else the save step just below it.
    """
    survives = POINTS[plan.point]
    if plan.point == "between_saves":
        newest = plan.step - plan.step % every_steps
    else:
        newest = plan.step if survives else plan.step - every_steps
    return newest if newest >= every_steps else None


def _weights_hash(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(t.detach().contiguous().numpy().tobytes())
    return h.hexdigest()


def _objects(cfg: RunConfig) -> tuple[Any, Any, Any, Any]:
    from .training import SyntheticRegression, make_model, make_optimizer_and_scheduler, seed_everything

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
    from .training import train

    data, model, opt, sched = _objects(cfg)
    state, ids, weights = TrainState(), [], {}

    def after(st: TrainState, rec: Any) -> None:
        ids.append(rec.sample_ids)
        weights[st.step] = _weights_hash(model)

    train(model, opt, sched, state, data, until_step=cfg.total_steps, seed=cfg.seed,
          batch_size=cfg.batch_size, after_step=after)  # fmt: skip
    return Baseline(list(state.losses), ids, weights)


def _suicide() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _arm(plan: KillPlan | None) -> Any:
    """Install this process's kill trigger; returns the manager event hook."""
    if plan is None:
        return None
    armed = {"on": False, "bytes": 0, "files": 0}
    if plan.point == "mid_part":
        from . import integrity

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
        from . import sharded

        original_save = sharded.atomic_save

        def counting_save(payload: Any, path: Any) -> Any:
            digest = original_save(payload, path)
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
        if name == "save_end" and info["step"] == plan.step and plan.point == "bitrot":
            _suicide()

    return hook


def _life(run_dir: Path, cfg: RunConfig, plan: KillPlan | None, conn: Any) -> None:
    """One training process: ``run_managed_training`` with its kill trigger armed."""
    try:
        from .train_cmd import run_managed_training

        # The manager logs every skip and cleanup; the harness reports them itself, in its table.
        quiet = logging.getLogger("ckpt_lesson")
        quiet.addHandler(logging.NullHandler())
        quiet.propagate = False
        hook = _arm(plan)

        def on_restore(model: torch.nn.Module, info: dict[str, Any] | None) -> None:
            info = info or {}
            losses = _restored_losses(info)
            skipped = len(info.get("skipped", []))
            conn.send(("restored", info.get("step"), skipped, _weights_hash(model), losses))

        def after(st: TrainState, rec: Any) -> None:
            conn.send(("step", rec.step, rec.loss, rec.sample_ids))
            if plan is not None and plan.point == "between_saves" and st.step == plan.step:
                _suicide()

        out = run_managed_training(
            run_dir, total_steps=cfg.total_steps, seed=cfg.seed, every_steps=cfg.every_steps,
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
    from .checkpoint import load_verified_file

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


def _spawn(run_dir: Path, cfg: RunConfig, plan: KillPlan | None) -> tuple[list[tuple[Any, ...]], int | None]:
    ctx = multiprocessing.get_context("fork")
    parent, child = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_life, args=(run_dir, cfg, plan, child))
    proc.start()
    child.close()
    messages = []
    while True:
        if not parent.poll(120):
            proc.kill()
            messages.append(("error", "child made no progress for 120 s"))
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
    run_dir: Path, cfg: RunConfig, plans: list[KillPlan], base: Baseline
) -> tuple[list[KillOutcome], int, bool]:
    """Kill one process per plan, then finish the run in a last process.

    Returns:
        ``(outcomes, trajectory_differences, finished_equal)``.
    """
    from .scan import scan_checkpoints

    outcomes: list[KillOutcome] = []
    diffs = 0
    finished_equal = False
    pending: KillOutcome | None = None
    for plan in [*plans, None]:
        if pending is not None and run_dir.exists():
            pending.incomplete_found = sum(1 for r in scan_checkpoints(run_dir) if r.status == "incomplete")
        messages, code = _spawn(run_dir, cfg, plan)
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
        outcome.killed = code == -signal.SIGKILL
        outcomes.append(outcome)
        if not outcome.killed:
            outcome.error = outcome.error or f"kill point {plan.point} at step {plan.step} was never reached"
            return outcomes, diffs, finished_equal
        if plan.point == "bitrot":
            _flip_byte_of_newest(run_dir, plan.step)
        pending = outcome
    return outcomes, diffs, finished_equal


def _plan_run(
    rng: random.Random, cfg: RunConfig, points: list[str], *, early: bool = False
) -> list[KillPlan]:
    """Kill plans for one run, each at a step the previous kill's restore lets it reach.

    ``early`` picks among the first two possible steps, leaving room for every
    point of a named list.
    """
    plans: list[KillPlan] = []
    restored: int | None = None
    e, k = cfg.every_steps, cfg.keep_last
    for point in points:
        start = restored or 0
        saves = list(range(start - start % e + e, cfg.total_steps + 1, e))
        if point == "between_saves":
            candidates = [s for s in range(start + 1, cfg.total_steps) if s % e]
        elif point == "retention_delete":
            # This process knows the restored save and its own saves as verified; retention
            # deletes only once it knows keep_last + 1 of them.
            need = k + 1 - (1 if restored else 0)
            candidates = saves[need - 1 :]
        elif point == "bitrot":
            candidates = [s for s in saves if s >= 2 * e]  # an older save must exist to fall back to
        else:
            candidates = saves
        if not candidates:
            break
        step = rng.choice(candidates[:2] if early else candidates)
        arg = 0
        if point == "mid_part":
            arg = rng.randrange(1, 12_000)  # bytes into the save; the tiny model's payload is larger
        elif point == "after_shards":
            arg = rng.randrange(1, (cfg.num_shards or 1) + 1)
        plan = KillPlan(step, point, arg)
        plans.append(plan)
        restored = predict_restored_step(plan, e)
    return plans


@dataclass
class CampaignResult:
    """Totals of a campaign; :attr:`ok` is False on any wrong choice, corrupt load or difference."""

    outcomes: list[KillOutcome] = field(default_factory=list)
    runs: int = 0
    trajectory_differences: int = 0
    unfinished_runs: int = 0
    recoveries: list[dict[str, Any]] = field(default_factory=list)
    seed: int = 0

    @property
    def wrong_choices(self) -> int:
        return sum(o.wrong_choice for o in self.outcomes)

    @property
    def corrupt_loads(self) -> int:
        return sum(o.corrupt_load for o in self.outcomes)

    @property
    def missed_kills(self) -> int:
        return sum(not o.killed for o in self.outcomes)

    @property
    def ok(self) -> bool:
        return not (
            self.wrong_choices or self.corrupt_loads or self.trajectory_differences or self.unfinished_runs
            or self.missed_kills or any(o.error for o in self.outcomes)
        )  # fmt: skip

    def table(self) -> str:
        """The campaign as a fixed-width table (no paths; times only in the recovery row)."""
        by_point: dict[str, int] = {}
        for o in self.outcomes:
            by_point[o.plan.point] = by_point.get(o.plan.point, 0) + 1
        redone = [r["steps_redone"] for r in self.recoveries if r.get("steps_redone") is not None]
        secs = [r["recovery_seconds"] for r in self.recoveries if r.get("recovery_seconds") is not None]
        rows = [
            ("kills", f"{len(self.outcomes)} over {self.runs} runs (seed {self.seed})"),
            ("  by point", ", ".join(f"{p} {n}" for p, n in sorted(by_point.items()))),
            ("fallbacks", f"{sum(not POINTS[o.plan.point] for o in self.outcomes)} (interrupted save lost)"),
            ("corrupt saves skipped", str(sum(o.skipped for o in self.outcomes))),
            ("incomplete saves found", str(sum(o.incomplete_found for o in self.outcomes))),
            ("steps redone", f"{sum(redone)} total, max {max(redone, default=0)} per restore"),
            (
                "recovery time",
                f"median {statistics.median(secs):.3f} s, max {max(secs):.3f} s" if secs else "n/a",
            ),
            ("wrong choices", str(self.wrong_choices)),
            ("corrupt loads", str(self.corrupt_loads)),
            ("trajectory differences", str(self.trajectory_differences + self.unfinished_runs)),
        ]
        if self.missed_kills or any(o.error for o in self.outcomes):
            errors = sorted({o.error for o in self.outcomes if o.error})
            rows.append(("harness problems", f"{self.missed_kills} missed kills; errors: {errors[:3]}"))
        rows.append(("verdict", "PASS" if self.ok else "FAIL"))
        return "\n".join(f"{k:<24}{v}" for k, v in rows)


def run_campaign(
    kills: int = 20,
    *,
    seed: int = 0,
    workdir: str | os.PathLike[str] | None = None,
    named_points: bool = True,
    kills_per_run: int = 4,
    keep: bool = False,
) -> CampaignResult:
    """Kill ``kills`` training processes and check every restore (see the module docstring).

    Args:
        kills: Number of processes to kill.
        seed: Seeds the choice of points, steps and byte offsets.
        workdir: Where run directories go (a temporary folder by default).
        named_points: Start with one kill at every named point (single-file
            and sharded), then random ones.
        kills_per_run: Kills before a run is allowed to finish.
        keep: Keep the run directories for inspection.

    Returns:
        A :class:`CampaignResult`; ``result.ok`` is the verdict.

    Example:
        >>> result = run_campaign(kills=20, seed=0)  # doctest: +SKIP
        >>> print(result.table())
    """
    rng = random.Random(seed)
    root = Path(workdir) if workdir is not None else Path(tempfile.mkdtemp(prefix="ckpt-chaos-"))
    root.mkdir(parents=True, exist_ok=True)
    single, sharded = RunConfig(), RunConfig(num_shards=3)
    base = compute_baseline(single)  # the layout does not change the trajectory
    queue: list[tuple[RunConfig, list[str]]] = []
    if named_points:
        named = [p for p in POINTS if p not in _SHARDED_ONLY]
        queue.append((single, named[: len(named) // 2]))
        queue.append((single, named[len(named) // 2 :]))
        queue.append((sharded, ["after_shards", "mid_part", "manifest_written", "published"]))
    result = CampaignResult(seed=seed)
    left = kills
    run_no = 0
    while left > 0:
        early = bool(queue)
        if queue:
            cfg, points = queue.pop(0)
            points = points[:left]
        else:
            cfg = sharded if run_no % 3 == 2 else single
            pool = [p for p in POINTS if cfg.num_shards or p not in _SHARDED_ONLY]
            points = [rng.choice(pool) for _ in range(min(kills_per_run, left))]
        plans = _plan_run(rng, cfg, points, early=early)
        if not plans:
            continue
        run_dir = root / f"run-{run_no:04d}"
        if run_dir.exists():
            shutil.rmtree(run_dir)
        outcomes, diffs, finished = run_kill_sequence(run_dir, cfg, plans, base)
        result.outcomes += outcomes
        result.trajectory_differences += diffs
        result.unfinished_runs += int(not finished)
        result.recoveries += read_recovery_log(run_dir)
        result.runs += 1
        left -= len(outcomes)
        run_no += 1
        if not keep:
            shutil.rmtree(run_dir, ignore_errors=True)
    if not keep and workdir is None:
        shutil.rmtree(root, ignore_errors=True)
    return result


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--kills", type=int, default=20, help="processes to kill (default 20)")
    parser.add_argument("--seed", type=int, default=0, help="seeds points, steps and offsets (default 0)")
    parser.add_argument("--workdir", default=None, help="folder for run directories (default: a temp dir)")
    parser.add_argument("--keep", action="store_true", help="keep the run directories")
    parser.add_argument("--random-only", action="store_true", help="skip the named-point kills")


def run(args: argparse.Namespace) -> int:
    if args.kills < 1:
        raise CheckpointError(f"--kills must be >= 1, got {args.kills}.")
    started = time.perf_counter()
    result = run_campaign(
        args.kills, seed=args.seed, workdir=args.workdir, named_points=not args.random_only, keep=args.keep
    )
    print(result.table())
    print(f"{'wall time':<24}{time.perf_counter() - started:.1f} s")
    return 0 if result.ok else 1
