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
"""

from __future__ import annotations

import platform
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from ckpt_lesson.errors import SchemaError

__all__ = [
    "CHECKPOINT_SCHEMA",
    "MANIFEST_NAME",
    "MANIFEST_SCHEMA",
    "CURRENT_SCHEMA",
    "KNOWN_SCHEMAS",
    "MIGRATIONS",
    "SCHEMA_V1",
    "SCHEMA_V2",
    "current_env",
    "migrate_payload",
    "migrate_v1_to_v2",
]

#: The commit record of a managed save folder (see ``runs/scan.py``): written last,
#: it lists every part's size and hash. Named here because single files refuse
#: to be migrated in place when such a record pins their bytes.
MANIFEST_NAME = "manifest.json"
MANIFEST_SCHEMA = "ckpt.manifest.v1"

SCHEMA_V1 = "ckpt.v1"
SCHEMA_V2 = "ckpt.v2"
#: What new saves write.
CURRENT_SCHEMA = SCHEMA_V2
#: The lesson's name for the same thing (its code wrote ``ckpt.v1``; we write ``ckpt.v2``).
CHECKPOINT_SCHEMA = CURRENT_SCHEMA
#: Oldest first; an index in this tuple is the schema's age.
KNOWN_SCHEMAS = (SCHEMA_V1, SCHEMA_V2)

Migration = Callable[[dict[str, Any]], dict[str, Any]]


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
MIGRATIONS: dict[str, Migration] = {SCHEMA_V1: migrate_v1_to_v2}


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
