"""Graders for the build-it-yourself exercises of lessons 04 and 05 (pure, in-process).

(Lesson 01's grader is in :mod:`ckpt_lesson.course.graders_rng`, 02's and 03's in
:mod:`ckpt_lesson.course.graders_disk`.)

* 04 ``check_plan_param_group(plan_param_group)``: a param-group shard plan,
  judged by its invariants (every key once, weights and the rest in separate
  shard groups, each group balanced at least as well as largest-first).
* 05 ``check_next_batch(next_batch_ids)``: the O(1) mid-epoch position,
  compared with the package on fixed and fixed-seed random positions, under a
  reseeded global generator (a fresh process) and counting permutations drawn.

Every grader leaves the global generators as it found them.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from typing import Any

import torch

from ckpt_lesson.course.graders_rng import Untouched
from ckpt_lesson.course.grading import GradeResult, _Case, _grade, _short
from ckpt_lesson.course.training import SyntheticRegression, next_batch_ids
from ckpt_lesson.files.checkpoint import TrainState
from ckpt_lesson.files.shard_plan import plan_shards

__all__ = ["check_next_batch", "check_plan_param_group"]


# ---------------------------------------------------------------- 04 a param-group shard plan


def _tensors(sizes: dict[str, int], dtypes: dict[str, torch.dtype] | None = None) -> dict[str, torch.Tensor]:
    # uint8 tensors unless told: a tensor of n elements is n bytes, and allocating them is cheap.
    # Sizes are always bytes; a float64 tensor of 800 bytes has 100 elements.
    out = {}
    for key, n in sizes.items():
        dtype = (dtypes or {}).get(key, torch.uint8)
        out[key] = torch.empty(n // torch.empty(0, dtype=dtype).element_size(), dtype=dtype)
    return out


# Mixed precision: counting elements instead of bytes puts the float64 weight on top of a float16 one.
_MIXED_SIZES = {"a.weight": 8000, "b.weight": 3000, "c.weight": 3000, "a.bias": 64, "b.bias": 16}
_MIXED_DTYPES = {"a.weight": torch.float64, "b.weight": torch.float16, "c.weight": torch.float16}


def _mlp_sizes() -> dict[str, int]:
    widths = [8, 256, 256, 128, 64, 1]
    sizes = {}
    for i, (a, b) in enumerate(zip(widths, widths[1:], strict=False)):
        sizes[f"{2 * i}.weight"], sizes[f"{2 * i}.bias"] = 4 * a * b, 4 * b
    return sizes


def _transformer_sizes(blocks: int = 24, d: int = 64) -> dict[str, int]:
    sizes = {"embed.weight": 4 * 1000 * d}
    for b in range(blocks):
        p = f"blocks.{b}."
        sizes |= {p + "ln1.weight": 4 * d, p + "ln1.bias": 4 * d, p + "attn.qkv.weight": 12 * d * d}
        sizes |= {p + "attn.qkv.bias": 12 * d, p + "attn.proj.weight": 4 * d * d, p + "attn.proj.bias": 4 * d}
        sizes |= {p + "ln2.weight": 4 * d, p + "ln2.bias": 4 * d, p + "mlp.fc1.weight": 16 * d * d}
        sizes |= {p + "mlp.fc1.bias": 16 * d, p + "mlp.fc2.weight": 16 * d * d, p + "mlp.fc2.bias": 4 * d}
    return sizes


def _batchnorm_sizes() -> dict[str, int]:
    return {
        "conv.weight": 4 * 64 * 3 * 9,
        "bn.weight": 256,
        "bn.bias": 256,
        "bn.running_mean": 256,
        "bn.running_var": 256,
        "bn.num_batches_tracked": 8,
        "head.weight": 4 * 64 * 10,
        "head.bias": 40,
    }


def check_plan_param_group(fn: Callable[..., Any], *, verbose: bool = True) -> GradeResult:
    """Grade a ``plan_param_group(state_dict, num_shards) -> list[list[str]]``.

    Judged by invariants, not by one exact answer: ``num_shards`` lists; every key
    exactly once; keys ending in ``weight`` only in the first ``ceil(num_shards / 2)``
    shards, all other keys only in the rest; in each group the heaviest shard (in bytes, with
    float64, float16 and uint8 tensors mixed in one case) no
    heavier than largest-first into the lightest shard gives
    (``plan_shards(..., "param_group")``); the input unchanged; ``num_shards < 2``
    raises ``ValueError``.

    Example:
        >>> from ckpt_lesson.course.solutions import plan_param_group
        >>> check_plan_param_group(plan_param_group, verbose=False).passed
        True
    """
    rng = random.Random(0)
    fixed: list[tuple[str, dict[str, int], int]] = [
        ("the notebook's MLP", _mlp_sizes(), n) for n in (2, 3, 4, 5, 8)
    ]
    fixed += [("24 transformer blocks of 12 tensors", _transformer_sizes(), n) for n in (4, 8)]
    fixed += [("conv + batch norm buffers", _batchnorm_sizes(), 4), ("an empty state_dict", {}, 4)]
    fixed += [("more shards than keys", {"a.weight": 40, "a.bias": 4}, 6)]
    cases = [
        _plan_case("float64 and float16 weights: balance bytes, not elements", _MIXED_SIZES, 3, _MIXED_DTYPES)
    ]
    for i in range(60):
        keys = [
            f"m{j}." + rng.choice(["weight", "bias", "running_mean", "scale"])
            for j in range(rng.randint(1, 30))
        ]
        fixed.append((f"random state_dict {i}", {k: rng.randint(1, 5000) for k in keys}, rng.randint(2, 9)))
    cases += [_plan_case(label, sizes, n) for label, sizes, n in fixed]
    for n in (1, 0):
        state_dict = _tensors(_mlp_sizes())
        cases.append(
            _Case(
                f"[num_shards={n}] plan_param_group(state_dict, {n})",
                lambda f, s=state_dict, n=n: f(s, n),
                lambda got: None,
                (ValueError,),
            )  # fmt: skip
        )
    return _grade("check_plan_param_group", "plan_param_group", fn, cases, verbose)


def _plan_case(
    label: str, sizes: dict[str, int], n: int, dtypes: dict[str, torch.dtype] | None = None
) -> _Case:
    state_dict = _tensors(sizes, dtypes)
    expected = plan_shards(state_dict, n, "param_group")
    n_weights = (n + 1) // 2

    def heaviest(groups: list[list[str]]) -> int:
        return max((sum(sizes[k] for k in g) for g in groups), default=0)

    def judge(got: Any) -> str | None:
        if list(state_dict) != list(sizes):
            return "modified the state_dict it was given"
        if not isinstance(got, list) or len(got) != n or not all(isinstance(g, list) for g in got):
            return f"returned {_short(got)}; return a list of {n} lists of keys"
        placed = [k for g in got for k in g]
        missing = [k for k in sizes if k not in placed]
        if missing:
            return f"key(s) {missing[:3]} are in no shard"
        doubled = sorted({k for k in placed if placed.count(k) > 1})
        if doubled or len(placed) != len(sizes):
            return f"key(s) {doubled[:3] or placed[:3]} appear more than once (or keys that do not exist)"
        for i, g in enumerate(got):
            wrong = [k for k in g if k.endswith("weight") != (i < n_weights)]
            if wrong:
                kind = "a weight shard" if i < n_weights else "a shard for biases and buffers"
                return f"shard {i} is {kind} but holds {wrong[:3]} (weights go to shards 0-{n_weights - 1})"
        for name, lo, hi in (("weight", 0, n_weights), ("bias/buffer", n_weights, n)):
            mine, best = heaviest(got[lo:hi]), heaviest(expected[lo:hi])
            if mine > best:
                return (
                    f"the heaviest {name} shard holds {mine} bytes; largest-first into the lightest shard "
                    f"gets it down to {best}"
                )
        return None

    return _Case(
        f"[{label}, {n} shards] plan_param_group(state_dict, {n})", lambda f: f(state_dict, n), judge
    )


# ---------------------------------------------------------------- 05 the O(1) mid-epoch position


class _CountingRandperm:
    """Count torch.randperm calls while a learner's function runs (a replay draws many)."""

    def __enter__(self) -> _CountingRandperm:
        self.real, self.calls = torch.randperm, 0

        def counting(*args: Any, **kwargs: Any) -> torch.Tensor:
            self.calls += 1
            return self.real(*args, **kwargs)

        torch.randperm = counting  # type: ignore[assignment]
        return self

    def __exit__(self, *exc: object) -> None:
        torch.randperm = self.real  # type: ignore[assignment]


