"""Lesson 02's kill: a child process saves through a slow disk and is SIGKILLed mid-write.

Two children share one slow disk (``_SLOW_DISK``) and one launcher (``_run_and_kill``):
notebook 02's experiment (:func:`kill_mid_save`, 128 MiB saved naively or atomically) and the
grader's strongest case (:func:`kill_case`, the learner's own ``atomic_save``).

The child cannot import a function typed in a notebook cell, so it gets the
function as source text: :func:`~ckpt_lesson.course.kept_source.function_source`
collects ``fn``'s source with everything it names. The child
patches ``torch.save`` to pass every byte through a writer that stalls after
64 KiB (a simulated slow disk) and touches a marker file; the parent waits for
the marker, sends SIGKILL and then checks that the previous checkpoint still
loads, exactly as notebook 02 does for the package's own ``atomic_save``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ckpt_lesson.course.grading import _Case, _short
from ckpt_lesson.course.kept_source import function_source
from ckpt_lesson.errors import CheckpointError

__all__ = ["kill_case", "kill_mid_save"]


_PAYLOAD_OLD = {"step": 1, "w": torch.full((4,), 1.0)}


def _same(payload: Any, expected: dict[str, Any]) -> bool:
    return (
        isinstance(payload, dict)
        and payload.get("step") == expected["step"]
        and torch.equal(payload.get("w", torch.zeros(0)), expected["w"])
    )


# The slow disk every child runs: torch.save passes its bytes through a writer that stalls after
# STALL_AFTER bytes, touches the marker file and sleeps until the parent's SIGKILL arrives.
_SLOW_DISK = """
from __future__ import annotations
import sys, time
from pathlib import Path
import torch

target, marker = sys.argv[1], Path(sys.argv[2])
STALL_AFTER = {stall_after}  # bytes: then this simulated slow disk stalls until the kill

class StallingWriter:
    def __init__(self, inner):
        self.inner, self.written = inner, 0
    def write(self, data):
        n = memoryview(data).nbytes
        if self.written + n > STALL_AFTER:
            self.inner.flush()     # what was written so far reaches the file ...
            marker.touch()         # ... tell the parent we are mid-save ...
            time.sleep(3600)       # ... and wait for the kill
        self.written += n
        return self.inner.write(data)
    def flush(self):
        self.inner.flush()
    def __getattr__(self, name):
        return getattr(self.inner, name)

real_save = torch.save
def slow_disk_save(obj, f, *args, **kwargs):
    if isinstance(f, (str, Path)):  # torch.save(obj, "path") opens the file "wb" itself
        with open(f, "wb") as fh:
            return real_save(obj, StallingWriter(fh), *args, **kwargs)
    return real_save(obj, StallingWriter(f), *args, **kwargs)
torch.save = slow_disk_save
"""

# The grader's child: the learner's function, as source, saves step 2 over step 1.
_CHILD = (
    _SLOW_DISK
    + """
# ---- the learner's function, as written ----
{source}
# ----
{name}({{"step": 2, "w": torch.full((2**18,), 2.0)}}, target)
print("the save returned without ever writing past the stall point")
"""
)

# Notebook 02's child: 128 MiB of step 2 saved naively, or with yours("atomic_save").
_DEMO_CHILD = (
    _SLOW_DISK
    + """
payload = {{"step": 2, "weights": {{f"layer{{i}}": torch.full((2**21,), 2.0) for i in range(16)}}}}
if sys.argv[3] == "naive":
    torch.save(payload, target)  # naive, do not use: truncates the old file first
else:  # "atomic": your atomic_save once its check passed, the package's until then
    from ckpt_lesson.course.carry import yours
    yours("atomic_save")(payload, target)
