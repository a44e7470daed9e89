"""Wrapped modules: one set of state-dict keys whether or not the model is compiled or DDP-wrapped.

``torch.compile(model)`` returns an ``OptimizedModule`` whose ``state_dict()``
prefixes every key with ``_orig_mod.``; ``DistributedDataParallel`` (and
``DataParallel``) prefix ``module.``. The weights are the same tensors, but a
save from the wrapped model no longer matches the plain one, and most training
scripts restore *before* they compile or wrap: the keys differ, and the
resume crash-loops.

So every save records the *canonical* keys (the unwrapped model's), and every
restore compares against and loads through the canonical keys. For a wrapped
model we ask torch itself: :func:`torch.distributed.checkpoint.state_dict.get_model_state_dict`
and :func:`~torch.distributed.checkpoint.state_dict.set_model_state_dict` give
and take wrapper-free names (they know compile, DDP, FSDP and activation
checkpointing). They are imported only when a model is wrapped: the import
costs about 0.8 s, and a plain module's own ``state_dict()`` already has the
canonical keys.

Optimizer state stays positional, as ``optimizer.state_dict()`` writes it
(parameter order does not depend on a wrapper). torch's optimizer helpers,
which key state by name, are not used on purpose: on an optimizer that has
not stepped yet, ``get_optimizer_state_dict`` runs a zero-learning-rate
``step()`` to create its state, which would change the run a save is meant to
record. Each parameter group instead records the canonical parameter names
(:func:`param_names`), and a restore compares them.

Saves written before this normalisation (keys all prefixed by one wrapper)
still restore: :func:`canonical_saved_keys` removes a prefix that *every* key
carries and that the live model lacks, and nothing else.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

__all__ = [
    "WRAPPER_PREFIXES",
    "canonical_saved_keys",
    "load_model_state",
    "model_state",
    "param_names",
    "unwrap",
]

#: Key prefixes that wrappers add, outermost first (what older saves of wrapped models carry).
WRAPPER_PREFIXES = ("module._orig_mod.", "_orig_mod.module.", "_orig_mod.", "module.")

_DATA_PARALLEL = ("DistributedDataParallel", "DataParallel")


def unwrap(module: Any) -> Any:
    """The module inside any compile / DDP / DataParallel wrappers (``module`` itself when plain).

    Example:
        >>> net = torch.nn.Linear(2, 2)
        >>> unwrap(net) is net
        True
    """
    while True:
        # By attribute: importing torch._dynamo's OptimizedModule to test isinstance costs ~1.8 s.
        if isinstance(getattr(module, "_orig_mod", None), torch.nn.Module):
            module = module._orig_mod
        elif type(module).__name__ in _DATA_PARALLEL and isinstance(
            getattr(module, "module", None), torch.nn.Module
        ):
            module = module.module
        else:
            return module


def model_state(module: Any) -> dict[str, Any]:
    """``module``'s state dict under canonical (wrapper-free) keys.

    Example:
        >>> sorted(model_state(torch.nn.Linear(2, 2)))
        ['bias', 'weight']
    """
    if unwrap(module) is module:  # plain: its own keys are canonical
        return module.state_dict()
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    return get_model_state_dict(module)


def load_model_state(module: Any, state: dict[str, Any]) -> None:
    """Load canonical-keyed ``state`` into ``module``, wrapped or not (strict: every key must match)."""
    if unwrap(module) is module:
        module.load_state_dict(state, strict=True)
        return
    from torch.distributed.checkpoint.state_dict import set_model_state_dict

    # set_model_state_dict renames keys in the dict it is given: hand it a shallow copy.
    set_model_state_dict(module, dict(state))


def param_names(module: Any) -> dict[int, str]:
    """``id(parameter) -> canonical name`` for every parameter of ``module``.

    Given the state API's ``{part: module}`` parts, the names are ``part.name``, as its optimizer
    bindings record them.
    """
    if isinstance(module, Mapping):
        return {i: f"{part}.{n}" for part, m in module.items() for i, n in param_names(m).items()}
    named = getattr(unwrap(module), "named_parameters", None)
    return {id(p): n for n, p in named()} if callable(named) else {}


def canonical_saved_keys(saved: dict[str, Any], live_keys: Any) -> dict[str, Any]:
    """``saved`` with a wrapper prefix removed when every key has it and the live keys do not.

    Args:
        saved: A model state dict read from a checkpoint.
        live_keys: The live model's canonical keys.

    Returns:
        ``saved`` itself when it already matches or no single wrapper prefix
        explains the difference; otherwise a new dict with the prefix removed.

    Example:
        >>> canonical_saved_keys({"_orig_mod.w": 1}, ["w"])
        {'w': 1}
    """
    live = set(live_keys)
    keys = list(saved)
    if not keys or set(keys) == live:
        return saved
    for prefix in WRAPPER_PREFIXES:
        if all(isinstance(k, str) and k.startswith(prefix) for k in keys):
            stripped = {k[len(prefix) :]: v for k, v in saved.items()}
            if set(stripped) == live:
                return stripped
    return saved
