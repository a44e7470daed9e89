"""Graders for one file on disk: verifying a part (notebook 08) and the v1 -> v2 migration (09).

Each ``check_*`` function takes the learner's function, runs it on fixed
hand-picked edge cases and on fixed-seed random cases (``random.Random(0)``:
the same cases on every machine), compares every answer with the package's
reference implementation and with the invariants the answer must keep, and
prints one line: PASS, FAIL with the first failing case (inputs, expected,
got), or NOT ATTEMPTED (the scaffold still raises ``NotImplementedError``).
Grading stops at the first failure: one clear counterexample teaches more than
a wall of them. The loop that runs the cases and prints the verdict is shared,
in :mod:`ckpt_lesson.course.grading`; the registry with hints and solutions is
in :mod:`ckpt_lesson.course.exercises`.
"""

from __future__ import annotations

import contextvars
import copy
import hashlib
import os
import random
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ckpt_lesson.course.grading import GradeResult, _Case, _first_difference, _grade, _short

__all__ = ["check_migration", "check_verify_part"]


# ---------------------------------------------------------------- verify a part (notebook 08)


def check_verify_part(fn: Callable[..., Any], *, verbose: bool = True) -> GradeResult:
    """Grade a ``verify_part(path, *, size, sha256) -> str | None`` (None = ok, else a reason).

    Files of random bytes are written to a private temp folder, some damaged
    after their size and sha256 were recorded (a byte flipped, truncated,
    extended, deleted). The answer must be ``None`` exactly when
    :func:`ckpt_lesson.files.verify.verify_part` says the file is fine, and a
    non-empty reason otherwise. The wording of the reason is yours.

    Example:
        >>> from ckpt_lesson.files.verify import verify_part
        >>> check_verify_part(verify_part, verbose=False).passed
        True
    """
    from ckpt_lesson.files.verify import verify_part as reference

    rng = random.Random(0)
    damages = [
        "intact",
        "flip",
        "truncate",
        "extend",
        "missing",
        "wrong recorded sha256",
        "wrong recorded size",
    ]
    plan = [(d, n) for d in damages for n in (0, 1, 64, 3000)]
    plan += [(rng.choice(damages), rng.randint(1, 200_000)) for _ in range(40)]
    with tempfile.TemporaryDirectory(prefix="ckpt-lesson-grader-") as tmp:
        cases = [_verify_case(reference, Path(tmp), i, damage, n, rng) for i, (damage, n) in enumerate(plan)]
        # A learner's exception may name the temp file; keep machine paths out of notebook output.
        scrub = lambda text: text.replace(tmp, "<tmp>")  # noqa: E731
        return _grade("check_verify_part", "verify_part", fn, cases, verbose, scrub)


def _verify_case(
    reference: Callable[..., Any], folder: Path, i: int, damage: str, n: int, rng: random.Random
) -> _Case:
    data = rng.randbytes(n)
    size, sha = len(data), hashlib.sha256(data).hexdigest()
    path = folder / f"part-{i:03d}.bin"
    where = rng.randrange(n) if n else 0
    if damage == "flip" and n:
        data = data[:where] + bytes([data[where] ^ 0x01]) + data[where + 1 :]
        damage = f"one bit flipped at byte {where} (same size)"
    elif damage == "truncate" and n:
        data = data[:where]
        damage = f"truncated to {where} bytes"
    elif damage == "extend":
        data = data + b"\x00"
        damage = "one byte appended"
    elif damage == "wrong recorded sha256":
        sha = hashlib.sha256(data + b"other").hexdigest()
    elif damage == "wrong recorded size":
        size = n + 1
    elif damage != "missing":
        damage = "intact"
    if damage != "missing":
        path.write_bytes(data)
    expected_ok = reference(path, size=size, sha256=sha) is None
    size_differs = damage != "missing" and len(data) != size
    describe = f"[a {n}-byte file, {damage}] verify_part(path, size={size}, sha256='{sha[:12]}...')"
    opened: list[str] = []

    def call(f: Callable[..., Any]) -> Any:
        opened.clear()
        with _watch_opens(path, opened):
            return f(path, size=size, sha256=sha)

    def judge(got: Any) -> str | None:
        if size_differs and opened:
            return (
                f"the file has {len(data)} bytes, not the recorded {size}, yet verify_part opened it; "
                "compare the size first (path.stat().st_size is free) and hash only when it matches"
            )
        if got is not None and not (isinstance(got, str) and got):
            return f"returned {_short(got)}; return None when the file is fine, else a non-empty reason"
        if expected_ok and got is not None:
            return f"the file is fine, but got the reason {got!r}"
        if not expected_ok and got is None:
            return "the file does not match its record, but got None (ok)"
        return None

    return _Case(describe, call, judge)


# Python's audit hooks (PEP 578) see every open() and os.open() in the process, whichever
# way the learner reads the file: that is how the grader knows a file was read, without
# replacing any function. A hook cannot be removed once added, so one hook is added on first
# use and stays idle (one context-variable lookup) unless a grader is watching a path.
_WATCH: contextvars.ContextVar[tuple[str, list[str]] | None] = contextvars.ContextVar(
    "ckpt_lesson_watch_opens", default=None
)
_HOOK_ADDED = False


