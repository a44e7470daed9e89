"""``resume-test --lose-machine``: every restart runs on a "new machine".

A spot instance that is reclaimed takes its local disk with it. The restart
happens elsewhere: a fresh working directory, an empty ``HOME``, ``TMPDIR``
and caches, and no checkpoint folder, unless the checkpoints lived outside the
machine (in a bucket). This module simulates exactly that between a kill and
its restart, and then judges each restart:

* the killed run had saves only on the machine (the local checkpoint folder),
  and the restart began from scratch: **FAIL**, the checkpoints were inside the
  failure domain that was lost;
* the store (an ``s3://...`` URL in the command) held committed saves at the
  kill, and the restart resumed instead of starting over: the resume survived
  the loss of the machine;
* the store held saves but the restart started over anyway: **FAIL**.

The command may name a per-run store prefix with ``{run_id}`` (``baseline``,
``trial-01``, ...), so each run starts from an empty prefix, as each gets an
empty ``{ckpt_dir}``.
"""

from __future__ import annotations

import shutil
from dataclasses import replace
from pathlib import Path
from typing import Any

from ckpt_lesson.errors import CheckpointError
from ckpt_lesson.files.storage import is_store_url, open_storage
from ckpt_lesson.runs.scan import published_steps
from ckpt_lesson.runs.store_commit import committed_steps

__all__ = ["FAILURE_DOMAIN", "judge_lost_machine", "lose_machine", "machine_for"]

FAILURE_DOMAIN = (
    "the machine: after each kill the restart ran in a fresh working directory with fresh HOME, "
    "TMPDIR and cache folders, and without the local checkpoint folder"
)
#: Variables that point at per-machine state; each new machine gets its own empty folder for them.
_MACHINE_VARS = ("HOME", "TMPDIR", "XDG_CACHE_HOME", "TORCH_HOME", "HF_HOME", "PIP_CACHE_DIR")


def _store_urls(command: tuple[str, ...]) -> list[str]:
    return [arg for arg in command if is_store_url(arg)]


def machine_for(spec: Any, folder: Path, ckpt_dir: Path, index: int) -> Any:
    """The :class:`RunSpec` one attempt runs with: ``{run_id}`` filled in; a restart under
    ``--lose-machine`` also gets a fresh working directory, ``HOME``, ``TMPDIR`` and caches.

    Files named in the command that exist (the training script, its config) are
    made absolute first: the code ships with the new machine's image, the local
    state does not.

    Example:
        >>> machine_for(spec, Path("w/trial-01/attempt-2"), Path("w/trial-01/ckpt"), 2).cwd  # doctest: +SKIP
        PosixPath('w/trial-01/attempt-2/machine/cwd')
    """
    run_id = ckpt_dir.parent.name
    command = tuple(arg.replace("{run_id}", run_id) for arg in spec.command)
    if not getattr(spec, "lose_machine", False) or index == 1:
        return replace(spec, command=command)
    machine = folder / "machine"
    absolute = []
    for arg in command:
        path = spec.cwd / arg
        inside_run = ckpt_dir.parent in path.resolve().parents
        absolute.append(str(path.resolve()) if path.is_file() and not inside_run else arg)
    env = dict(spec.env)
    for name in _MACHINE_VARS:
        env[name] = str(machine / name.lower())
        (machine / name.lower()).mkdir(parents=True, exist_ok=True)
    (machine / "cwd").mkdir(parents=True, exist_ok=True)
    return replace(spec, command=tuple(absolute), cwd=machine / "cwd", env=env)


