"""The cases of lesson 03's grader: a bit-for-bit resume, then broken files refused.

The learner's ``save_checkpoint(model, optimizer, scheduler, state, path)``
writes a dict with ``"schema": "lesson.v1"`` and the five buckets ``model``,
``optimizer``, ``scheduler``, ``state`` and ``rng``. The grader reads that file
back with ``torch.load(weights_only=True)``, checks that it was written the
way lesson 02 teaches (a temp file, fsynced, renamed onto the target: a
``torch.save`` straight onto the path would lose the last checkpoint to a
crash mid-save), and writes broken copies of it (a
bucket missing, no schema, an unknown schema, the file cut in half, a pickle
that runs code when fully unpickled). ``load_checkpoint`` must refuse each one
with a ``ValueError`` (the malicious one with any exception) and leave the
model's weights untouched: validate everything, then apply.
"""

from __future__ import annotations

import io
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ckpt_lesson.course.grading import _Case, _short, _Watch
from ckpt_lesson.course.training import (
    SyntheticRegression,
    make_model,
    make_optimizer_and_scheduler,
    seed_everything,
    train,
)
from ckpt_lesson.files.checkpoint import BUCKETS, TrainState
from ckpt_lesson.files.rng import capture_rng_state, restore_rng_state

__all__ = ["LESSON_SCHEMA", "round_trip_cases"]

#: The schema name the exercise's files carry.
LESSON_SCHEMA = "lesson.v1"

_SEED, _TOTAL, _CUT, _BATCH = 7, 16, 8, 16


def _build() -> tuple[Any, ...]:
    seed_everything(_SEED)
    data = SyntheticRegression(n=64, seed=_SEED)
    model = make_model()
    optimizer, scheduler = make_optimizer_and_scheduler(model, total_steps=_TOTAL)
    return data, model, optimizer, scheduler


def _weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


class _Malicious:
    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self) -> tuple[Any, ...]:
        return (io.open, (self.marker, "w"))  # the full unpickler would create the marker file


