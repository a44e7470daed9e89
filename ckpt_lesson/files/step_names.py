"""A save's step is written twice: in its folder's name and in its record. They must agree.

Folders are copied, renamed and restored from backups by people and tools
that know nothing of our records. A step-2 save copied as ``step-00000006``
would otherwise be taken for the newest save: a restore would go back in time
while claiming to go forward, and the next real save of step 6 would be
refused because "step 6 is already saved". So every reader that trusts a
record checks the step it records against the number in the folder's name
(``step-XXXXXXXX`` for our saves, ``checkpoint-N`` for Hugging Face folders),
and a mismatch is damage: the save is skipped and the restore falls back.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from ckpt_lesson.errors import CorruptCheckpointError

__all__ = ["check_recorded_step", "folder_name_step"]

_NAMED = (re.compile(r"^step-([0-9]{8,})$"), re.compile(r"^checkpoint-([0-9]+)$"))


def folder_name_step(name: str) -> int | None:
    """The step in a save folder's name, or ``None`` for a name that carries none.

    Example:
        >>> folder_name_step("step-00000240"), folder_name_step("checkpoint-500"), folder_name_step("x")
        (240, 500, None)
    """
    for pattern in _NAMED:
        found = pattern.match(name)
        if found:
            return int(found.group(1))
    return None


def check_recorded_step(recorded: Any, folder: Path, *, record: str) -> None:
    """Refuse a record whose step differs from the step in its folder's name.

    Folders whose name carries no step (a staging folder, a user's own folder)
    are not checked.

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
