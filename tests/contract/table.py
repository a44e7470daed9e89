"""The guarantee x path table of ``docs/guarantees.md``, computed from the suite's parametrization.

Run ``PYTHONPATH=$PWD python tests/contract/table.py`` to print it; ``test_table.py``
fails when the committed table differs, so the docs can never claim a cell the
suite does not run (or hide a skip).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _paths import PATHS, SKIPS  # noqa: E402
from test_guarantees import BAD_INPUTS, KILL_POINTS  # noqa: E402

#: (label in the table, guarantee key, the test that checks it); bad input has one case per kind.
GUARANTEES = [
    ("bad input refused, part named (`None`, no `state_dict`, dict of models, missing/extra part, "
     "unsaveable value)", "bad_input", "test_bad_input_is_refused_naming_the_part_and_nothing_is_saved"),
    ("exact round trip", "round_trip", "test_a_save_restores_exactly"),
    ("SIGKILL mid-save (after a part is written; mid-upload): previous save restorable", "kill",
     "test_a_kill_mid_save_leaves_the_previous_save_restorable"),
    ("flipped byte: previous good save restored", "flipped_byte",
     "test_a_flipped_byte_falls_back_to_the_previous_good_save"),
    ("retention never deletes the last good save", "retention",
     "test_retention_never_deletes_the_last_good_save"),
    ("second writer of a saved step refused (bucket: by the conditional `COMMIT`)", "second_writer",
     "test_a_second_writer_of_a_saved_step_is_refused_and_the_first_save_stays"),
    ("a restore survives the trainer's retention deleting the save it reads (takes the newer one)",
     "run_moves_on", "test_a_restore_survives_retention_deleting_the_save_it_reads"),
    ("a zombie writer, frozen past its lease while another job cleaned, commits nothing", "zombie",
     "test_a_zombie_writer_whose_lease_expired_commits_nothing"),
]  # fmt: skip
#: Guarantees of the issue not in this suite yet, and where they are tested today.
ELSEWHERE = [
    ("2 ranks", "`tests/test_distributed_*.py`; not yet a path of this suite"),
]  # fmt: skip


def _cell(key: str, path) -> tuple[int, list[str]]:
    """``(cases run, ["case: why skipped", ...])`` of one guarantee on one path."""
    kinds = {"bad_input": BAD_INPUTS, "kill": KILL_POINTS}
    cases = [f"{key}:{c}" for c in kinds[key]] if key in kinds else [key]
    skipped = []
    for case in cases:
        reasons = [
            SKIPS[(case, axis)] for axis in (path.storage, path.form, path.mode) if (case, axis) in SKIPS
        ]
        if reasons:
            skipped.append(f"{case.split(':')[-1]} skipped: {reasons[0]}")
    return len(cases) - len(skipped), skipped


def _text(key: str, path) -> str:
    ran, skipped = _cell(key, path)
    by_reason: dict[str, list[str]] = {}
    for entry in skipped:
        case, _, reason = entry.partition(" skipped: ")
        by_reason.setdefault(reason, []).append(case)
    notes = [f"{', '.join(cases)} skipped: {reason}" for reason, cases in by_reason.items()]
    return f"{ran}" + (f" ({'; '.join(notes)})" if notes else "")


def render() -> str:
    """The Markdown table (and the list of guarantees tested elsewhere)."""
    head = "| guarantee | " + " | ".join(p.id for p in PATHS) + " |"
    rule = "|---|" + "---|" * len(PATHS)
    rows = [f"| {label} | " + " | ".join(_text(key, p) for p in PATHS) + " |" for label, key, _ in GUARANTEES]
    total = sum(_cell(key, p)[0] for _, key, _ in GUARANTEES for p in PATHS)
    skips = sum(len(_cell(key, p)[1]) for _, key, _ in GUARANTEES for p in PATHS)
    elsewhere = "\n".join(f"- {what}: {where}" for what, where in ELSEWHERE)
    return (
        f"{head}\n{rule}\n" + "\n".join(rows) + f"\n\n{total} cases run, {skips} skipped with the reason "
        f"shown (counts per cell: test cases in `tests/contract/test_guarantees.py`).\n\n"
        f"Not yet paths or guarantees of this suite, tested elsewhere:\n\n{elsewhere}\n"
    )


if __name__ == "__main__":
    print(render(), end="")
