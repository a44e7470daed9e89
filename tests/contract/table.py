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

from _paths import FAILS, PATHS, SKIPS  # noqa: E402
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
    ("2 ranks, the six other combinations of storage, call form and save mode",
     "`tests/test_distributed_*.py`; each would add 20 s (folder) to 45 s (bucket) to CI as a path here"),
]  # fmt: skip


def _cell(key: str, path) -> tuple[int, list[tuple[str, str, str]]]:
    """``(cases that pass, [(case, "skipped" or "FAILS", why), ...])`` of one guarantee on one path."""
    kinds = {"bad_input": BAD_INPUTS, "kill": KILL_POINTS}
    cases = [f"{key}:{c}" for c in kinds[key]] if key in kinds else [key]
    notes = []
    for case in cases:
        skips = [SKIPS[(case, axis)] for axis in path.axes if (case, axis) in SKIPS]
        fails = [FAILS[(case, axis)] for axis in path.axes if (case, axis) in FAILS]
        if skips:
            notes.append((case.split(":")[-1], "skipped", skips[0]))
        elif fails:  # the FAILS entry says "FAILS: what" itself
            notes.append((case.split(":")[-1], "", fails[0]))
    return len(cases) - len(notes), notes


def _text(key: str, path) -> str:
    ran, notes = _cell(key, path)
    by_reason: dict[tuple[str, str], list[str]] = {}
    for case, verb, reason in notes:
        by_reason.setdefault((verb, reason), []).append(case)
    said = [
        f"{', '.join(cases)} {verb + ': ' if verb else ''}{reason}"
        for (verb, reason), cases in by_reason.items()
    ]
    return f"{ran}" + (f" ({'; '.join(said)})" if said else "")


def render() -> str:
    """The Markdown table (and the list of guarantees tested elsewhere)."""
    head = "| guarantee | " + " | ".join(p.id for p in PATHS) + " |"
    rule = "|---|" + "---|" * len(PATHS)
    rows = [f"| {label} | " + " | ".join(_text(key, p) for p in PATHS) + " |" for label, key, _ in GUARANTEES]
    cells = [_cell(key, p) for _, key, _ in GUARANTEES for p in PATHS]
    total = sum(ran for ran, _ in cells)
    skips = sum(verb == "skipped" for _, notes in cells for _, verb, _ in notes)
    fails = sum(verb != "skipped" for _, notes in cells for _, verb, _ in notes)
    elsewhere = "\n".join(f"- {what}: {where}" for what, where in ELSEWHERE)
    failing = f", {fails} known failures shown as FAILS (each runs, as a strict xfail)" if fails else ""
    return (
        f"{head}\n{rule}\n" + "\n".join(rows) + f"\n\n{total} cases pass, {skips} skipped with the reason "
        f"shown{failing} (counts per cell: passing test cases in `tests/contract/test_guarantees.py`).\n\n"
        f"Not yet paths or guarantees of this suite, tested elsewhere:\n\n{elsewhere}\n"
    )


if __name__ == "__main__":
    print(render(), end="")