"""
)


def kill_mid_save(mode: str, target: str | os.PathLike[str], *, timeout_s: float = 90) -> bool:
    """Notebook 02's experiment: a child process overwrites ``target`` and is SIGKILLed mid-write.

    The child (``slow_disk_child.py``, written beside ``target``) builds a 128 MiB checkpoint of
    step 2 and saves it over ``target`` through a simulated slow disk that stalls after 48 MiB;
    once it stalls, it is killed with SIGKILL: no handler, no ``finally``, no clean-up.

    Args:
        mode: ``"naive"`` (plain ``torch.save`` onto the path) or ``"atomic"`` (the learner's
            ``atomic_save`` once its check passed, the package's until then).
        target: The checkpoint to overwrite; its marker file is ``target`` with suffix ``.stalled``.
        timeout_s: How long to wait for the child to reach the stall point.

    Returns:
        True: the SIGKILL is what ended the child.

    Raises:
        CheckpointError: ``mode`` is neither, or the child ended or hung before the stall point
            (its last line of error output is in the message).

    Example:
        >>> kill_mid_save("naive", "ckpt_work/02_atomic_saves/naive.pt")  # doctest: +SKIP
        True
    """
    if mode not in ("naive", "atomic"):
        raise CheckpointError(f"kill_mid_save: mode {mode!r} is not 'naive' or 'atomic'; pass one of them.")
    target = Path(target)
    marker = target.with_suffix(".stalled")
    marker.unlink(missing_ok=True)  # a marker left by an earlier run would trigger the kill at once
    script = target.parent / "slow_disk_child.py"
    script.write_text(_DEMO_CHILD.format(stall_after=48 * 2**20))
    argv = [sys.executable, str(script), str(target), str(marker), mode]
    problem = _run_and_kill(argv, marker, timeout_s)
    if problem is not None:
        raise CheckpointError(f"{target.name}: the {mode} child was not killed mid-save: {problem}")
    return True


def _run_and_kill(argv: list[str], marker: Path, timeout_s: float) -> str | None:
    """Start the child, wait for its stall marker, SIGKILL it; ``None`` when the kill ended it, else why."""
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + timeout_s
        while not marker.exists():
            if proc.poll() is not None:
                out, err = proc.communicate()
                last = (err.strip().splitlines() or out.strip().splitlines() or ["(no output)"])[-1]
                return f"the child process ended before the kill: {last}"
            if time.monotonic() > deadline:
                return "the child process never reached the slow-disk stall point"
            time.sleep(0.01)
        os.kill(proc.pid, signal.SIGKILL)
        if proc.wait() != -signal.SIGKILL:
            return f"the child process ended with status {proc.returncode}, not by the SIGKILL"
        return None
    finally:
        if proc.poll() is None:  # never leave a sleeping child behind, whatever happened
            proc.kill()
            proc.wait()
        for pipe in (proc.stdout, proc.stderr):
            if pipe is not None:
                pipe.close()


def kill_case(folder: Path) -> _Case:
    """The case: write the previous checkpoint, start the child, kill it mid-write, judge what is left."""

    def call(f: Callable[..., Any]) -> Any:
        folder.mkdir()
        target, marker = folder / "ckpt.pt", folder.parent / "stalled"
        f(_PAYLOAD_OLD, target)  # the previous checkpoint, written by your function
        try:
            source = function_source(f)
        except (OSError, TypeError) as exc:
            return f"the grader could not read your function's source ({exc}); define it with def in a cell"
        script = folder.parent / "child.py"
        script.write_text(_CHILD.format(stall_after=64 * 1024, source=source, name=f.__name__))
        return _run_and_kill([sys.executable, str(script), str(target), str(marker)], marker, 120)

    def judge(got: str | None) -> str | None:
        if got is not None:
            return got
        try:
            payload = torch.load(folder / "ckpt.pt", weights_only=True)
        except Exception as exc:  # the finding: what the kill left
            return (
                f"after the kill, ckpt.pt no longer loads ({type(exc).__name__}): the last checkpoint is lost"
            )
        if not _same(payload, _PAYLOAD_OLD):
            return f"after the kill, ckpt.pt holds {_short(payload, 60)} instead of the previous checkpoint"
        return None

    return _Case("[a child process running your atomic_save is SIGKILLed mid-write]", call, judge)
