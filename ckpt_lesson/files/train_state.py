"""Where training is: the counters a resume continues from, and the buckets a resume needs.

Split out of :mod:`ckpt_lesson.files.checkpoint` (which re-exports every name)
so that saving, loading and applying can all share one definition.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from ckpt_lesson.errors import StateMismatchError
from ckpt_lesson.short_repr import short_repr

__all__ = ["BUCKETS", "REQUIRES_KEY", "TrainState"]

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
        out = asdict(self)
        out["losses"] = [float(x) for x in self.losses]
        return out

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
        return cls(
            step=data["step"],
            epoch=data["epoch"],
            batch_in_epoch=data["batch_in_epoch"],
            losses=[float(x) for x in data["losses"]],
        )
