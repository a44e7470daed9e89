"""``log_step``: report each training step to ``resume-test``, for free otherwise.

``python -m ckpt_lesson resume-test`` runs a training script several times,
kills it, restarts it, and compares what every run did step by step. To do
that it needs to *see* the steps. One call per step in the training loop is
enough::

    from ckpt_lesson import log_step

    for batch in loader:
        loss = train_step(batch)
        step += 1
        log_step(step, loss.item(), sample_ids=batch_ids)

The tool names a file in the environment variable :data:`STEP_LOG_ENV`; each
call appends one JSON line to it. When the variable is unset (every ordinary
run) the call returns at once: one dictionary lookup, no file, no validation.

Why a file and not stdout: a script's output is its own business (progress
bars, warnings, other tools parsing it), and a line on stdout may sit in a
buffer when the process is killed. One ``write`` on a file opened with
``O_APPEND`` reaches the kernel before the call returns, so a line written is
a line the tool will read, even if the process dies one instruction later.

This module imports nothing but the standard library: it must cost nothing in
a script that never runs under the tool.
"""

from __future__ import annotations

import json
import operator
import os
import time
from collections.abc import Iterable
from typing import Any

__all__ = ["CKPT_DIR_ENV", "STEP_LOG_ENV", "log_step", "rng_fingerprint"]

#: Names the file ``log_step`` appends to; set by ``resume-test`` for each run it starts.
STEP_LOG_ENV = "CKPT_LESSON_STEP_LOG"
#: The fresh checkpoint folder ``resume-test`` gives each run (also passed as ``{ckpt_dir}``).
CKPT_DIR_ENV = "CKPT_LESSON_CKPT_DIR"

# One descriptor per process, opened on first use. Keyed by path so that a test (or a
# script) that changes the variable gets a new file rather than writing into the old one.
_open_log: dict[str, int] = {}


def log_step(step: int, loss: Any, sample_ids: Iterable[Any] | None = None, **metrics: Any) -> None:
    """Append one step's record to the file named by ``$CKPT_LESSON_STEP_LOG``, if set.

    Args:
        step: The step just completed (an int >= 0; a 0-d tensor or NumPy int is fine).
        loss: The step's loss (anything ``float()`` accepts, e.g. ``loss.item()``).
        sample_ids: Optional ids of the samples this step trained on (ints or
            strings; a tensor or array is converted with ``tolist()``).
            ``resume-test`` requires them to match the uninterrupted run
            exactly, which is how it tells "the data position was lost" from
            "the random state was lost".
        **metrics: Other numbers to compare (e.g. ``lr=sched.get_last_lr()[0]``).

    Raises:
        CheckpointError: Only while the variable is set: a step that is not an
            int >= 0, a loss or metric that is not a number, or sample ids that
            are not ints or strings. Nothing is written then.

    Example:
        >>> log_step(1, 0.25)  # outside resume-test: does nothing
        >>> log_step(2, 0.24, sample_ids=[4, 17], lr=1e-3)  # doctest: +SKIP
    """
    path = os.environ.get(STEP_LOG_ENV)
    if not path:
        return
    record: dict[str, Any] = {"step": _as_step(step), "loss": _as_number(loss, "loss")}
    if sample_ids is not None:
        record["sample_ids"] = _as_ids(sample_ids)
    if metrics:
        record["metrics"] = {str(k): _as_number(v, k) for k, v in metrics.items()}
    record["rng"] = rng_fingerprint()
    record["t"] = time.time()
    line = (json.dumps(record, separators=(",", ":")) + "\n").encode("utf-8")
    fd = _open_log.get(path)
    if fd is None:
        # Imported here for the same reason as in _fail. open_beside follows no symlink and
        # never blocks on a FIFO planted at the log's name (the script would hang before step 1).
        from ckpt_lesson.files.side_files import open_beside

        fd = open_beside(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
        _open_log[path] = fd
    os.write(fd, line)


def rng_fingerprint() -> dict[str, str]:
    """Short digests of the global random generators' states, for ``resume-test``'s diagnosis.

    ``log_step`` records them with every step. When a resumed run goes wrong at its first step on
    the same samples, comparing digests tells "the RNG stream was not restored" (digests differ),
    "restored but drawn in another order" (a digest equals the baseline's one step later) and
    "something else is missing" (digests equal) apart. It covers ``random``'s global generator, and
    torch's and NumPy's global CPU generators when the script has imported them (looked up in
    ``sys.modules``: this module never imports them itself). A private ``torch.Generator`` is
    invisible here, and ``random`` is seeded from the OS unless the script seeds it: the tool
    trusts only a generator whose digests repeat from run to run and change from step to step.

    Returns:
        Generator name -> 8 hex digits (``random`` always; ``torch``, ``numpy`` when imported).

    Example:
        >>> sorted(rng_fingerprint())[-1]
        'random'
    """
    import random
    import sys
    import zlib

    # hash() of a tuple of ints is the same in every process (only str/bytes hashes are salted;
    # hash(None), in the state's last slot, is an address before Python 3.12: left out).
    version, internal, gauss = random.getstate()
    out = {"random": f"{zlib.crc32(f'{version}:{hash(internal)}:{gauss!r}'.encode()):08x}"}
    torch = sys.modules.get("torch")
    if torch is not None and hasattr(torch, "get_rng_state"):
        try:
            out["torch"] = f"{zlib.crc32(torch.get_rng_state().numpy().tobytes()):08x}"
        except Exception:  # a half-imported or stubbed torch: the other generators still count
            pass
    numpy = sys.modules.get("numpy")
    if numpy is not None and hasattr(getattr(numpy, "random", None), "get_state"):
        try:
            _, keys, pos, *_ = numpy.random.get_state()
            out["numpy"] = f"{zlib.crc32(keys.tobytes() + str(pos).encode()):08x}"
        except Exception:
            pass
    return out


def _fail(message: str) -> None:
    # Imported here, not at the top: see the module docstring (an error is the rare path).
    from ckpt_lesson.errors import CheckpointError

    raise CheckpointError(message)


def _as_step(step: Any) -> int:
    try:
        value = operator.index(step.item() if hasattr(step, "item") else step)
        if isinstance(step, bool) or value < 0:
            raise ValueError
    except (TypeError, ValueError):
        _fail(f"log_step: step must be an int >= 0, got {step!r}; pass the training step counter.")
    return value


def _as_number(value: Any, name: str) -> float:
    try:
        number = float(value)
    except (TypeError, ValueError):
        _fail(f"log_step: {name} must be a number (e.g. loss.item()), got {type(value).__name__}.")
    # NaN and inf are kept: a run that blew up must be compared as one. Strict JSON has no
    # spelling for them; Python's json writes NaN/Infinity and reads them back, which is all we need.
    return number


def _as_ids(ids: Any) -> list[Any]:
    if hasattr(ids, "tolist"):
        ids = ids.tolist()
    if isinstance(ids, (str, bytes)):
        _fail("log_step: sample_ids must be a list of ids, not one string.")
    try:
        items = list(ids)
    except TypeError:
        _fail(f"log_step: sample_ids must be a list of ints or strings, got {type(ids).__name__}.")
    out: list[Any] = []
    for item in items:
        try:
            if isinstance(item, bool):
                raise TypeError
            out.append(item if isinstance(item, str) else operator.index(item))
        except TypeError:
            _fail(f"log_step: sample ids must be ints or strings, got {item!r}.")
    return out
