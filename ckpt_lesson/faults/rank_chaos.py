"""The multi-rank chaos campaign: SIGKILL ranks during a distributed save, then check the restore.

``python -m ckpt_lesson chaos --ranks 2`` launches one tiny FSDP2 run per kill
(:mod:`ckpt_lesson.faults.rank_programs`): it saves step 2, then, while saving
step 4, one rank or all of them are killed at a point of the commit protocol.
The step a correct restore must pick is written down *before* the launch
(:func:`predict_rank_restore`). Afterwards one launch of the same world size
trains an uninterrupted run and restores every killed run, trains it on to
step 6, and records what it chose and every loss. A kill is judged right when
every rank restored the predicted step, no half-written save was ever
published, and the losses equal the uninterrupted run's exactly.

Kill points (the manager event that triggers the kill, see
:class:`~ckpt_lesson.distributed.DistributedCheckpointManager`):

* ``mid_write``: a rank's first bytes reached a data file (fires on every rank);
* ``before_manifest``: rank 0 wrote ``.metadata`` but not the manifest;
* ``before_publish``: rank 0 wrote the manifest but has not renamed the folder;
* ``after_publish``: the save is published (it must be the one restored).

Victims: ``one`` (the rank where the event fires), ``all``, or ``others``
(every rank but rank 0, which then publishes on its own: the save survives).
Each kill also runs with ``mode="async"``, where the event fires in DCP's
background thread while training goes on, and with ``publish="marker"``
(``--publish marker``), where ``before_publish`` means after the manifest and
before the commit marker. With ``store=URL`` (``chaos --store URL --ranks N``)
every killed run saves to its own prefix of a bucket, always by marker: there
``before_publish`` is after the manifest and before the conditional ``COMMIT``.
"""

from __future__ import annotations

import json
import random
import shutil
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from ckpt_lesson.errors import CheckpointError
from ckpt_lesson.runs.commit import PUBLISH_MODES

__all__ = [
    "NAMED_KILLS",
    "POINTS",
    "RankCampaignResult",
    "RankKill",
    "RankKillOutcome",
    "check_kill",
    "draw_kills",
    "predict_rank_restore",
    "run_rank_campaign",
]

#: point -> (manager event, fires on rank 0 only, the interrupted save survives; None: iff rank 0 lives)
POINTS: dict[str, tuple[str, bool, bool | None]] = {
    "mid_write": ("file_partial", False, False),
    "before_manifest": ("metadata_written", True, None),
    "before_publish": ("manifest_written", True, None),
    "after_publish": ("published", True, True),
}
VICTIMS = ("one", "all", "others")
MODES = ("sync", "async")
#: The two saves of every run: the older one, and the one the kills interrupt.
OLDER, INTERRUPTED = 2, 4


@dataclass(frozen=True)
class RankKill:
    """One planned kill: at ``point`` of rank ``at``'s save of step 4, kill ``victims``.

    Example:
        >>> RankKill("before_publish", "others").killed(2)
        [1]
    """

    point: str
    victims: str
    at: int = 0
    mode: str = "sync"
    #: How the manager publishes: ``"rename"`` or ``"marker"`` (the commit marker, written last).
    publish: str = "rename"

    @property
    def name(self) -> str:
        suffix = "" if self.publish == "rename" else f"/{self.publish}"
        return f"{self.mode}/{self.point}/{self.victims}@{self.at}{suffix}"

    def killed(self, world: int) -> list[int]:
        """The ranks this kill SIGKILLs in a run of ``world`` ranks."""
        if self.victims == "one":
            return [self.at]
        return [r for r in range(world) if self.victims == "all" or r != self.at]

    def hook_spec(self, world: int) -> dict[str, Any]:
        """What :func:`~ckpt_lesson.faults.rank_programs.w_fault` needs, as plain values."""
        return {
            "event": POINTS[self.point][0],
            "at": self.at,
            "victims": self.killed(world),
            "mode": self.mode,
            "publish": self.publish,
        }


def check_kill(kill: RankKill, world: int) -> None:
    """Refuse a kill whose outcome depends on timing, so every prediction is exact.

    Raises:
        CheckpointError: Unknown names, ``at`` outside the world, a rank-0 point
            fired elsewhere, or ``others`` where the survivor's publish races the kill.
    """
    known = kill.point in POINTS and kill.victims in VICTIMS and kill.mode in MODES
    if not known or kill.publish not in PUBLISH_MODES:
        raise CheckpointError(
            f"{kill.name}: unknown point, victims, mode or publish; see POINTS, VICTIMS, MODES."
        )
    rank0_only = POINTS[kill.point][1]
    if not 0 <= kill.at < world or (rank0_only and kill.at != 0):
        raise CheckpointError(f"{kill.name}: point {kill.point!r} cannot fire on rank {kill.at} of {world}.")
    if kill.victims == "others" and (not rank0_only or kill.mode == "async"):
        # While its peers write, or while its training thread meets a dead peer in a collective,
        # the survivor may or may not get as far as the publish: no exact prediction exists.
        raise CheckpointError(f"{kill.name}: killing only the others is exact for sync rank-0 points only.")


