"""What a :class:`~ckpt_lesson.runs.manager.CheckpointManager` is given, validated before it acts.

Its settings: a frozen, keyword-only dataclass checked in ``__post_init__``, so a
bad setting fails when the manager is built, not halfway through the first save
hours into a run.

Its two call forms: every manager takes the state API (``save(step, state)``,
``restore_latest(state)``) and the positional form the lesson's code uses
(``save(model, optimizer, scheduler, train_state)``,
``restore_latest(model, optimizer, scheduler)``). The positional form needs a
real model and optimizer: ``None`` there used to fail deep inside with an
``AttributeError``; now it is a :class:`~ckpt_lesson.errors.CheckpointError`
that says which argument and what to do instead, from the one check the file
pair uses too (:func:`~ckpt_lesson.files.train_state.check_positional_objects`).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ckpt_lesson.errors import CheckpointError
from ckpt_lesson.files.hashing import DEFAULT_ALGO, check_algo
from ckpt_lesson.files.train_state import MANAGER_STATE_API, TrainState, check_positional_objects
from ckpt_lesson.files.verify import verify_mode
from ckpt_lesson.runs.cost import validate_cadence
from ckpt_lesson.runs.retention import KeepLastK, RetentionPolicy
from ckpt_lesson.short_repr import short_repr

__all__ = [
    "EventHook",
    "ManagerConfig",
    "is_state_call",
    "positional_restore_args",
    "positional_save_args",
]

#: ``on_event(name, info)``: called at each stage of a save, in this order:
#: ``save_begin``, ``part_begin``, ``part_written`` (info has ``file``),
#: ``parts_complete``, ``manifest_written``, ``verified``, ``published``,
#: ``save_end``; then, on the retention thread (runs/retention.py), ``retention_delete``
#: (before each delete; info has ``step``) and ``retention_renamed`` (renamed aside);
#: and ``quarantined`` when publishing moved a damaged folder aside. For the
#: sharded layout the writer makes every file in one call, so there is one
#: ``part_begin`` (``file="*"``) and then one ``part_written`` per file.
EventHook = Callable[[str, dict[str, Any]], None]


def _plain_dict(value: Any, name: str) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise CheckpointError(f"{name} must be a dict or None, got {type(value).__name__}.")
    out = dict(value)
    try:  # fail now, in the constructor, not halfway through the first save
        json.dumps(out, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise CheckpointError(
            f"{name} must hold only JSON values (str, int, float, bool, list, dict): {exc}"
        ) from exc
    return out


@dataclass(frozen=True, kw_only=True)
class ManagerConfig:
    """Validated, immutable settings of a :class:`CheckpointManager`.

    The ones documented only here:

    * ``verify_on_save``: check the parts before publishing: ``"writer"``
      (default: every part complete at its recorded size; the digest was taken
      from the bytes written), ``"device"`` or ``True`` (evict the cached pages,
      then hash what the disk returns), ``False`` (no check; retention hashes
      the save before relying on it). See ``docs/performance.md``.
    * ``scrub_bytes_per_s``: after each retention pass, hash the other kept
      saves at this average rate in idle time (``None``: no scrub).
    * ``background_retention``: run retention on a background thread (default);
      ``False`` runs it inside ``save()``.
    * ``hash_algo``: integrity hash of every part (default ``xxh3_128``, fast;
      ``sha256`` or ``blake3`` when digests are pinned somewhere trusted).
    * ``zip_crc32``: keep the zip CRC32s ``torch.save`` writes (off: ``torch.load``
      never checks them and our digests cover the bytes); turn it on when other
      tools (``unzip -t``, ``zipfile``) must accept the files.

    Raises:
        CheckpointError: ``keep_last < 1``; ``every_steps < 1``; ``every_seconds <= 0``;
            neither cadence set; ``num_shards < 1``; ``data``/``metadata`` not JSON dicts;
            ``hash_algo`` not one of :data:`~ckpt_lesson.files.hashing.ALGORITHMS`;
            ``verify_on_save`` not True/False/"writer"/"device"; ``scrub_bytes_per_s <= 0``.

    Example:
        >>> ManagerConfig(keep_last=2, every_steps=10).num_shards is None
        True
    """

    __repr__ = short_repr  # one short line: see ckpt_lesson/short_repr.py

    keep_last: int = 3
    every_steps: int | None = None
    every_seconds: float | None = None
    num_shards: int | None = None
    shard_layout: str = "round_robin"
    verify_on_save: bool | str = "writer"
    data: dict[str, Any] | None = None
    metadata: dict[str, Any] = field(default_factory=dict)
    retention: RetentionPolicy | None = None
    hash_algo: str = DEFAULT_ALGO
    zip_crc32: bool = False
    scrub_bytes_per_s: float | None = None
    background_retention: bool = True

    def __post_init__(self) -> None:
        check_algo(self.hash_algo)
        verify_mode(self.verify_on_save)
        if not isinstance(self.zip_crc32, bool):
            raise CheckpointError(f"zip_crc32 must be True or False, got {self.zip_crc32!r}.")
        rate = self.scrub_bytes_per_s
        bad_rate = isinstance(rate, bool) or not isinstance(rate, (int, float)) or not rate > 0
        if rate is not None and bad_rate:
            raise CheckpointError(f"scrub_bytes_per_s must be None (no scrub) or a number > 0, got {rate!r}.")
        keep = self.keep_last
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
            raise CheckpointError(
                f"keep_last must be an int >= 1 (keep at least one good save), got {keep!r}"
            )
        validate_cadence(self.every_steps, self.every_seconds)
        shards = self.num_shards
        if shards is not None and (isinstance(shards, bool) or not isinstance(shards, int) or shards < 1):
            raise CheckpointError(f"num_shards must be None (one file) or an int >= 1, got {shards!r}.")
        if self.retention is not None and not callable(getattr(self.retention, "to_delete", None)):
            raise CheckpointError("retention needs a to_delete(steps, verified) method, e.g. KeepLastK(3).")
        # Copies, so that a caller mutating its dict later cannot change what gets recorded.
        object.__setattr__(self, "data", None if self.data is None else _plain_dict(self.data, "data"))
        object.__setattr__(self, "metadata", _plain_dict(self.metadata, "metadata"))

    @property
    def layout(self) -> str:
        return "single" if self.num_shards is None else "sharded"

    @property
    def policy(self) -> RetentionPolicy:
        return self.retention if self.retention is not None else KeepLastK(self.keep_last)


def is_state_call(args: tuple[Any, ...]) -> bool:
    """True for ``(step, mapping)``: the state API's save."""
    return (
        len(args) == 2
        and isinstance(args[0], int)
        and not isinstance(args[0], bool)
        and isinstance(args[1], Mapping)
    )


