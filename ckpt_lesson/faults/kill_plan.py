"""What the fault-injection harness kills, and which save a correct restore must then choose.

Each kill point names a moment in the manager's save protocol (its events, see
``runs/manager_config.EventHook``) or between saves, plus two kinds of damage
done after a kill (a flipped byte in the newest part, or in its manifest). The
table says whether the interrupted save must survive; :func:`predict_restored_step`
turns that into the one step a correct restorer may pick.
"""

from __future__ import annotations

from dataclasses import dataclass

from ckpt_lesson.short_repr import short_repr

__all__ = ["POINTS", "SHARDED_ONLY", "STORE_POINTS", "KillPlan", "RunConfig", "predict_restored_step"]

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
    "manifest_rot": False,
}
#: Kill points that exist only in the sharded layout.
SHARDED_ONLY = {"after_shards"}
#: Kill points of a run that saves to a bucket (``chaos --store``), with the same meaning.
#: The local save is only staging there: killed once it is published locally ("staged"), the
#: save is lost like one killed mid-part. "mid_upload": every block of a part is up, the
#: multipart upload not completed; "manifest_uploaded": before the conditional marker;
#: "committed": right after it; "uploaded": lease removed, local copy not yet;
#: "store_retention": an old save's marker deleted by retention, its parts not yet.
STORE_POINTS: dict[str, bool] = {
    "mid_part": False,
    "staged": False,
    "mid_upload": False,
    "manifest_uploaded": False,
    "committed": True,
    "uploaded": True,
    "store_retention": True,
    "between_saves": True,
    "bitrot": False,
    "manifest_rot": False,
}


@dataclass(frozen=True)
class KillPlan:
    """Where to kill one process: at ``point`` of the save of ``step`` (or after ``step``).

    ``arg`` is the byte count for ``mid_part`` and the shard count for ``after_shards``.
    """

    __repr__ = short_repr  # one short line: see ckpt_lesson/short_repr.py

    step: int
    point: str
    arg: int = 0


@dataclass(frozen=True)
class RunConfig:
    """One simulated run; every process of it uses the same settings."""

    __repr__ = short_repr  # one short line: see ckpt_lesson/short_repr.py

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
    survives = POINTS[plan.point] if plan.point in POINTS else STORE_POINTS[plan.point]
    if plan.point == "between_saves":
        newest = plan.step - plan.step % every_steps
    else:
        newest = plan.step if survives else plan.step - every_steps
    return newest if newest >= every_steps else None
