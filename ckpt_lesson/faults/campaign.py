"""The chaos campaign: many kills, planned from a seed, summed up in one table.

:mod:`ckpt_lesson.faults.harness` knows how to kill *one* run at chosen points and
check each restore. This module decides *which* kills to make and adds up what
they showed. A campaign first kills once at every named point (single-file
runs, then a sharded one), so no point goes untested by bad luck; then it
draws random points, steps and byte offsets from a seeded generator, so a
failure found today is found again tomorrow with the same ``--seed``.

Each run's plan must be reachable: a kill can only happen at a step the
previous kill's restore lets the next process reach, so the plan is built
with :func:`~ckpt_lesson.faults.harness.predict_restored_step`, the same prediction the
checks use.

``python -m ckpt_lesson chaos --kills 200 --seed 0`` runs one from the shell
and exits 1 unless every check held. ``--ranks 2`` kills ranks of a multi-rank
(DCP) save instead: see :mod:`ckpt_lesson.faults.rank_chaos`.
"""

from __future__ import annotations

import os
import random
import shutil
import statistics
import tempfile
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ckpt_lesson.faults.harness import (
    KillOutcome,
    compute_baseline,
    run_kill_sequence,
)
from ckpt_lesson.faults.kill_plan import (
    POINTS,
    SHARDED_ONLY,
    STORE_POINTS,
    KillPlan,
    RunConfig,
    predict_restored_step,
)
from ckpt_lesson.faults.store_kills import StoreTarget
from ckpt_lesson.runs.report import read_recovery_log
from ckpt_lesson.short_repr import short_repr

__all__ = ["MAX_RANKS", "CampaignResult", "run_campaign"]

#: Most ranks ``--ranks`` launches: each is a process, and the test machines have 2 cores.
MAX_RANKS = 8


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
        elif point == "store_retention":
            # Retention deletes once the bucket holds keep_last + 1 committed saves: from this step on.
            candidates = [s for s in saves if s >= (k + 1) * e]
        elif point in ("bitrot", "manifest_rot"):
            candidates = [s for s in saves if s >= 2 * e]  # an older save must exist to fall back to
        else:
            candidates = saves
        if not candidates:
            break
        step = rng.choice(candidates[:2] if early else candidates)
        arg = 0
        if point == "mid_part":
            arg = rng.randrange(1, 12_000)  # bytes into the save; the tiny model's payload is larger
        elif point in ("after_shards", "mid_upload"):
            arg = rng.randrange(1, (cfg.num_shards or 1) + 1)  # shards (or the one file), then the rest
        plan = KillPlan(step, point, arg)
        plans.append(plan)
        restored = predict_restored_step(plan, e)
    return plans


@dataclass
class CampaignResult:
    """Totals of a campaign; :attr:`ok` is False on any wrong choice, corrupt load or difference."""

    __repr__ = short_repr  # one short line: see ckpt_lesson/short_repr.py

    outcomes: list[KillOutcome] = field(default_factory=list)
    runs: int = 0
    trajectory_differences: int = 0
    unfinished_runs: int = 0
    recoveries: list[dict[str, Any]] = field(default_factory=list)
    seed: int = 0
    #: ``scheme://bucket`` when the runs saved to an object store (``chaos --store``).
    store: str | None = None

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
            *([("saves went to", f"{self.store} (local folders were scratch)")] if self.store else []),
            ("  by point", ", ".join(f"{p} {n}" for p, n in sorted(by_point.items()))),
            (
                "fallbacks",
                f"{sum(not _SURVIVES[o.plan.point] for o in self.outcomes)} (interrupted save lost)",
            ),
            ("corrupt saves skipped", str(sum(o.skipped for o in self.outcomes))),
            ("incomplete saves found", str(sum(o.incomplete_found for o in self.outcomes))),
            (
                "steps redone",
                f"{sum(redone)} total, max {max(redone, default=0)} per restore"
                if redone or not self.recoveries
                else "unknown (the heartbeat is local: it went with the machine)",
            ),
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


_SURVIVES = {**STORE_POINTS, **POINTS}
#: The named store kills, in three runs (single file twice, then sharded).
_STORE_NAMED: list[tuple[bool, list[str]]] = [
    (False, ["mid_upload", "committed", "store_retention", "bitrot", "manifest_uploaded"]),
    (False, ["staged", "uploaded", "manifest_rot", "between_saves", "mid_part"]),
    (True, ["mid_upload", "manifest_uploaded", "committed"]),
]


def run_campaign(
    kills: int = 20,
    *,
    seed: int = 0,
    workdir: str | os.PathLike[str] | None = None,
    named_points: bool = True,
    kills_per_run: int = 4,
    keep: bool = False,
    store: str | None = None,
) -> CampaignResult:
    """Kill ``kills`` training processes and check every restore (see the module docstring).

    Args:
        kills: Number of processes to kill.
        seed: Seeds the choice of points, steps and byte offsets.
        workdir: Where run directories go (a temporary folder by default).
        named_points: Start with one kill at every named point (single-file
            and sharded), then random ones.
        kills_per_run: Kills before a run is allowed to finish.
        keep: Keep the run directories for inspection (and, with ``store``, the objects).
        store: A bucket URL (``s3://BUCKET/PREFIX``): every run saves under
            ``PREFIX/chaos-.../run-NNNN`` there, through ``CheckpointManager(URL)``,
            and is killed at the store's points (:data:`STORE_POINTS`); the local
            run folders hold only each process's scratch. Credentials and endpoint
            come from the environment.

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
    table = STORE_POINTS if store else POINTS
    if named_points and store:
        queue += [(sharded if shards else single, points) for shards, points in _STORE_NAMED]
    elif named_points:
        named = [p for p in POINTS if p not in SHARDED_ONLY]
        queue.append((single, named[: len(named) // 2]))
        queue.append((single, named[len(named) // 2 :]))
        queue.append((sharded, ["after_shards", "mid_part", "manifest_written", "published"]))
    result = CampaignResult(seed=seed, store=_bucket_of(store) if store else None)
    campaign_id = uuid.uuid4().hex[:8]
    left = kills
    run_no = 0
    while left > 0:
        early = bool(queue)
        if queue:
            cfg, points = queue.pop(0)
            points = points[:left]
        else:
            cfg = sharded if run_no % 3 == 2 else single
            pool = [p for p in table if cfg.num_shards or p not in SHARDED_ONLY]
            points = [rng.choice(pool) for _ in range(min(kills_per_run, left))]
        plans = _plan_run(rng, cfg, points, early=early)
        if not plans:
            continue
        run_dir = root / f"run-{run_no:04d}"
        if run_dir.exists():
            shutil.rmtree(run_dir)
        target = None
        if store:
            target = StoreTarget(f"{store.rstrip('/')}/chaos-{seed}-{campaign_id}/run-{run_no:04d}")
        outcomes, diffs, finished = run_kill_sequence(run_dir, cfg, plans, base, store=target)
        result.outcomes += outcomes
        result.trajectory_differences += diffs
        result.unfinished_runs += int(not finished)
        result.recoveries += read_recovery_log(run_dir) if target is None else target.recoveries()
        result.runs += 1
        left -= len(outcomes)
        run_no += 1
        if not keep:
            shutil.rmtree(run_dir, ignore_errors=True)
            if target is not None:
                target.remove()
    if not keep and workdir is None:
        shutil.rmtree(root, ignore_errors=True)
    return result


def _bucket_of(url: str) -> str:
    scheme, _, rest = url.partition("://")
    return f"{scheme}://{rest.split('/', 1)[0]}"
