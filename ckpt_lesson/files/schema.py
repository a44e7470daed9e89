"""Schema versions and the migrations between them.

Every payload names its layout in a ``schema`` field. Loading code never
guesses from which keys happen to be present; it reads the field, migrates
older layouts forward *in memory* through a small registry, and refuses
anything it does not know (including a schema newer than itself: an old
reader silently dropping fields it does not understand is how state gets lost).

``ckpt.v1`` is the lesson's original layout: ``model``, ``optimizer``,
``scheduler``, ``state``, ``rng``, ``wall_saved_at``, ``extras``.
``ckpt.v2`` adds two blocks with a real use on resume:

* ``env``: torch, NumPy and Python versions, device type and world size, so a
  resume on a different stack is noticed before any compute;
* ``data``: a fingerprint of the dataset and the seed of the batch order, so a
  resume against different data is refused instead of silently continued.

Whatever the layout, every value in a payload must be one the weights-only
loader accepts (:func:`validate_payload`): ``torch.save`` pickles anything, and
a save that cannot be loaded back is worse than no save.

The manifest's name lives here too, and the step a folder's name carries,
which its record must repeat (:func:`check_recorded_step`).
"""

from __future__ import annotations

import collections
import platform
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ckpt_lesson.errors import CheckpointError, CorruptCheckpointError, SchemaError

__all__ = [
    "CHECKPOINT_DIR_RE",
    "CHECKPOINT_SCHEMA",
    "MANIFEST_NAME",
    "MANIFEST_SCHEMA",
    "CURRENT_SCHEMA",
    "KNOWN_SCHEMAS",
    "MIGRATIONS",
    "SCHEMA_V1",
    "SCHEMA_V2",
    "STEP_DIR_RE",
    "check_recorded_step",
    "current_env",
    "folder_name_step",
    "migrate_payload",
    "migrate_v1_to_v2",
    "validate_payload",
]

#: The commit record of a managed save folder (see ``runs/layout.py``): written last,
#: it lists every part's size and hash. Named here because single files refuse
#: to be migrated in place when such a record pins their bytes.
MANIFEST_NAME = "manifest.json"
MANIFEST_SCHEMA = "ckpt.manifest.v1"
#: A published save's folder (``step-00000240``) and a Hugging Face one (``checkpoint-500``).
#: [0-9], not \d: \d also matches other scripts' digits ("step-٣٣٣٣٣٣٣٣"), which int() accepts
#: but step_dir_name() never writes, so scan would list a save that restore can never find.
STEP_DIR_RE = re.compile(r"^step-([0-9]{8,})$")
CHECKPOINT_DIR_RE = re.compile(r"^checkpoint-([0-9]+)$")

SCHEMA_V1 = "ckpt.v1"
SCHEMA_V2 = "ckpt.v2"
#: What new saves write.
CURRENT_SCHEMA = SCHEMA_V2
#: The lesson's name for the same thing (its code wrote ``ckpt.v1``; we write ``ckpt.v2``).
CHECKPOINT_SCHEMA = CURRENT_SCHEMA
#: Oldest first; an index in this tuple is the schema's age.
KNOWN_SCHEMAS = (SCHEMA_V1, SCHEMA_V2)

_SCALARS = (type(None), bool, int, float, complex, str, bytes, bytearray, torch.dtype, torch.device)
_MAX_DEPTH = 64


def current_env(*, world_size: int = 1) -> dict[str, Any]:
    """The environment block a v2 save records for this process."""
    return {
        "torch": str(torch.__version__),
        "numpy": str(np.__version__),
        "python": platform.python_version(),
        "device_type": "cuda" if torch.cuda.is_available() else "cpu",
        "world_size": int(world_size),
    }


def migrate_v1_to_v2(payload: dict[str, Any]) -> dict[str, Any]:
    """Return a v2 payload built from a v1 one; the input is not modified.

    A v1 file never recorded its environment or data, so the new blocks say
    so explicitly (``recorded: False``) rather than inventing values.

    Raises:
        SchemaError: ``payload`` is not a v1 payload.

    Example:
        >>> v2 = migrate_v1_to_v2({"schema": "ckpt.v1", "model": {}})
        >>> v2["schema"], v2["env"]["recorded"]
        ('ckpt.v2', False)
    """
    if not isinstance(payload, dict) or payload.get("schema") != SCHEMA_V1:
        found = payload.get("schema") if isinstance(payload, dict) else type(payload).__name__
        raise SchemaError(f"migrate_v1_to_v2 expects schema {SCHEMA_V1!r}, got {found!r}.")
    out = dict(payload)
    out["schema"] = SCHEMA_V2
    out["env"] = {"recorded": False}
    out["data"] = {"recorded": False, "fingerprint": None, "order_seed": None}
    out.setdefault("extras", None)
    return out


#: schema -> function that lifts a payload of that schema by one version.
MIGRATIONS: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {SCHEMA_V1: migrate_v1_to_v2}


