"""What a checkpoint is taken of: :class:`TrainState` (where training is), the :data:`BUCKETS` a resume
needs, the one check of the positional objects, and the canonical keys of wrapped modules.

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
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from ckpt_lesson.errors import CheckpointError, StateMismatchError
from ckpt_lesson.short_repr import short_repr

__all__ = [
    "BUCKETS",
    "REQUIRES_KEY",
    "WRAPPER_PREFIXES",
    "TrainState",
    "canonical_saved_keys",
    "check_positional_objects",
    "load_model_state",
    "model_state",
    "param_names",
    "unwrap",
]

#: Key in ``extras`` listing state that only a special loader restores.
REQUIRES_KEY = "requires"

#: The buckets a resume needs; a payload missing any of them is refused.
BUCKETS = ("model", "optimizer", "scheduler", "state", "rng")


@dataclass
class TrainState:
    """Where training is: the counters a resume continues from.

    Attributes:
        step: Optimizer steps completed.
        epoch: Current epoch (0-based).
        batch_in_epoch: Batches of ``epoch`` already consumed; the next batch
            to train on has this index.
        losses: One training loss per completed step.
    """

    __repr__ = short_repr  # one short line: see ckpt_lesson/short_repr.py

    step: int = 0
    epoch: int = 0
    batch_in_epoch: int = 0
    losses: list[float] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        """Plain-Python form, safe for a weights-only load."""
        return {**asdict(self), "losses": [float(x) for x in self.losses]}

    @classmethod
    def from_dict(cls, data: Any, *, source: str = "<state>") -> TrainState:
        """Validate and build; raises :class:`StateMismatchError` on bad input."""
        if not isinstance(data, dict):
            raise StateMismatchError(f"{source}: 'state' must be a dict, got {type(data).__name__}.")
        missing = [k for k in ("step", "epoch", "batch_in_epoch", "losses") if k not in data]
        if missing:
            raise StateMismatchError(f"{source}: 'state' lacks {missing}; re-save with save_checkpoint().")
        for key in ("step", "epoch", "batch_in_epoch"):
            value = data[key]
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise StateMismatchError(f"{source}: state[{key!r}] must be an int >= 0, got {value!r}.")
        if not isinstance(data["losses"], (list, tuple)) or not all(
            isinstance(x, (int, float)) and not isinstance(x, bool) for x in data["losses"]
        ):
            raise StateMismatchError(f"{source}: state['losses'] must be a list of floats.")
        return cls(data["step"], data["epoch"], data["batch_in_epoch"], [float(x) for x in data["losses"]])


#: What to use instead of the positional form, by the caller that refuses it.
MANAGER_STATE_API = "mgr.save(step, {'model': model}) and mgr.restore_latest({'model': model})"
FILE_STATE_API = "save_state(path, step, {'model': model}) and load_state(path, {'model': model})"


def check_positional_objects(
    model: Any, optimizer: Any, scheduler: Any, *, loading: bool, state_api: str, where: str = ""
) -> None:
    """Refuse what the positional form cannot save or restore, naming the part (the one check).

    Every positional call goes through here: the managers' ``save`` and
    ``restore_latest``, ``save_checkpoint`` / ``load_checkpoint`` and the sharded
    pair. A model and an optimizer are required; the scheduler may be ``None``
    (a run without one). Without this, ``None``, a dict of models or an object
    without ``state_dict()`` failed deep inside with an ``AttributeError``.

    Args:
        model, optimizer, scheduler: The objects passed.
        loading: Also require ``load_state_dict()`` (a save reads ``state_dict()``
            only: an asynchronous snapshot's stand-ins have nothing else).
        state_api: The state-API call to suggest instead (:data:`MANAGER_STATE_API`
            or :data:`FILE_STATE_API`).
        where: Prefix for the message (the file), or ``""``.

    Raises:
        CheckpointError: Naming the part, what it is, and what to pass instead.

    Example:
        >>> check_positional_objects(None, None, None, loading=False, state_api=FILE_STATE_API)
        Traceback (most recent call last):
        ...
        ckpt_lesson.errors.CheckpointError: model is None: the positional form needs ...
    """
    for name, value in (("model", model), ("optimizer", optimizer)):
        if value is None:
            raise CheckpointError(
                f"{where}{name} is None: the positional form needs a model and an optimizer; for a run "
                f"without one, use the state API: {state_api}."
            )
        if isinstance(value, dict):  # e.g. {"gen": gen, "disc": disc}: the state API's job
            raise CheckpointError(
                f"{where}{name} is a dict of {len(value)} entries, not one object with state_dict(); the "
                f"positional form takes one {name}. For several, give each its own part in the state API: "
                f"{state_api}, with one entry per object."
            )
        methods = ("state_dict", "load_state_dict") if loading else ("state_dict",)
        if not all(callable(getattr(value, m, None)) for m in methods):
            raise CheckpointError(
                f"{where}{name} is a {type(value).__name__}, which has no state_dict()/load_state_dict(); "
                f"pass the live {name}, or use the state API ({state_api}) for other kinds of state."
            )
    if scheduler is not None and not callable(getattr(scheduler, "state_dict", None)):
        raise CheckpointError(
            f"{where}scheduler is a {type(scheduler).__name__} without state_dict(); pass a scheduler "
            "or None."
        )


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