def predict_rank_restore(kill: RankKill, world: int) -> int:
    """The step every rank must restore after ``kill``: 4 when its save got published, else 2.

    Example:
        >>> predict_rank_restore(RankKill("before_publish", "all"), 2)
        2
    """
    survives = POINTS[kill.point][2]
    if survives is None:  # rank 0 commits alone once it is in finish(): it publishes if it lives
        survives = 0 not in kill.killed(world)
    return INTERRUPTED if survives else OLDER


#: Every point, every kind of victim, and both save modes, once each (the tests run these).
NAMED_KILLS: tuple[RankKill, ...] = (
    RankKill("mid_write", "one", at=1),
    RankKill("mid_write", "all"),
    RankKill("before_manifest", "one"),
    RankKill("before_manifest", "all"),
    RankKill("before_publish", "one"),
    RankKill("before_publish", "all"),
    RankKill("before_publish", "others"),
    RankKill("after_publish", "all"),
    RankKill("mid_write", "one", at=1, mode="async"),
    RankKill("before_publish", "all", mode="async"),
)


def draw_kills(
    count: int, *, world: int, seed: int, named: bool = True, publish: str = "rename"
) -> list[RankKill]:
    """``count`` kills: the named ones first (when ``named``), then valid ones drawn from ``seed``."""
    rng = random.Random(seed)
    kills = [replace(k, publish=publish) for k in NAMED_KILLS if k.at < world][:count] if named else []
    while len(kills) < count:
        point = rng.choice(sorted(POINTS))
        kill = RankKill(
            point,
            rng.choice(VICTIMS),
            at=0 if POINTS[point][1] else rng.randrange(world),
            mode=rng.choice(MODES),
            publish=publish,
        )
        try:
            check_kill(kill, world)
        except CheckpointError:
            continue  # a timing-dependent combination: draw again
        kills.append(kill)
    return kills


@dataclass
class RankKillOutcome:
    """What one kill did, and whether the restore after it was right."""

    kill: RankKill
    predicted: int
    exit_codes: list[int]
    restored: list[dict[str, Any]]
    baseline: list[list[float]]
    #: How each rank's save of step 4 ended (``"returned"``, the error), ``None`` where it was killed.
    said: list[str | None] = field(default_factory=list)

    @property
    def killed(self) -> bool:
        return any(code == -9 for code in self.exit_codes)

    @property
    def wrong_choice(self) -> bool:
        return [r.get("step") for r in self.restored] != [self.predicted] * len(self.exit_codes)

    @property
    def damaged_published(self) -> bool:
        return any(r.get("skipped") for r in self.restored)  # nothing half-written may ever be published

    @property
    def trajectory_differs(self) -> bool:
        return [r.get("losses") for r in self.restored] != self.baseline

    @property
    def error(self) -> str | None:
        return next((r["error"] for r in self.restored if r.get("error")), None)


@dataclass
class RankCampaignResult:
    """Totals of a multi-rank campaign; :attr:`ok` is False on any wrong choice or difference."""

    world: int
    seed: int
    outcomes: list[RankKillOutcome] = field(default_factory=list)
    staging_left: int = 0
    #: The bucket the runs saved to (``chaos --store``), ``None`` for local run folders.
    store: str | None = None

    @property
    def wrong_choices(self) -> int:
        return sum(o.wrong_choice for o in self.outcomes)

    @property
    def ok(self) -> bool:
        bad = (o.wrong_choice or o.damaged_published or o.trajectory_differs for o in self.outcomes)
        missed = any(not o.killed or o.error for o in self.outcomes)
        return bool(self.outcomes) and not (any(bad) or missed or self.staging_left)

    def table(self) -> str:
        """The campaign as a fixed-width table, like the single-process one (no paths, no times)."""
        o, count = self.outcomes, _counts
        rows = [
            ("kills", f"{len(o)} over {len(o)} runs of {self.world} ranks (seed {self.seed})"),
            *([("saves went to", f"{self.store} (local folders were scratch)")] if self.store else []),
            ("  by point", count(x.kill.point for x in o)),
            ("  by victims", count(x.kill.victims for x in o)),
            ("  async saves", str(sum(x.kill.mode == "async" for x in o))),
            ("fallbacks", f"{sum(x.predicted == OLDER for x in o)} (interrupted save lost)"),
            ("saves found damaged", str(sum(x.damaged_published for x in o))),
            ("staging folders left", str(self.staging_left)),
            ("wrong choices", str(self.wrong_choices)),
            ("trajectory differences", str(sum(x.trajectory_differs for x in o))),
        ]
        missed = [x.kill.name for x in o if not x.killed]
        errors = sorted({x.error for x in o if x.error})
        if missed or errors:
            rows.append(
                ("harness problems", f"{len(missed)} missed kills {missed[:3]}; errors: {errors[:2]}")
            )
        rows.append(("verdict", "PASS" if self.ok else "FAIL"))
        return "\n".join(f"{k:<24}{v}" for k, v in rows)


