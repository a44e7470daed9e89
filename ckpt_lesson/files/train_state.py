"""Where training is: the counters a resume continues from, the buckets a resume needs, and the
check every positional call (``model, optimizer, scheduler``) passes its objects through.

Split out of :mod:`ckpt_lesson.files.checkpoint` (which re-exports every name)
so that saving, loading and applying can all share one definition.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from ckpt_lesson.errors import CheckpointError, StateMismatchError
from ckpt_lesson.short_repr import short_repr

__all__ = ["BUCKETS", "REQUIRES_KEY", "TrainState", "check_positional_objects"]

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