def migrate_payload(payload: Any, *, source: str = "<payload>") -> dict[str, Any]:
    """Lift ``payload`` to :data:`CURRENT_SCHEMA`, one registered step at a time.

    Args:
        payload: A loaded checkpoint payload.
        source: File name used in error messages.

    Raises:
        SchemaError: Not a dict, no schema field, an unknown schema, or one
            newer than this code knows.
    """
    if not isinstance(payload, dict):
        raise SchemaError(
            f"{source}: payload is a {type(payload).__name__}, not a dict; "
            "it was not written by save_checkpoint()."
        )
    schema = payload.get("schema")
    if schema is None:
        raise SchemaError(
            f"{source}: payload has no 'schema' field; it was not written by this package. "
            "Wrap it with the keys of ckpt.v1 and a schema field, then run "
            "'python -m ckpt_lesson migrate'."
        )
    if schema not in KNOWN_SCHEMAS:
        newer = isinstance(schema, str) and schema.startswith("ckpt.v")
        hint = "upgrade ckpt_lesson to read it" if newer else "this is not a ckpt_lesson checkpoint"
        raise SchemaError(f"{source}: unknown schema {schema!r} (known: {KNOWN_SCHEMAS}); {hint}.")
    # At most one step per known schema: a migration that forgets to bump the
    # schema field must fail loudly, not loop forever.
    for _ in range(len(KNOWN_SCHEMAS)):
        schema = payload["schema"]
        if schema == CURRENT_SCHEMA:
            return payload
        if schema not in MIGRATIONS:
            raise SchemaError(
                f"{source}: no migration registered from {schema!r} towards {CURRENT_SCHEMA!r}; "
                "add one to ckpt_lesson.files.schema.MIGRATIONS."
            )
        payload = MIGRATIONS[schema](payload)
    raise SchemaError(
        f"{source}: migrations from {schema!r} did not reach {CURRENT_SCHEMA!r} within "
        f"{len(KNOWN_SCHEMAS)} steps; a registered migration does not advance the schema field."
    )


def folder_name_step(name: str) -> int | None:
    """The step in a save folder's name, or ``None`` for a name that carries none.

    Example:
        >>> folder_name_step("step-00000240"), folder_name_step("checkpoint-500"), folder_name_step("x")
        (240, 500, None)
    """
    for pattern in (STEP_DIR_RE, CHECKPOINT_DIR_RE):
        found = pattern.match(name)
        if found:
            return int(found.group(1))
    return None


def check_recorded_step(recorded: Any, folder: Path, *, record: str) -> None:
    """Refuse a record whose step differs from the step in its folder's name.

    Folders are copied, renamed and restored from backups by people and tools
    that know nothing of our records. A step-2 save copied as ``step-00000006``
    would otherwise be taken for the newest save: a restore would go back in
    time while claiming to go forward, and the next real save of step 6 would
    be refused because "step 6 is already saved". So every reader that trusts
    a record checks its step here, and a mismatch is damage: the save is
    skipped and the restore falls back. Folders whose name carries no step (a
    staging folder, a user's own folder) are not checked.

    Args:
        recorded: The ``step`` field read from the record.
        folder: The folder holding the record.
        record: The record's file name, for the message.

    Raises:
        CorruptCheckpointError: The two steps differ.

    Example:
        >>> check_recorded_step(240, Path("run/step-00000240"), record="manifest.json")
    """
    named = folder_name_step(folder.name)
    if named is None or (type(recorded) is int and recorded == named):
        return
    raise CorruptCheckpointError(
        f"{folder.name}/{record}: records step {recorded!r}, but the folder is named for step {named}; "
        "it was copied or renamed from another save. Skipping it (restores fall back to an older save); "
        "rename it to match its step if you meant to keep it."
    )


def validate_payload(payload: Any, *, where: str = "payload") -> None:
    """Refuse any value a weights-only load would refuse, and meta tensors.

    Args:
        payload: The object about to be saved.
        where: Prefix of the key path in messages.

    Raises:
        CheckpointError: Names the first offending key path and its type.

    Example:
        >>> validate_payload({"w": torch.zeros(2), "note": "ok"})
        >>> validate_payload({"w": object()})
        Traceback (most recent call last):
        ckpt_lesson.errors.CheckpointError: payload['w'] is a builtins.object, ...
    """
    _walk(payload, where, 0, set())


def _walk(value: Any, path: str, depth: int, active: set[int]) -> None:
    if depth > _MAX_DEPTH:
        raise CheckpointError(f"{path}: nested more than {_MAX_DEPTH} levels deep; flatten it before saving.")
    if isinstance(value, torch.Tensor):
        if type(value).__module__.split(".")[0] != "torch":
            raise _refuse(path, value, "a tensor subclass the weights-only loader does not know")
        if value.is_meta:
            raise CheckpointError(
                f"{path}: is a tensor on the meta device (it has a shape but no data); nothing could be "
                "restored from it. Materialize the model (to_empty() and initialize, or load weights) "
                "before saving. Nothing was written."
            )
        return
    if type(value) in _SCALARS:
        return
    if type(value) in (dict, collections.OrderedDict, collections.Counter):
        _enter(value, path, active)
        for key, item in value.items():
            _walk(key, f"{path} key {key!r}", depth + 1, active)
            _walk(item, f"{path}[{key!r}]", depth + 1, active)
        active.discard(id(value))
        return
    if type(value) in (list, tuple, set, torch.Size):
        _enter(value, path, active)
        for i, item in enumerate(value):
            _walk(item, f"{path}[{i}]", depth + 1, active)
        active.discard(id(value))
        return
    raise _refuse(path, value, "a type the weights-only loader refuses")


def _enter(value: Any, path: str, active: set[int]) -> None:
    if id(value) in active:
        raise CheckpointError(f"{path}: contains itself; a checkpoint must be a tree. Nothing was written.")
    active.add(id(value))


def _refuse(path: str, value: Any, why: str) -> CheckpointError:
    kind = f"{type(value).__module__}.{type(value).__qualname__}"
    return CheckpointError(
        f"{path} is a {kind}, {why}; the save could never be loaded back, so nothing was written. "
        "Convert it to a tensor or plain Python values (numbers, str, list, dict), e.g. "
        "torch.as_tensor(x), x.tolist() or str(path)."
    )