def run_rank_campaign(
    kills: list[RankKill],
    *,
    world: int = 2,
    seed: int = 0,
    workdir: str | Path | None = None,
    keep: bool = False,
    predict: Callable[[RankKill, int], int] | None = None,
    store: str | None = None,
) -> RankCampaignResult:
    """Run every kill in ``kills`` on ``world`` ranks, then restore and judge each (module docstring).

    Args:
        kills: The kills, one launch each (see :func:`draw_kills`); each is checked first.
        world: Ranks per launch (2 or more).
        seed: Only recorded in the table (the kills are already drawn).
        workdir: Where run folders go (a temporary folder by default).
        keep: Keep the run folders for inspection.
        predict: ``predict(kill, world) -> step``; :func:`predict_rank_restore` by default.
        store: A bucket prefix (``s3://BUCKET/PREFIX``, reached through the ``AWS_*``
            environment): each killed run saves to ``store/run-NNNN`` (its kills must
            use ``publish="marker"``); the reports stay under ``workdir``.

    Returns:
        A :class:`RankCampaignResult`; ``result.ok`` is the verdict.

    Raises:
        CheckpointError: A kill that cannot be predicted exactly, or ``world`` < 2.

    Example:
        >>> result = run_rank_campaign(draw_kills(10, world=2, seed=0))  # doctest: +SKIP
        >>> print(result.table())  # doctest: +SKIP
    """
    from ckpt_lesson.faults.rank_launch import launch
    from ckpt_lesson.faults.rank_programs import STORE_LEASE_SECONDS, w_check, w_fault
    from ckpt_lesson.faults.store_kills import StoreTarget

    if world < 2:
        raise CheckpointError(f"a multi-rank campaign needs 2 or more ranks, got {world}.")
    for kill in kills:
        check_kill(kill, world)
        if store is not None and kill.publish != "marker":
            raise CheckpointError(f"{kill.name}: a bucket has no rename; draw kills with publish='marker'.")
    predict = predict or predict_rank_restore
    if workdir is not None:
        Path(workdir).mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="ckpt-rank-chaos-", dir=workdir))
    runs, predicted, codes = [], [], []
    stores = None if store is None else [f"{store.rstrip('/')}/run-{i:04d}" for i in range(len(kills))]
    for i, kill in enumerate(kills):
        run = root / f"run-{i:04d}"
        shutil.rmtree(run, ignore_errors=True)
        predicted.append(predict(kill, world))  # written down before the kill
        target = None if stores is None else stores[i]
        codes.append(launch(w_fault, world, root, str(run), kill.hook_spec(world), target))
        runs.append(run)
    if stores is not None:
        time.sleep(STORE_LEASE_SECONDS)  # the last killed writer's lease runs out: its upload may go
    baseline = root / "uninterrupted"
    shutil.rmtree(baseline, ignore_errors=True)
    limit = 60.0 + 10 * len(runs)
    check_codes = launch(w_check, world, root, str(baseline), [str(r) for r in runs], stores, limit=limit)
    if check_codes != [0] * world:
        raise CheckpointError(
            f"the restoring launch failed (exit codes {check_codes}); see the traceback above."
        )
    result = RankCampaignResult(world=world, seed=seed, store=store)
    losses = [_read(baseline / f"losses-rank{r}.json") for r in range(world)]
    for kill, run, step, exit_codes in zip(kills, runs, predicted, codes, strict=True):
        restored = [_read(run / f"restored-rank{r}.json") for r in range(world)]
        said = [_read(run / f"outcome-rank{r}.json", "outcome") for r in range(world)]
        result.outcomes.append(RankKillOutcome(kill, step, exit_codes, restored, losses, said))
        result.staging_left += len(restored[0]["staging_after"])  # rank 0's manager is the one that cleans
    if keep:
        print(f"run folders kept in {root}" + ("" if store is None else f" and {store}/run-*"))
    else:
        shutil.rmtree(root, ignore_errors=True)
        for url in stores or []:
            StoreTarget(url).remove()
    return result


def _counts(values: Any) -> str:
    return ", ".join(f"{k} {n}" for k, n in sorted(Counter(values).items()))


def _read(path: Path, key: str | None = None) -> Any:
    """A rank's JSON report; with ``key``, that field, or ``None`` when the rank died before writing."""
    if key is None:
        return json.loads(path.read_text())
    return json.loads(path.read_text())[key] if path.exists() else None