def round_trip_cases(folder: Path) -> list[_Case]:
    """The grader's cases, in order; files go under ``folder``.

    The global generators and torch's thread count are put back after each case.
    """
    saved_rng, threads = capture_rng_state(), torch.get_num_threads()
    data, model, optimizer, scheduler = _build()
    baseline = TrainState()
    train(model, optimizer, scheduler, baseline, data, until_step=_TOTAL, seed=_SEED, batch_size=_BATCH)
    restore_rng_state(saved_rng)
    torch.set_num_threads(threads)
    path = folder / "step8.pt"
    raw: dict[str, Any] = {}
    saves: list[tuple[str, str, str]] = []  # fsyncs and renames while save_checkpoint ran

    def tidy(call: Callable[[Any], Any]) -> Callable[[Any], Any]:
        def wrapped(fns: Any) -> Any:
            rng, n = capture_rng_state(), torch.get_num_threads()
            try:
                return call(fns)
            finally:
                restore_rng_state(rng)
                torch.set_num_threads(n)

        return wrapped

    def resume(fns: Any) -> Any:
        save, load = fns
        data, model, optimizer, scheduler = _build()
        state = TrainState()
        train(model, optimizer, scheduler, state, data, until_step=_CUT, seed=_SEED, batch_size=_BATCH)
        saved = (state.step, state.epoch, state.batch_in_epoch, list(state.losses))
        with _Watch() as watch:
            save(model, optimizer, scheduler, state, path)
        saves.extend(watch.events)
        data, model, optimizer, scheduler = _build()  # a fresh process builds everything anew
        loaded = load(path, model, optimizer, scheduler)
        if not isinstance(loaded, TrainState):
            return f"load_checkpoint returned {_short(loaded, 60)}; return the saved TrainState"
        if (loaded.step, loaded.epoch, loaded.batch_in_epoch, list(loaded.losses)) != saved:
            return f"load_checkpoint returned {_short(loaded, 90)}; expected the state saved at step {_CUT}"
        train(model, optimizer, scheduler, loaded, data, until_step=_TOTAL, seed=_SEED, batch_size=_BATCH)
        for step, (a, b) in enumerate(zip(baseline.losses, loaded.losses, strict=True), start=1):
            if a != b:
                return (
                    f"the loss at step {step} is {b!r}, the uninterrupted run's {a!r}: restore all five "
                    "buckets "
                    "(optimizer moments, the schedule and every generator too)"
                )
        return None

    def raw_file(fns: Any) -> Any:
        try:
            payload = torch.load(path, weights_only=True)
        except Exception as exc:  # the finding: the learner's file is refused by the safe loader
            return (
                f"torch.load(weights_only=True) refused your file ({type(exc).__name__}); save plain values"
            )
        if not isinstance(payload, dict):
            return f"the file holds {type(payload).__name__}; save a dict"
        missing = [k for k in ("schema", *BUCKETS) if k not in payload]
        if missing:
            return f"the file lacks {missing}; save 'schema' and the five buckets {list(BUCKETS)}"
        if payload["schema"] != LESSON_SCHEMA:
            return f"the file's schema is {payload['schema']!r}; write {LESSON_SCHEMA!r}"
        raw.update(payload)
        return None

    def atomically(fns: Any) -> Any:
        onto = [e for e in saves if e[0] == "rename" and Path(e[2]) == path]
        if not onto:
            return (
                f"wrote {path.name} in place, never renaming a temp file onto it: a crash mid-save destroys "
                "the last checkpoint; save through your atomic_save from 02"
            )
        if ("fsync", "file", "") not in saves[: saves.index(onto[-1])]:
            return "renamed a temp file onto the checkpoint without fsyncing it first (02's atomic_save does)"
        return None

    cases = [
        _Case(
            f"[save at step {_CUT}, load into fresh objects, train to step {_TOTAL}]",
            tidy(resume),
            lambda g: g,
        ),
        _Case(
            f"[the saved file, read with torch.load(weights_only=True)] holds schema {LESSON_SCHEMA!r} and "
            "the five "
            "buckets",
            raw_file,
            lambda g: g,
        ),  # fmt: skip
        _Case(
            f"[save_checkpoint(..., {path.name!r}) writes a temp file, fsyncs it, renames it]",
            atomically,
            lambda g: g,
        ),
    ]
    variants: list[tuple[str, Callable[[Path], None], bool]] = []
    for bucket in BUCKETS:
        variants.append((f"the '{bucket}' bucket missing", _without(raw, bucket), True))
    variants.append(("no 'schema' key", _without(raw, "schema"), True))
    variants.append(
        ("schema 'lesson.v9' (written by a newer version)", _with(raw, "schema", "lesson.v9"), True)
    )
    variants.append(("the file cut in half (a crash mid-write)", _cut_in_half(path), True))
    marker = folder / "CODE_WAS_RUN"
    variants.append(
        ("a pickle that runs code when fully unpickled", _with(raw, "extras", _Malicious(marker)), False)
    )
    for i, (label, write, value_error) in enumerate(variants):
        cases.append(_refusal_case(label, folder / f"broken-{i}.pt", write, value_error, marker))
    return cases


def _without(raw: dict[str, Any], key: str) -> Callable[[Path], None]:
    return lambda p: torch.save({k: v for k, v in raw.items() if k != key}, p)


def _with(raw: dict[str, Any], key: str, value: Any) -> Callable[[Path], None]:
    return lambda p: torch.save({**raw, key: value}, p)


def _cut_in_half(source: Path) -> Callable[[Path], None]:
    def write(p: Path) -> None:
        data = source.read_bytes()
        p.write_bytes(data[: len(data) // 2])

    return write


def _refusal_case(
    label: str, path: Path, write: Callable[[Path], None], value_error: bool, marker: Path
) -> _Case:
    def call(fns: Any) -> Any:
        _, load = fns
        write(path)
        _, model, optimizer, scheduler = _build()
        before = _weights(model)
        try:
            load(path, model, optimizer, scheduler)
            outcome = "returned"
        except NotImplementedError:
            raise
        except ValueError:
            outcome = "ValueError"
        except Exception as exc:  # judged below: the type matters
            outcome = type(exc).__name__
        after = model.state_dict()
        changed = [k for k in before if not torch.equal(before[k], after[k])]
        return outcome, changed

    def judge(got: Any) -> str | None:
        outcome, changed = got
        if marker.exists():
            return "loading ran code from the file (load with torch.load(..., weights_only=True))"
        if outcome == "returned":
            return "loaded it without complaint; refuse it with a ValueError"
        if value_error and outcome != "ValueError":
            return f"raised {outcome}; raise a ValueError (or a subclass) that names the file and the cause"
        if changed:
            return (
                f"raised, but only after changing the model ({changed[:2]}): validate everything first, "
                "then apply"
            )
        return None

    return _Case(f"[{label}] load_checkpoint(path, model, optimizer, scheduler)", call, judge)