_GLOBAL_MOVED = (
    "the right ids, but torch's global generator changed (torch.manual_seed, or a draw without "
    "generator=): reseeding it every batch gives every step of an epoch the same dropout mask; draw "
    "from a private torch.Generator().manual_seed(...) and leave the global one alone"
)


def check_next_batch(fn: Callable[..., Any], *, verbose: bool = True) -> GradeResult:
    """Grade a ``next_batch_ids(state, data, *, seed, batch_size) -> list[int]``.

    ``state`` is a :class:`TrainState` at (``epoch``, ``batch_in_epoch``); the
    function rolls it into the next epoch when this one is used up (a last
    partial batch is dropped) and returns the ids of the next batch, computed
    directly from ``(seed, epoch)``. Before every call the global torch
    generator is reseeded (a resumed process never has the old one), and after
    it that generator must be untouched: dropout draws from it, so a function
    that reseeds it gives every step the same mask. A position in epoch 40
    must be found drawing at most two permutations.

    Example:
        >>> from ckpt_lesson.course.training import next_batch_ids
        >>> check_next_batch(next_batch_ids, verbose=False).passed
        True
    """
    rng = random.Random(0)
    fixed = [
        ("the first batch", 64, 16, 0, 0),
        ("the middle of epoch 2", 64, 16, 2, 3),
        ("epoch 0 used up: roll into epoch 1", 64, 16, 0, 4),
        ("70 samples, batches of 16: the last 6 are dropped", 70, 16, 1, 4),
        ("the last full batch of 70 samples", 70, 16, 1, 3),
        ("batches of 1", 10, 1, 3, 9),
        ("one batch is the whole dataset", 12, 12, 5, 1),
        ("deep into a long run: epoch 40", 256, 16, 40, 7),
    ]
    randoms = []
    for i in range(40):
        n = rng.randint(1, 300)
        bs = rng.randint(1, n)
        randoms.append((f"random position {i}", n, bs, rng.randint(0, 50), rng.randint(0, n // bs)))
    seeds = iter(random.Random(1).randrange(2**31) for _ in range(10**6))
    with Untouched():
        cases: list[_Case] = [_position_case(*c, seed=11, reseed=next(seeds)) for c in [*fixed, *randoms]]
        cases += list(_sequential_cases(seeds))
        return _grade("check_next_batch", "next_batch_ids", fn, cases, verbose)


def _position_case(label: str, n: int, bs: int, epoch: int, batch: int, *, seed: int, reseed: int) -> _Case:
    data = range(n)  # the function needs only len(data)
    want_state = TrainState(epoch=epoch, batch_in_epoch=batch)
    want = next_batch_ids(want_state, data, seed=seed, batch_size=bs)  # type: ignore[arg-type]
    seen: dict[str, Any] = {}

    def call(f: Callable[..., Any]) -> Any:
        state = TrainState(epoch=epoch, batch_in_epoch=batch)
        torch.manual_seed(reseed)  # a resumed process: the global generator is not the old one
        before = torch.get_rng_state()
        with _CountingRandperm() as count:
            got = f(state, data, seed=seed, batch_size=bs)
        seen.update(state=state, draws=count.calls, moved=not torch.equal(before, torch.get_rng_state()))
        return got

    def judge(got: Any) -> str | None:
        if isinstance(got, torch.Tensor):
            got = got.tolist()
        if not isinstance(got, list):
            return f"returned {_short(got)}; return a list of sample ids"
        if got != want:
            return f"expected {_short(want, 80)}, got {_short(got, 80)}"
        state = seen["state"]
        if (state.epoch, state.batch_in_epoch) != (want_state.epoch, want_state.batch_in_epoch):
            return (
                f"left state at epoch {state.epoch}, batch {state.batch_in_epoch}; expected epoch "
                f"{want_state.epoch}, batch {want_state.batch_in_epoch} (only roll over; the loop counts "
                "batches)"
            )
        if seen["draws"] > 2:
            return (
                f"drew {seen['draws']} permutations for one batch: compute the epoch's order from (seed, "
                "epoch)"
            )
        if seen["moved"]:
            return _GLOBAL_MOVED
        return None

    describe = f"[{label}] next_batch_ids(TrainState(epoch={epoch}, batch_in_epoch={batch}), "
    return _Case(describe + f"data of {n} samples, seed={seed}, batch_size={bs})", call, judge)


def _sequential_cases(seeds: Iterator[int]) -> Iterator[_Case]:
    """Three epochs step by step, as the training loop calls it: the batches must match the package's."""
    n, bs, seed = 50, 8, 3
    data = SyntheticRegression(n=n, seed=seed)
    want_state, want = TrainState(), []
    for _ in range(3 * (n // bs)):
        want.append(next_batch_ids(want_state, data, seed=seed, batch_size=bs))
        want_state.batch_in_epoch += 1
    reseed = next(seeds)

    def call(f: Callable[..., Any]) -> Any:
        state, got = TrainState(), []
        for _ in range(len(want)):
            torch.manual_seed(reseed)
            ids = f(state, data, seed=seed, batch_size=bs)
            got.append(ids.tolist() if isinstance(ids, torch.Tensor) else ids)
            state.batch_in_epoch += 1
        return got

    def judge(got: Any) -> str | None:
        for i, (a, b) in enumerate(zip(want, got, strict=True)):
            if a != b:
                return f"step {i + 1}: expected {_short(a, 60)}, got {_short(b, 60)}"
        return None

    yield _Case(f"[three epochs step by step: {n} samples, batches of {bs}, seed {seed}]", call, judge)
