"""The course's graded exercises, one :class:`Exercise` object each.

A notebook imports the one it needs and uses it Kaggle-style::

    from ckpt_lesson.course.exercises import keep_k
    keep_k.check(keep_last_k)   # PASS / FAIL with the first failing case / NOT ATTEMPTED
    keep_k.hint()               # one more hint per call; keep_k.hint(2) for a chosen one
    keep_k.solution()           # the reference solution's source

:data:`EXERCISES` lists them all by name (the tests grade every reference
solution and known wrong answers through it). The graders themselves live in
:mod:`ckpt_lesson.course.graders` (06-09); the ``check_*`` names are re-exported
here so older imports keep working.
"""

from __future__ import annotations

from ckpt_lesson.course import solutions
from ckpt_lesson.course.exercise import Exercise
from ckpt_lesson.course.graders import (
    GradeResult,
    check_cadence,
    check_keep_k,
    check_migration,
    check_verify_part,
)

__all__ = [
    "EXERCISES",
    "Exercise",
    "GradeResult",
    "cadence",
    "check_cadence",
    "check_keep_k",
    "check_migration",
    "check_verify_part",
    "checksum",
    "keep_k",
    "migration",
]

keep_k = Exercise(
    name="keep_k",
    grader=check_keep_k,
    hints=(
        "Sort first: `steps` comes in any order, like a directory listing. Sort the numbers, not their "
        "string forms ('1000' sorts before '200').",
        "List the verified steps in ascending order. If there are fewer than k of them, delete nothing.",
        "The oldest step you keep is the k-th newest verified one: `good[-k]`. Every step older than it "
        "goes, verified or not; everything from it on stays, even a damaged step newer than it.",
        "Build a new list (`sorted(steps)` already returns one) instead of sorting `steps` in place; "
        "return the steps to delete in ascending order.",
    ),
    reference=solutions.keep_last_k,
)

cadence = Exercise(
    name="cadence",
    grader=check_cadence,
    hints=(
        "Start with the two cases that are never a save: step 0 (nothing to protect) and "
        "`step == last_step` (that state is already on disk).",
        "The two rules are joined by OR: test the step rule, and if it does not fire, still test the "
        "time rule. An `if every_steps: return step % every_steps == 0` hides the time rule.",
        "The time rule counts from the last save: `now - last_time >= every_seconds` (>=, not >), and "
        "it cannot fire while `last_time` is None.",
        "Either rule may be None (off). End with `return False`, so the answer is always a bool.",
    ),
    reference=solutions.should_save,
)

checksum = Exercise(
    name="checksum",
    grader=check_verify_part,
    hints=(
        "A missing file is an answer ('missing'), not an exception: check `Path(path).is_file()` first.",
        "Compare the size next: `path.stat().st_size` costs nothing, hashing reads every byte.",
        "Hash in chunks: `h = hashlib.sha256()`, then `h.update(chunk)` for 1 MiB reads until `read` "
        "returns b''; compare `h.hexdigest()` with the record.",
        "Return None only when size and digest both match, otherwise a short non-empty reason.",
    ),
    reference=solutions.verify_part,
)

migration = Exercise(
    name="migration",
    grader=check_migration,
    hints=(
        "Refuse what is not a v1 payload first: `payload.get('schema') != 'ckpt.v1'` raises "
        "`SchemaError` (any ValueError passes).",
        "Never change `payload`: start from `new = dict(payload)` and only assign keys of `new`.",
        "v1 never recorded its environment or data: say so with `recorded: False` blocks instead of "
        "reading this machine's versions.",
        "`new.setdefault('extras', None)` keeps extras when present and adds None when a very old "
        "payload lacks the key.",
    ),
    reference=solutions.migrate_v1_to_v2,
)

#: Every exercise by name, in course order.
EXERCISES: dict[str, Exercise] = {ex.name: ex for ex in (keep_k, cadence, checksum, migration)}
