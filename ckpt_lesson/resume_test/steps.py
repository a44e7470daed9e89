"""Reading the steps a training process reports, while it runs.

Two sources, one result (a list of :class:`StepRecord`):

* the JSON lines that :func:`~ckpt_lesson.runs.steplog.log_step` appends to
  the file ``resume-test`` names in ``$CKPT_LESSON_STEP_LOG``;
* the process's stdout, matched line by line against ``--step-pattern``, for
  scripts that cannot be edited (they usually print ``step 12 loss 0.53``).

Both files grow while the process runs and may end in half a line when it is
killed, so :class:`LineTail` hands out only complete lines and keeps the rest
for the next read. A line that does not parse is counted, never fatal: a
script's stdout is full of other things.
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ckpt_lesson.errors import CheckpointError

__all__ = ["LineTail", "StepPattern", "StepReader", "StepRecord", "parse_hook_line"]

#: One read takes at most this much of a file: a runaway log must not eat the tool's memory.
MAX_READ_BYTES = 8 * 1024 * 1024


@dataclass(frozen=True)
class StepRecord:
    """One step as a training process reported it.

    Attributes:
        step: The step number.
        loss: Its loss (may be NaN or inf: a run that blew up is compared as one).
        sample_ids: The ids of the samples it trained on, when reported.
        metrics: Other numbers reported with it.
        t: Wall-clock time (``time.time()``) when it was reported.
        rng: Digests of the global generators after the step (``log_step`` only; see
            :func:`~ckpt_lesson.runs.steplog.rng_fingerprint`): evidence for the diagnosis, never
            compared for the verdict.
    """

    step: int
    loss: float
    sample_ids: tuple[Any, ...] | None = None
    metrics: dict[str, float] = field(default_factory=dict)
    t: float = 0.0
    rng: dict[str, str] | None = None

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"step": self.step, "loss": self.loss}
        if self.sample_ids is not None:
            out["sample_ids"] = list(self.sample_ids)
        if self.metrics:
            out["metrics"] = dict(self.metrics)
        return out


class LineTail:
    """Complete new lines of a file another process appends to.

    Args:
        path: The file; it may not exist yet (nothing is read then).

    Example:
        >>> tail = LineTail("run/steps.jsonl")  # doctest: +SKIP
        >>> tail.read_lines()  # doctest: +SKIP
        ['{"step":1,"loss":0.5,"t":1700000000.0}']
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._offset = 0
        self._partial = b""

    def read_lines(self, *, final: bool = False) -> list[str]:
        """Lines completed since the last call; ``final=True`` also returns a last unterminated line."""
        try:
            with open(self.path, "rb") as f:
                f.seek(self._offset)
                chunk = f.read(MAX_READ_BYTES)
        except FileNotFoundError:
            return []
        self._offset += len(chunk)
        data = self._partial + chunk
        *lines, self._partial = data.split(b"\n")
        if final and self._partial:
            lines.append(self._partial)
            self._partial = b""
        return [line.decode("utf-8", errors="replace").rstrip("\r") for line in lines]


def _as_float(value: Any) -> float:
    # NaN and inf are accepted on purpose: a run that blew up must be compared as one.
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"not a number: {value!r}")
    return float(value)


def parse_hook_line(line: str) -> StepRecord | None:
    """Parse one line written by ``log_step``; ``None`` when it is not a valid record.

    Example:
        >>> parse_hook_line('{"step": 3, "loss": 0.5, "t": 1.0}').step
        3
        >>> parse_hook_line("not json") is None
        True
    """
    try:
        data = json.loads(line)
    except ValueError:
        return None
    if not isinstance(data, dict):
        return None
    step = data.get("step")
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        return None
    try:
        loss = _as_float(data.get("loss"))
    except (TypeError, ValueError):
        return None
    ids = data.get("sample_ids")
    if ids is not None and not (isinstance(ids, list) and all(isinstance(i, (int, str)) for i in ids)):
        return None
    metrics: dict[str, float] = {}
    raw = data.get("metrics") or {}
    if not isinstance(raw, dict):
        return None
    for key, value in raw.items():
        try:
            metrics[str(key)] = _as_float(value)
        except (TypeError, ValueError):
            return None
    t = data.get("t")
    when = float(t) if isinstance(t, (int, float)) and not isinstance(t, bool) else time.time()
    rng = data.get("rng")
    if not (isinstance(rng, dict) and all(isinstance(v, str) for v in rng.values())):
        rng = None
    return StepRecord(step, loss, None if ids is None else tuple(ids), metrics, when, rng)


class StepPattern:
    """``--step-pattern``: read step and loss from lines of a script's output.

    The pattern is searched in every line. Named groups ``step`` and ``loss``
    are used when present, else the first two groups; any other named group
    becomes a metric (e.g. ``(?P<lr>[0-9.e-]+)``).

    Args:
        pattern: A Python regular expression.

    Raises:
        CheckpointError: The pattern does not compile, or has neither the named
            groups nor at least two groups.

    Example:
        >>> StepPattern(r"step (\\d+) loss ([0-9.]+)").parse("step 7 loss 0.25", 0.0).loss
        0.25
    """

    def __init__(self, pattern: str) -> None:
        try:
            self.regex = re.compile(pattern)
        except re.error as exc:
            raise CheckpointError(
                f"--step-pattern {pattern!r} is not a valid regular expression: {exc}."
            ) from exc
        names = self.regex.groupindex
        if "step" in names and "loss" in names:
            self._step: int | str = "step"
            self._loss: int | str = "loss"
        elif self.regex.groups >= 2 and not ("step" in names or "loss" in names):
            self._step, self._loss = 1, 2
        else:
            raise CheckpointError(
                f"--step-pattern {pattern!r} needs groups for the step and the loss: named "
                r"(?P<step>\d+) and (?P<loss>[0-9.eE+-]+), or two plain groups in that order."
            )
        self._metrics = [n for n in names if n not in ("step", "loss")]

    def parse(self, line: str, t: float) -> StepRecord | None:
        """The record in ``line``, or ``None`` when the pattern does not match or a value is not a number."""
        found = self.regex.search(line)
        if found is None:
            return None
        try:
            step = int(found.group(self._step))
            loss = float(found.group(self._loss))
            metrics = {n: float(found.group(n)) for n in self._metrics if found.group(n) is not None}
        except (TypeError, ValueError):
            return None
        if step < 0:
            return None
        return StepRecord(step, loss, None, metrics, t)


class StepReader:
    """New :class:`StepRecord` s from one run: its hook file, or its stdout with a pattern.

    Args:
        path: The hook's JSON-lines file, or the run's stdout log when ``pattern`` is given.
        pattern: ``None`` to read ``log_step`` records.

    Example:
        >>> reader = StepReader(Path("run/steps.jsonl"))  # doctest: +SKIP
        >>> [r.step for r in reader.poll()]  # doctest: +SKIP
        [1, 2, 3]
    """

    def __init__(self, path: Path, pattern: StepPattern | None = None) -> None:
        self.tail = LineTail(path)
        self.pattern = pattern
        #: Lines that looked like records but did not parse (hook mode only: stdout is mostly other text).
        self.bad_lines = 0

    def poll(self, *, final: bool = False) -> list[StepRecord]:
        """Records completed since the last call (``final=True`` after the process ended)."""
        now = time.time()
        out = []
        for line in self.tail.read_lines(final=final):
            if self.pattern is not None:
                record = self.pattern.parse(line, now)
            else:
                record = parse_hook_line(line) if line.strip() else None
                if record is None and line.strip():
                    self.bad_lines += 1
            if record is not None:
                out.append(record)
        return out
