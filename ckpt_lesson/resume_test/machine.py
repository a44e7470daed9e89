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

The command may name a per-run store prefix with ``{run_id}`` (in an argument or
an environment variable): each run of each invocation gets its own
(``<session>-baseline``, ``<session>-trial-01``, ...), so each starts from an
empty prefix, as each gets an empty ``{ckpt_dir}``, also when the same command
is tested twice.

The new machine runs the command exactly as given: the interpreter the
command names is kept unresolved (a virtualenv's ``bin/python`` is a symlink
to the base interpreter, which does not see the virtualenv's packages), and
its working folder is a fresh copy of the one taken before the baseline
(:mod:`~ckpt_lesson.resume_test.image`). Files the command writes outside the
simulated machine are found by :mod:`~ckpt_lesson.resume_test.outside`: a real
lost machine would not have them, so with any of them the verdict is not PASS.
"""

from __future__ import annotations

import os
import shutil
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from ckpt_lesson.errors import CheckpointError
from ckpt_lesson.files.storage import is_store_url, open_storage
from ckpt_lesson.resume_test.image import install_image
from ckpt_lesson.runs.layout import published_steps
from ckpt_lesson.runs.store_commit import committed_steps

__all__ = [
    "FAILURE_DOMAIN", "judge_lost_machine", "lose_machine", "machine_for", "new_session_id", "run_id",
    "store_urls",
]  # fmt: skip

FAILURE_DOMAIN = (
    "the machine: after each kill the restart ran in a fresh working directory with fresh HOME, "
    "TMPDIR and cache folders, and without the local checkpoint folder"
)
#: Variables that point at per-machine state; each new machine gets its own empty folder for them.
_MACHINE_VARS = ("HOME", "TMPDIR", "XDG_CACHE_HOME", "TORCH_HOME", "HF_HOME", "PIP_CACHE_DIR")


#: URL schemes that name a service, not a checkpoint store (AWS_ENDPOINT_URL=http://... is not the store).
_NOT_STORES = ("http", "https", "ftp", "tcp", "ws", "wss")


def _is_store(value: str) -> bool:
    return is_store_url(value) and value.split("://", 1)[0].lower() not in _NOT_STORES


def store_urls(command: tuple[str, ...], env: dict[str, str] | None = None) -> list[str]:
    """Store URLs in the arguments (whole, or after ``=`` in ``--flag=URL``) and the environment values.

    Example:
        >>> store_urls(("python", "t.py", "--out_dir=s3://b/r"), {"AWS_ENDPOINT_URL": "http://h:9000"})
        ['s3://b/r']
    """
    found = []
    values = [a.split("=", 1)[1] if a.startswith("-") and "=" in a else a for a in command]
    for value in [*values, *(env or {}).values()]:
        if _is_store(value) and value not in found:
            found.append(value)
    return found


def new_session_id() -> str:
    """A prefix that makes ``{run_id}`` unique per invocation: UTC time and 4 random bytes.

    Example:
        >>> len(new_session_id())  # e.g. '20261205-174012-3fa2b7c1'
        24
    """
    return time.strftime("%Y%m%d-%H%M%S", time.gmtime()) + "-" + os.urandom(4).hex()


def run_id(spec: Any, ckpt_dir: Path) -> str:
    """This run's ``{run_id}``: the session's id and the run's folder name (``baseline``, ``trial-01``)."""
    session = getattr(spec, "session_id", "")
    return f"{session}-{ckpt_dir.parent.name}" if session else ckpt_dir.parent.name


def machine_for(spec: Any, folder: Path, ckpt_dir: Path, index: int) -> Any:
    """The :class:`RunSpec` one attempt runs with: ``{run_id}`` filled in (arguments and environment);
    a restart under ``--lose-machine`` also gets a new machine: a fresh copy of the working folder
    taken before the baseline, and fresh ``HOME``, ``TMPDIR`` and caches.

    The command itself is not changed: the interpreter it names stays as named
    (a virtualenv's ``bin/python`` must not become the base interpreter), and
    relative paths find the code and inputs in the copied working folder.

    Example:
        >>> machine_for(spec, Path("w/trial-01/attempt-2"), Path("w/trial-01/ckpt"), 2).cwd  # doctest: +SKIP
        PosixPath('w/trial-01/attempt-2/machine/cwd')
    """
    rid = run_id(spec, ckpt_dir)
    command = tuple(arg.replace("{run_id}", rid) for arg in spec.command)
    env = {k: v.replace("{run_id}", rid) for k, v in spec.env.items()}
    if not getattr(spec, "lose_machine", False) or index == 1:
        return replace(spec, command=command, env=env)
    machine = folder / "machine"
    for name in _MACHINE_VARS:
        env[name] = str(machine / name.lower())
        (machine / name.lower()).mkdir(parents=True, exist_ok=True)
    image = getattr(spec, "image", None)
    if image is not None:
        cwd = install_image(image, machine / "cwd")
    else:
        cwd = machine / "cwd"
        cwd.mkdir(parents=True, exist_ok=True)
    return replace(spec, command=command, cwd=cwd, env=env)


def lose_machine(ckpt_dir: Path, attempt: Any, spec: Any) -> dict[str, Any]:
    """After a kill: note what survives (the store's committed saves), then wipe the local folder.

    Sets and returns ``attempt.machine_loss``: ``lost_saves`` (published local
    steps), ``lost_files``, ``store`` (URL or ``None``) and ``durable_saves``.
    """
    lost = published_steps(ckpt_dir) if ckpt_dir.is_dir() else []
    files = sum(1 for p in ckpt_dir.rglob("*") if p.is_file()) if ckpt_dir.is_dir() else 0
    ran = machine_for(spec, ckpt_dir.parent, ckpt_dir, 1)  # {run_id} filled in, nothing created
    stores = store_urls(ran.command, ran.env)
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


def _judge_restart(
    loss: dict[str, Any], first: int | None, base_first: int, outside: list[str]
) -> tuple[str, str]:
    durable, lost = loss["durable_saves"], loss["lost_saves"] or loss["lost_files"]
    if first is None:
        return "untested", "the restart reported no step"
    scratch = first <= base_first
    if durable and scratch:
        return "fail", f"the store held step {max(durable)}, but the restart started from scratch"
    if durable and outside:
        return "unsure", (
            f"began at step {first}; the store held step {max(durable)}, but files written outside "
            "the machine were still there to resume from"
        )
    if durable:
        return "ok", f"resumed from the store (newest committed step {max(durable)}) on a fresh machine"
    if lost:
        return "fail", (
            "the checkpoints lived on the machine that was lost (the local checkpoint folder): "
            f"the restart began again at step {first}"
        )
    if outside and not scratch:
        return "unsure", (
            f"began at step {first} with no save in the checkpoint folder or a store: it resumed from "
            "files written outside the machine"
        )
    return "untested", "no save existed yet when the machine was lost"


def judge_lost_machine(trials: list[Any], base_first: int, outside: list[str] = ()) -> dict[str, Any]:
    """The ``failure_domain`` section of the report: one judgement per kill, and a verdict.

    Args:
        trials: Every trial, in order.
        base_first: The baseline's first step (a restart that begins there started from scratch).
        outside: Files the command wrote outside the simulated machine (see
            :mod:`~ckpt_lesson.resume_test.outside`): a real lost machine would not have them.

    Returns:
        ``{"tested", "store", "stores", "kills": [...], "outside_writes", "verdict", "explanation"}``;
        the verdict is ``"PASS"``, ``"FAIL"``, ``"INCONCLUSIVE"`` (files outside the machine) or
        ``"UNTESTED"``.

    Example:
        >>> judge_lost_machine([], base_first=1)["verdict"]
        'UNTESTED'
    """
    kills, stores = [], []
    outside = sorted(outside)
    for trial in trials:
        for killed, restart in zip(trial.attempts, trial.attempts[1:], strict=False):
            loss = getattr(killed, "machine_loss", None)
            if killed.kill is None or loss is None:
                continue
            if loss["store"] and loss["store"] not in stores:
                stores.append(loss["store"])
            first = restart.records[0].step if restart.records else None
            status, why = _judge_restart(loss, first, base_first, outside)
            kills.append({"trial": trial.plan.index, "restart_first_step": first, "status": status,
                          "why": why, **loss})  # fmt: skip
    statuses = {k["status"] for k in kills}
    store = stores[0] if stores else None
    if "fail" in statuses:
        verdict = "FAIL"
    elif outside:
        verdict = "INCONCLUSIVE"
    else:
        verdict = "PASS" if "ok" in statuses else "UNTESTED"
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
    elif verdict == "INCONCLUSIVE":
        shown = ", ".join(outside[:5]) + (f" and {len(outside) - 5} more" if len(outside) > 5 else "")
        explanation = (
            f"the command wrote outside the simulated machine: {shown}. A replacement machine would not "
            "have these files, but this tool never deletes files it did not create, so a restart could "
            "resume from them instead of the store. Write checkpoints to {ckpt_dir} or the store, and "
            "other files under the working folder or $TMPDIR, then run again."
        )
    elif verdict == "PASS":
        where = store if len(stores) == 1 else f"the store ({', '.join(stores)})"
        explanation = f"every restart on a fresh machine resumed from {where}."
    else:
        explanation = "no kill came after a save; nothing about the failure domain was tested."
    return {"tested": FAILURE_DOMAIN, "store": store, "stores": stores, "kills": kills,
            "outside_writes": outside, "verdict": verdict, "explanation": explanation}  # fmt: skip


def format_failure_domain(section: dict[str, Any]) -> str:
    """A few lines for the text report."""
    stores = section.get("stores") or ([section["store"]] if section["store"] else [])
    durable = stores[0] if len(stores) == 1 else "one prefix per run" if stores else None
    lines = [f"failure domain tested: {section['tested']}.",
             f"durable copy: {durable or 'none (checkpoints only on the machine)'}"]  # fmt: skip
    for k in section["kills"]:
        where = f" ({k['store']})" if len(stores) > 1 and k["store"] else ""
        lines.append(f"  trial {k['trial']}{where}: {k['status']}: {k['why']}")
    if section.get("outside_writes"):
        lines.append(f"written outside the machine: {', '.join(section['outside_writes'])}")
    lines.append(f"lose-machine verdict: {section['verdict']}: {section['explanation']}")
    return "\n".join(lines)
