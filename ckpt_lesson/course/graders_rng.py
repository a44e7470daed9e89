"""Grader for lesson 01's exercise: capture and restore every random number generator.

``check_rng(capture_rng_state, restore_rng_state)``: the snapshot must survive
a weights-only round trip (``torch.save`` then ``torch.load(weights_only=True)``),
and every generator a training step touches must replay the same numbers
after a restore from that round-tripped copy. The grader leaves the global
generators as it found them (:class:`Untouched`).
"""

from __future__ import annotations

import io
import random
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from ckpt_lesson.course.grading import GradeResult, _Case, _grade, _short, exception_text
from ckpt_lesson.course.training import make_model
from ckpt_lesson.files.rng import capture_rng_state, restore_rng_state

__all__ = ["Untouched", "check_rng"]


class Untouched:
    """Put the global generators back after grading, whatever the learner's code did."""

    def __enter__(self) -> None:
        self.saved = capture_rng_state()

    def __exit__(self, *exc: object) -> None:
        restore_rng_state(self.saved)


# ---------------------------------------------------------------- 01 capture and restore every generator


def _weights_only_copy(snapshot: Any) -> Any:
    buffer = io.BytesIO()
    torch.save(snapshot, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def _draws() -> dict[str, Callable[[], Any]]:
    """One draw per kind of random number a training step uses, by name."""
    model = make_model()  # built once: only its dropout masks draw below
    data = torch.utils.data.TensorDataset(torch.arange(8))

    def dropout() -> list[float]:
        model.train()
        with torch.no_grad():
            return model(torch.ones(2, 8)).flatten().tolist()

    def shuffled() -> list[list[int]]:
        loader = torch.utils.data.DataLoader(data, batch_size=4, shuffle=True)
        return [b[0].tolist() for b in loader]

    draws: dict[str, Callable[[], Any]] = {
        "python random.random()": lambda: [random.random() for _ in range(3)],
        "python random.gauss() (second of a cached pair)": lambda: [random.gauss(0, 1) for _ in range(3)],
        "numpy np.random.rand()": lambda: np.random.rand(3).tolist(),
        "numpy np.random.normal() (second of a cached pair)": lambda: np.random.normal(size=1).tolist(),
        "torch.rand()": lambda: torch.rand(3).tolist(),
        "torch.randperm()": lambda: torch.randperm(10).tolist(),
        "DataLoader(shuffle=True) batches": shuffled,
        "dropout masks in model(x)": dropout,
    }
    if torch.cuda.is_available():
        draws["torch.rand(device='cuda')"] = lambda: torch.rand(3, device="cuda").tolist()
    return draws


def check_rng(
    capture: Callable[[], Any], restore: Callable[[Any], None], *, verbose: bool = True
) -> GradeResult:
    """Grade a ``capture_rng_state() -> snapshot`` / ``restore_rng_state(snapshot)`` pair.

    The snapshot goes through ``torch.save`` and ``torch.load(weights_only=True)``
    before every restore (a checkpoint is loaded that way). For each kind of draw,
    with seeds from ``random.Random(0)``: seed, draw once (so Python's and NumPy's
    cached second Gaussian is set), capture, draw, restore the loaded copy, draw
    again: the two draws must be equal. A restore must also work twice from one
    snapshot, and a snapshot taken many draws ago must still restore exactly.

    Example:
        >>> from ckpt_lesson.files.rng import capture_rng_state, restore_rng_state
        >>> check_rng(capture_rng_state, restore_rng_state, verbose=False).passed
        True
    """
    seeds = random.Random(0)
    with Untouched():
        draws = _draws()
        cases = [_weights_only_case()]
        cases += [_replay_case(label, draw, seeds.randrange(2**31)) for label, draw in draws.items()]
        cases.append(_twice_case(draws, seeds.randrange(2**31)))
        cases.append(_long_ago_case(draws, seeds.randrange(2**31)))
        return _grade("check_rng", "capture_rng_state/restore_rng_state", (capture, restore), cases, verbose)


def _seed_all(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def _weights_only_case() -> _Case:
    def call(fns: tuple[Callable[..., Any], ...]) -> Any:
        snapshot = fns[0]()
        try:
            _weights_only_copy(snapshot)
        except Exception as exc:  # the finding: which type the restricted unpickler refused
            return ("refused", exception_text(exc))
        return ("ok", None)

    def judge(got: Any) -> str | None:
        if got[0] == "refused":
            return (
                f"torch.load(weights_only=True) refused the snapshot ({got[1]}); store only tensors and "
                "plain Python values (an ndarray needs .tolist())"
            )
        return None

    return _Case(
        "[the snapshot survives torch.save + torch.load(weights_only=True)] capture_rng_state()", call, judge
    )


def _replay_case(label: str, draw: Callable[[], Any], seed: int) -> _Case:
    def call(fns: tuple[Callable[..., Any], ...]) -> Any:
        capture, restore = fns
        _seed_all(seed)
        draw()  # leaves the cached second Gaussian of Python and NumPy set
        snapshot = _weights_only_copy(capture())
        first = draw()
        restore(snapshot)
        return first, draw()

    def judge(got: Any) -> str | None:
        first, again = got
        return (
            None if first == again else f"drew {_short(first, 70)} before, {_short(again, 70)} after restore"
        )

    return _Case(f"[{label}] capture, draw, restore the weights-only copy, draw again", call, judge)


def _twice_case(draws: dict[str, Callable[[], Any]], seed: int) -> _Case:
    def everything() -> list[Any]:
        return [draw() for draw in draws.values()]

    def call(fns: tuple[Callable[..., Any], ...]) -> Any:
        capture, restore = fns
        _seed_all(seed)
        snapshot = _weights_only_copy(capture())
        restore(snapshot)
        first = everything()
        restore(snapshot)
        return first, everything()

    def judge(got: Any) -> str | None:
        first, again = got
        return (
            None if first == again else "a second restore from the same snapshot replayed different numbers"
        )

    return _Case("[one snapshot restored twice (does restore change the snapshot?)]", call, judge)


def _long_ago_case(draws: dict[str, Callable[[], Any]], seed: int) -> _Case:
    def call(fns: tuple[Callable[..., Any], ...]) -> Any:
        capture, restore = fns
        _seed_all(seed)
        snapshot = _weights_only_copy(capture())
        first = [draw() for draw in draws.values()]
        for _ in range(50):  # training goes on for a while before the crash
            [draw() for draw in draws.values()]
        restore(snapshot)
        return first, [draw() for draw in draws.values()]

    def judge(got: Any) -> str | None:
        first, again = got
        for label, a, b in zip(draws, first, again, strict=True):
            if a != b:
                return f"{label}: drew {_short(a, 60)} at capture time, {_short(b, 60)} after restore"
        return None

    return _Case("[a snapshot taken 50 rounds of draws before the restore]", call, judge)