def lose_machine(ckpt_dir: Path, attempt: Any, spec: Any) -> dict[str, Any]:
    """After a kill: note what survives (the store's committed saves), then wipe the local folder.

    Sets and returns ``attempt.machine_loss``: ``lost_saves`` (published local
    steps), ``lost_files``, ``store`` (URL or ``None``) and ``durable_saves``.
    """
    lost = published_steps(ckpt_dir) if ckpt_dir.is_dir() else []
    files = sum(1 for p in ckpt_dir.rglob("*") if p.is_file()) if ckpt_dir.is_dir() else 0
    stores = _store_urls(tuple(a.replace("{run_id}", ckpt_dir.parent.name) for a in spec.command))
    durable: list[int] = []
    if stores:
        try:
            durable = committed_steps(open_storage(stores[0]))
        except CheckpointError as exc:  # unreachable: the restart will say so; the verdict notes it
            durable = []
            attempt.store_error = str(exc)
    shutil.rmtree(ckpt_dir, ignore_errors=True)
    attempt.machine_loss = {
        "lost_saves": lost,
        "lost_files": files,
        "store": stores[0] if stores else None,
        "durable_saves": durable,
    }
    return attempt.machine_loss


def _judge_restart(loss: dict[str, Any], first: int | None, base_first: int) -> tuple[str, str]:
    durable, lost = loss["durable_saves"], loss["lost_saves"] or loss["lost_files"]
    if first is None:
        return "untested", "the restart reported no step"
    scratch = first <= base_first
    if durable and scratch:
        return "fail", f"the store held step {max(durable)}, but the restart started from scratch"
    if durable:
        return "ok", f"resumed from the store (newest committed step {max(durable)}) on a fresh machine"
    if lost:
        return "fail", (
            "the checkpoints lived on the machine that was lost (the local checkpoint folder): "
            f"the restart began again at step {first}"
        )
    return "untested", "no save existed yet when the machine was lost"


def judge_lost_machine(trials: list[Any], base_first: int) -> dict[str, Any]:
    """The ``failure_domain`` section of the report: one judgement per kill, and a verdict.

    Returns:
        ``{"tested", "store", "kills": [...], "verdict": "PASS"|"FAIL"|"UNTESTED", "explanation"}``.
    """
    kills, stores = [], set()
    for trial in trials:
        for killed, restart in zip(trial.attempts, trial.attempts[1:], strict=False):
            loss = getattr(killed, "machine_loss", None)
            if killed.kill is None or loss is None:
                continue
            stores.add(loss["store"])
            first = restart.records[0].step if restart.records else None
            status, why = _judge_restart(loss, first, base_first)
            kills.append({"trial": trial.plan.index, "restart_first_step": first, "status": status,
                          "why": why, **loss})  # fmt: skip
    statuses = {k["status"] for k in kills}
    verdict = "FAIL" if "fail" in statuses else "PASS" if "ok" in statuses else "UNTESTED"
    store = next((s for s in stores if s), None)
    if verdict == "FAIL" and store is None:
        explanation = (
            "the checkpoints lived on the machine that was lost. A folder on the same disk is no "
            "backup of that disk: save to an object store (--ckpt-dir s3://BUCKET/PREFIX) so a "
            "replacement machine can resume."
        )
    elif verdict == "FAIL":
        explanation = (
            f"{store} held committed saves, but a restart on a fresh machine did not resume from them."
        )
    elif verdict == "PASS":
        explanation = f"every restart on a fresh machine resumed from {store}."
    else:
        explanation = "no kill came after a save; nothing about the failure domain was tested."
    return {"tested": FAILURE_DOMAIN, "store": store, "kills": kills, "verdict": verdict,
            "explanation": explanation}  # fmt: skip


def format_failure_domain(section: dict[str, Any]) -> str:
    """A few lines for the text report."""
    lines = [f"failure domain tested: {section['tested']}.",
             f"durable copy: {section['store'] or 'none (checkpoints only on the machine)'}"]  # fmt: skip
    for k in section["kills"]:
        lines.append(f"  trial {k['trial']}: {k['status']}: {k['why']}")
    lines.append(f"lose-machine verdict: {section['verdict']}: {section['explanation']}")
    return "\n".join(lines)
