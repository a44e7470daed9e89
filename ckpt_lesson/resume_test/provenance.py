"""The evidence record: what a resume-test result is about, so it can be kept beside a run.

A PASS is evidence about one version of the code, on one environment, under
one interruption scenario; after an important change it must be redone. So
the report carries, in its JSON and the head of its text:

* the **code version**: the git commit of the command's working folder and
  whether it had uncommitted changes, or, outside a repository, a hash of the
  command's script;
* the **environment**: Python, torch and CUDA versions of the interpreter the
  command names (asked directly when the command is a Python interpreter,
  else those of the interpreter running the tool, and labelled so);
* the **save** each restart resumed from: its step and save id (read from
  the manifest of a CheckpointManager save at the kill);
* the **kill scenario**: signal, kill points, trials, kills, seed, and
  whether the machine was lost.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any

__all__ = ["code_version", "environment", "evidence_record", "format_evidence", "resumed_saves"]

_PROBE = (
    "import json, platform, sys\n"
    "out = {'python': platform.python_version(), 'torch': None, 'cuda': None}\n"
    "try:\n"
    "    import torch\n"
    "    out['torch'] = torch.__version__; out['cuda'] = torch.version.cuda\n"
    "except Exception:\n"
    "    pass\n"
    "print(json.dumps(out))\n"
)


def _git(cwd: Path, *args: str) -> str | None:
    try:
        done = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout if done.returncode == 0 else None


def _script(command: list[str], cwd: Path) -> Path | None:
    """The command's script: the first argument naming an existing file (the program's if none)."""
    for arg in command[1:]:
        if not arg.startswith("-") and (cwd / arg).is_file():
            return cwd / arg
    program = Path(command[0])
    return program if program.is_file() and not program.name.startswith("python") else None


def code_version(command: list[str], cwd: Path) -> dict[str, Any]:
    """The git commit and dirty state of ``cwd``, else the sha256 of the command's script.

    Returns:
        ``{"kind": "git", "commit", "dirty", "folder", "script"}`` (``script``: the script's path
        and sha256, or ``None``), ``{"kind": "script", "path", "sha256"}`` or ``{"kind": "unknown"}``.

    Example:
        >>> code_version(["python", "train.py"], Path.cwd())["kind"] in ("git", "script", "unknown")
        True
    """
    script = _script(command, cwd)
    hashed = {}
    if script is not None:
        digest = hashlib.sha256()
        try:
            with open(script, "rb") as f:
                for chunk in iter(lambda: f.read(1 << 20), b""):
                    digest.update(chunk)
            hashed = {"path": str(script), "sha256": digest.hexdigest()}
        except OSError:
            hashed = {}
    commit = _git(cwd, "rev-parse", "HEAD")
    if commit:
        status = _git(cwd, "status", "--porcelain", "--untracked-files=no")
        dirty = bool(status and status.strip())
        return {"kind": "git", "commit": commit.strip(), "dirty": dirty, "folder": str(cwd),
                "script": hashed or None}  # fmt: skip
    return {"kind": "script", **hashed} if hashed else {"kind": "unknown"}


def environment(command: list[str], env: dict[str, str], cwd: Path) -> dict[str, Any]:
    """Python, torch and CUDA versions of the command's interpreter (or of this one, labelled).

    Example:
        >>> environment([sys.executable, "t.py"], dict(os.environ), Path.cwd())["source"]  # doctest: +SKIP
        'the command's interpreter'
    """
    if Path(command[0]).name.startswith("python"):
        try:
            done = subprocess.run([command[0], "-c", _PROBE], cwd=cwd, env=env, capture_output=True,
                                  text=True, timeout=120)  # fmt: skip
            found = json.loads(done.stdout.strip().splitlines()[-1])
            return {"source": "the command's interpreter", "interpreter": command[0], **found}
        except (OSError, subprocess.SubprocessError, ValueError, IndexError):
            pass
    torch = sys.modules.get("torch")
    return {"source": "the interpreter running resume-test (the command is not a Python interpreter)",
            "interpreter": sys.executable, "python": platform.python_version(),
            "torch": getattr(torch, "__version__", None),
            "cuda": getattr(getattr(torch, "version", None), "cuda", None)}  # fmt: skip


def resumed_saves(trials: list[Any], verdicts: list[Any]) -> list[dict[str, Any]]:
    """For each restart: the step it began at, the save it resumed from (step and id where known).

    The save's name and id come from the manifest of the newest CheckpointManager save at the kill,
    or for a run that saves to a store, from the newest COMMIT marker there
    (see :func:`~ckpt_lesson.resume_test.damage.newest_save` and ``newest_store_save``), when the
    restart resumed from its step.

    Returns:
        ``{"trial", "restart", "first_step", "resumed_from_step", "save", "save_id"}`` per restart.

    Example:
        >>> resumed_saves(trials, verdicts)[0]["resumed_from_step"]  # doctest: +SKIP
        30
    """
    out = []
    for trial, verdict in zip(trials, verdicts, strict=True):
        stats = {s.attempt: s for s in verdict.restarts}
        for killed, restart in zip(trial.attempts, trial.attempts[1:], strict=False):
            stat = stats.get(restart.index)
            newest = killed.kill.newest if killed.kill is not None else None
            step = stat.resumed_from if stat is not None and not stat.from_scratch else None
            known = newest is not None and step is not None and newest["step"] == step
            out.append({"trial": trial.plan.index, "restart": restart.index,
                        "first_step": stat.first_step if stat else None, "resumed_from_step": step,
                        "save": newest["name"] if known else None,
                        "save_id": newest["save_id"] if known else None})  # fmt: skip
    return out


def evidence_record(
    *, command: list[str], cwd: Path, env: dict[str, str], settings: dict[str, Any], lose_machine: bool
) -> dict[str, Any]:
    """Code version, environment and kill scenario, taken before the baseline runs.

    Example:
        >>> evidence_record(command=["python", "t.py"], cwd=Path.cwd(),  # doctest: +SKIP
        ...                 env=dict(os.environ), settings=settings, lose_machine=False)["code"]["kind"]
        'git'
    """
    scenario = {k: settings[k] for k in ("signal", "kill_at", "trials", "kills", "seed", "grace")}
    scenario["lose_machine"] = lose_machine
    return {"code": code_version(command, cwd), "environment": environment(command, env, cwd),
            "scenario": scenario, "resumed_from": []}  # fmt: skip


def format_evidence(record: dict[str, Any]) -> list[str]:
    """The text head's evidence lines."""
    code, envr, sc = record["code"], record["environment"], record["scenario"]
    if code["kind"] == "git":
        what = f"git {code['commit'][:12]}{' with uncommitted changes' if code['dirty'] else ''}"
    elif code["kind"] == "script":
        what = f"{os.path.basename(code['path'])} sha256 {code['sha256'][:16]}"
    else:
        what = "unknown (not a git folder, no script found)"
    versions = f"Python {envr['python']}, torch {envr['torch'] or 'none'}, CUDA {envr['cuda'] or 'none'}"
    if envr["source"] != "the command's interpreter":
        versions += " (resume-test's interpreter)"
    kills = f"{sc['trials']} trial(s) x {sc['kills']} kill(s), seed {sc['seed']}"
    lost = "; machine lost at every kill" if sc["lose_machine"] else ""
    lines = [
        f"code         {what}",
        f"environment  {versions}",
        f"scenario     SIG{sc['signal']} at {','.join(sc['kill_at'])}; {kills}{lost}",
    ]
    resumed = [r for r in record["resumed_from"] if r["resumed_from_step"] is not None]
    if resumed:
        shown = "; ".join(
            f"trial {r['trial']} run {r['restart']}: step {r['resumed_from_step']}"
            + (f" (save id {r['save_id'][:12]})" if r["save_id"] else "")
            for r in resumed[:4]
        )
        more = f" (+{len(resumed) - 4} more)" if len(resumed) > 4 else ""
        lines.append(f"resumed from {shown}{more}")
    return lines
