"""Which key goes to which shard: pure planning, no disk.

:mod:`ckpt_lesson.files.sharded` writes what these functions decide. Keeping the
plan pure means every layout can be tested (and taught, in notebook 04) on plain
dicts, with no file written.
"""

from __future__ import annotations

from typing import Any

import torch

from ckpt_lesson.errors import CheckpointError
from ckpt_lesson.files.payload import BINDING_KEY
from ckpt_lesson.files.shard_index import LAYOUTS, TENSOR_REF

__all__ = ["plan_optimizer_shards", "plan_shards", "pull_tensors", "shard_keys_by_prefix"]


def _check_plan_args(num_shards: Any, layout: Any) -> None:
    if isinstance(num_shards, bool) or not isinstance(num_shards, int) or num_shards < 1:
        raise CheckpointError(f"num_shards must be an int >= 1, got {num_shards!r}.")
    if layout not in LAYOUTS:
        raise CheckpointError(f"unknown shard layout {layout!r}; choose one of {LAYOUTS}.")
    if layout == "param_group" and num_shards < 2:
        raise CheckpointError(
            "layout 'param_group' puts weights and biases/buffers in separate shards, so it needs "
            f"num_shards >= 2 (got {num_shards}); pass more shards or use layout='round_robin'."
        )


def _nbytes(value: Any) -> int:
    return value.numel() * value.element_size() if isinstance(value, torch.Tensor) else 0


def _balance(keys: list[str], sizes: dict[str, int], n: int, order: dict[str, int]) -> list[list[str]]:
    # Greedy largest-first into the currently lightest shard: simple, and within
    # one largest tensor of the best split. Ties go to the lower shard index.
    shards: list[list[str]] = [[] for _ in range(n)]
    load = [0] * n
    for key in sorted(keys, key=lambda k: (-sizes[k], order[k])):
        lightest = min(range(n), key=lambda i: (load[i], i))
        shards[lightest].append(key)
        load[lightest] += sizes[key]
    return [sorted(s, key=order.__getitem__) for s in shards]


def plan_shards(state_dict: dict[str, Any], num_shards: int, layout: str = "round_robin") -> list[list[str]]:
    """Decide which keys go to which shard; pure, touches no disk.

    ``round_robin`` sends key ``i`` (in ``state_dict`` order) to shard
    ``i % num_shards``: trivial, but shard sizes follow whatever order the keys
    happen to be in. ``param_group`` gives weights (keys ending in ``weight``)
    the first ``ceil(num_shards / 2)`` shards and biases plus buffers the other
    ``floor(num_shards / 2)``, then balances each group by tensor bytes.

    Args:
        state_dict: Key -> tensor, e.g. ``model.state_dict()``.
        num_shards: How many shard files (some may be empty for a tiny model).
        layout: One of :data:`LAYOUTS`.

    Returns:
        ``num_shards`` lists of keys; every key appears exactly once, and within
        a shard keys keep their ``state_dict`` order.

    Raises:
        CheckpointError: Bad ``num_shards`` or ``layout``.

    Example:
        >>> plan_shards({"a.weight": torch.zeros(4), "a.bias": torch.zeros(1)}, 2, "param_group")
        [['a.weight'], ['a.bias']]
    """
    _check_plan_args(num_shards, layout)
    keys = list(state_dict)
    if layout == "round_robin":
        return [keys[i::num_shards] for i in range(num_shards)]
    order = {k: i for i, k in enumerate(keys)}
    sizes = {k: _nbytes(v) for k, v in state_dict.items()}
    weights = [k for k in keys if k.endswith("weight")]
    others = [k for k in keys if not k.endswith("weight")]
    n_weights = (num_shards + 1) // 2
    return _balance(weights, sizes, n_weights, order) + _balance(others, sizes, num_shards - n_weights, order)