def _on_audit(event: str, args: tuple[Any, ...]) -> None:
    if event != "open":
        return
    watch = _WATCH.get()
    if watch is None or not args or not isinstance(args[0], (str, bytes, os.PathLike)):
        return
    try:
        name = os.path.abspath(os.fsdecode(args[0]))
    except (TypeError, ValueError):
        return
    if name == watch[0]:
        watch[1].append(name)


class _watch_opens:
    """Record in ``opened`` every open of ``path`` made inside the ``with`` block."""

    def __init__(self, path: Path, opened: list[str]) -> None:
        self._target = (os.path.abspath(path), opened)
        self._token: contextvars.Token[tuple[str, list[str]] | None] | None = None

    def __enter__(self) -> None:
        global _HOOK_ADDED
        if not _HOOK_ADDED:
            sys.addaudithook(_on_audit)
            _HOOK_ADDED = True
        self._token = _WATCH.set(self._target)

    def __exit__(self, *exc: object) -> None:
        if self._token is not None:
            _WATCH.reset(self._token)


# ---------------------------------------------------------------- v1 -> v2 migration (notebook 09)


def check_migration(fn: Callable[..., Any], *, verbose: bool = True) -> GradeResult:
    """Grade a ``migrate_v1_to_v2(payload) -> dict`` against the reference in ``files.schema``.

    The answer must equal the reference's (every key, tensors bitwise), must
    be a new dict (the input stays unchanged, nested values included), and
    anything but a v1 payload must raise ``SchemaError`` (any ``ValueError``
    passes).

    Example:
        >>> from ckpt_lesson.files.schema import migrate_v1_to_v2
        >>> check_migration(migrate_v1_to_v2, verbose=False).passed
        True
    """
    from ckpt_lesson.files.schema import migrate_v1_to_v2 as reference

    rng = random.Random(0)
    cases = [
        _migration_case(reference, "a v1 payload", _v1_payload(rng)),
        _migration_case(reference, "a v1 payload without 'extras'", _v1_payload(rng, extras="absent")),
        _migration_case(reference, "a v1 payload with extras", _v1_payload(rng, extras={"note": "x"})),
        _migration_case(reference, "a v1 payload without a scheduler", _v1_payload(rng, scheduler=False)),
    ]
    for label, bad in [
        ("a v2 payload", {**_v1_payload(rng), "schema": "ckpt.v2"}),
        ("a payload with no schema", {k: v for k, v in _v1_payload(rng).items() if k != "schema"}),
        ("a ckpt.v9 payload", {**_v1_payload(rng), "schema": "ckpt.v9"}),
    ]:
        cases.append(
            _Case(f"[{label}] migrate_v1_to_v2(payload)", _caller(bad), lambda got: None, (ValueError,))
        )
    for i in range(40):
        extras = rng.choice(["absent", None, {"run": f"r{i}"}])
        cases.append(_migration_case(reference, f"random v1 payload {i}", _v1_payload(rng, extras=extras)))
    return _grade("check_migration", "migrate_v1_to_v2", fn, cases, verbose)


def _caller(payload: dict[str, Any]) -> Callable[[Callable[..., Any]], Any]:
    return lambda f: f(copy.deepcopy(payload))


def _v1_payload(rng: random.Random, *, extras: Any = None, scheduler: bool = True) -> dict[str, Any]:
    # Tensors from a private generator: grading never moves the global RNG a notebook seeded.
    g = torch.Generator().manual_seed(rng.randrange(2**31))
    rows = rng.randint(1, 4)
    weight, bias = torch.randn(rows, 3, generator=g), torch.randn(rows, generator=g)
    step = rng.randint(1, 500)
    payload: dict[str, Any] = {
        "schema": "ckpt.v1",
        "model": {"0.weight": weight, "0.bias": bias},
        "optimizer": {
            "state": {0: {"step": torch.tensor(float(step)), "exp_avg": torch.randn(rows, 3, generator=g)}},
            "param_groups": [{"lr": 0.01, "weight_decay": 0.01, "params": [0, 1]}],
        },
        "scheduler": {"last_epoch": step, "T_max": 500} if scheduler else None,
        "state": {"step": step, "epoch": step // 16, "batch_in_epoch": step % 16, "losses": [0.5] * 3},
        "rng": {"torch_cpu": torch.randint(0, 255, (16,), dtype=torch.uint8, generator=g), "python": [1, 2]},
        "wall_saved_at": 1_700_000_000.0 + step,
    }
    if extras != "absent":
        payload["extras"] = extras
    return payload


def _migration_case(reference: Callable[..., Any], label: str, payload: dict[str, Any]) -> _Case:
    expected = reference(copy.deepcopy(payload))
    given: dict[str, Any] = {}

    def call(f: Callable[..., Any]) -> Any:
        given["payload"] = copy.deepcopy(payload)
        return f(given["payload"])

    def judge(got: Any) -> str | None:
        if got is given["payload"]:
            return "returned the input dict itself; build a new dict so the caller's payload is unchanged"
        problem = _first_difference(payload, given["payload"], "payload")
        if problem is not None:
            return f"modified its input ({problem}); migrations must be pure"
        if not isinstance(got, dict):
            return f"returned {_short(got)}; return the new payload dict"
        return _first_difference(expected, got, "result")

    return _Case(f"[{label}] migrate_v1_to_v2(payload)", call, judge)
