"""Lesson 02's strongest case: a child process runs the learner's ``atomic_save`` and is SIGKILLed.

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

__all__ = ["kill_case"]


_PAYLOAD_OLD = {"step": 1, "w": torch.full((4,), 1.0)}


def _same(payload: Any, expected: dict[str, Any]) -> bool:
    return (
        isinstance(payload, dict)
        and payload.get("step") == expected["step"]
        and torch.equal(payload.get("w", torch.zeros(0)), expected["w"])
    )


_CHILD = """
from __future__ import annotations
import sys, time
from pathlib import Path
import torch

target, marker = sys.argv[1], Path(sys.argv[2])
STALL_AFTER = 64 * 1024  # bytes: then this simulated slow disk stalls until the kill

class StallingWriter:
    def __init__(self, inner):
        self.inner, self.written = inner, 0
    def write(self, data):
        n = memoryview(data).nbytes
        if self.written + n > STALL_AFTER:
            self.inner.flush()
            marker.touch()
            time.sleep(3600)
        self.written += n
        return self.inner.write(data)
    def flush(self):
        self.inner.flush()
    def __getattr__(self, name):
        return getattr(self.inner, name)

real_save = torch.save
def slow_disk_save(obj, f, *args, **kwargs):
    if isinstance(f, (str, Path)):
        with open(f, "wb") as fh:
            return real_save(obj, StallingWriter(fh), *args, **kwargs)
    return real_save(obj, StallingWriter(f), *args, **kwargs)
torch.save = slow_disk_save

# ---- the learner's function, as written ----
{source}
# ----
{name}({{"step": 2, "w": torch.full((2**18,), 2.0)}}, target)
print("the save returned without ever writing past the stall point")
"""


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
        script.write_text(_CHILD.format(source=source, name=f.__name__))
        proc = subprocess.Popen(
            [sys.executable, str(script), str(target), str(marker)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            deadline = time.monotonic() + 120
            while not marker.exists():
                if proc.poll() is not None:
                    out, err = proc.communicate()
                    last = (err.strip().splitlines() or out.strip().splitlines() or ["(no output)"])[-1]
                    return f"the child process ended before the kill: {last}"
                if time.monotonic() > deadline:
                    return "the child process never reached the slow-disk stall point"
                time.sleep(0.01)
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            for pipe in (proc.stdout, proc.stderr):
                if pipe is not None:
                    pipe.close()
        return None

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