def shard_keys_by_prefix(state_dict: dict[str, Any], num_shards: int) -> dict[int, list[str]]:
    """The lesson's layout helper: ``{shard: [keys]}``, round robin over the *sorted* keys.

    Key ``j`` of ``sorted(state_dict)`` goes to shard ``j % num_shards``, so
    shard sizes (in keys) differ by at most one and the answer does not depend
    on the order the model registered its parameters. Every shard index from
    ``0`` to ``num_shards - 1`` is present, possibly with an empty list. (The
    name is the lesson's; :func:`plan_shards` is the layout engine
    :func:`save_sharded_checkpoint` uses, in ``state_dict`` order.)

    Args:
        state_dict: Key -> value, e.g. ``model.state_dict()``.
        num_shards: How many shards, an int >= 1.

    Returns:
        A dict from shard index to that shard's keys, in ascending key order.

    Raises:
        CheckpointError: ``num_shards`` is not an int >= 1 (a ``ValueError``, as in the lesson).

    Example:
        >>> shard_keys_by_prefix({"c": 0, "a": 0, "b": 0}, 2)
        {0: ['a', 'c'], 1: ['b']}
    """
    return dict(enumerate(plan_shards(dict.fromkeys(sorted(state_dict)), num_shards)))  # round robin


def plan_optimizer_shards(optimizer_sd: dict[str, Any], plan: list[list[str]]) -> list[list[int]]:
    """Send each parameter's optimizer state to the shard that holds the parameter.

    AdamW keeps two moments per parameter: two thirds of a checkpoint's bytes.
    Left in one file they would serialize the save behind that file; placed next
    to their parameter they spread as evenly as the weights do, and a shard
    holds everything about its parameters. The parameter names come from the
    binding record :func:`~ckpt_lesson.files.payload.optimizer_state_with_bindings`
    adds to each param group; state of a parameter without a name (or without a
    shard) goes round robin by its id.

    Args:
        optimizer_sd: An optimizer ``state_dict`` as built into a payload.
        plan: The model keys of each shard, from :func:`plan_shards`.

    Returns:
        One list of parameter ids per shard, each id exactly once. All lists
        are empty when the state is keyed by anything but ints (then it stays
        in ``meta.pt``).

    Example:
        >>> sd = {"state": {0: {}, 1: {}}, "param_groups": [{"params": [0, 1],
        ...       BINDING_KEY: {"param_names": ["b.weight", "a.weight"]}}]}
        >>> plan_optimizer_shards(sd, [["a.weight"], ["b.weight"]])
        [[1], [0]]
    """
    state = optimizer_sd.get("state")
    out: list[list[int]] = [[] for _ in plan]
    if not isinstance(state, dict) or not all(type(k) is int for k in state):
        return out
    shard_of = {key: i for i, keys in enumerate(plan) for key in keys}
    name_of: dict[int, Any] = {}
    for group in optimizer_sd.get("param_groups") or []:
        binding = group.get(BINDING_KEY) if isinstance(group, dict) else None
        names = binding.get("param_names") if isinstance(binding, dict) else None
        if isinstance(names, list):
            name_of.update(zip(group.get("params") or [], names, strict=False))
    for pid in state:
        shard = shard_of.get(name_of.get(pid))
        out[pid % len(plan) if shard is None else shard].append(pid)
    return out


def pull_tensors(tree: Any, out: dict[str, torch.Tensor]) -> Any:
    """``tree`` with every tensor moved into ``out`` under a fresh key and a placeholder left behind."""
    if isinstance(tree, torch.Tensor):
        key = f"t{len(out):06d}"
        out[key] = tree
        return {TENSOR_REF: key}
    if isinstance(tree, dict):
        copy = type(tree)() if type(tree) is not dict else {}
        for k, v in tree.items():
            copy[k] = pull_tensors(v, out)
        return copy
    if isinstance(tree, (list, tuple)):
        items = [pull_tensors(v, out) for v in tree]
        return items if isinstance(tree, list) else tuple(items)
    return tree