def positional_save_args(args: tuple[Any, ...]) -> tuple[Any, Any, Any, TrainState]:
    """``(model, optimizer, scheduler, train_state)`` checked; raises naming what is wrong."""
    if len(args) == 2 and isinstance(args[0], int) and not isinstance(args[0], bool):
        raise CheckpointError(
            f"save({args[0]!r}, {type(args[1]).__name__}): the state must be a mapping of named parts, "
            "e.g. mgr.save(step, {'model': model, 'optimizer': opt})."
        )
    if len(args) != 4:
        raise CheckpointError(
            f"save() takes (step, state) or (model, optimizer, scheduler, train_state); got {len(args)} "
            "positional argument(s)."
        )
    model, optimizer, scheduler, state = args
    check_positional_objects(model, optimizer, scheduler, loading=False, state_api=MANAGER_STATE_API)
    if not isinstance(state, TrainState):
        raise CheckpointError(f"state must be a TrainState, got {type(state).__name__}.")
    return model, optimizer, scheduler, state


def positional_restore_args(args: tuple[Any, ...]) -> tuple[Any, Any, Any]:
    """``(model, optimizer, scheduler)`` checked; raises naming what is wrong."""
    if len(args) != 3:
        raise CheckpointError(
            f"restore_latest() takes (state) or (model, optimizer, scheduler); got {len(args)} positional "
            "argument(s). With the state API pass one mapping: restore_latest({'model': model, ...})."
        )
    check_positional_objects(*args, loading=True, state_api=MANAGER_STATE_API)
    return args[0], args[1], args[2]
