"""Graders for the build-it-yourself exercises that write files: lessons 02 and 03.

* 02 ``check_atomic_save(atomic_save)``: in this process, with ``os.fsync`` and
  ``os.replace`` watched, the save must load back, fsync the temp file before
  the rename, rename within the target's directory, fsync the directory after,
  use a fresh temp name each time, and survive an error mid-write (a full disk,
  then Ctrl-C) with the old file intact and no temp file left. Then the real test: a child process runs
  *your* function on a simulated slow disk and is killed with SIGKILL
  mid-write; the old checkpoint must still load.
* 03 ``check_round_trip(save_checkpoint, load_checkpoint)``: a run saved at
  step 8 and loaded into fresh objects must continue bit for bit, and broken
  files (a bucket missing, an unknown schema, cut short, a malicious pickle)
  must be refused before the model is touched.

The child process gets the learner's function as source text
(``inspect.getsource``), with the helper functions and modules it names, so a
function written in a notebook cell works there too.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ckpt_lesson.course.grading import GradeResult, _Case, _grade, _Watch
from ckpt_lesson.course.kill_child import _PAYLOAD_OLD, _same, kill_case
from ckpt_lesson.course.round_trip_cases import round_trip_cases

__all__ = ["check_atomic_save", "check_round_trip"]

_PAYLOAD_NEW = {"step": 2, "w": torch.full((4,), 2.0)}


def _loads(path: Path) -> Any:
    return torch.load(path, weights_only=True)


def _leftovers(folder: Path, keep: str) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name != keep)


def check_atomic_save(fn: Callable[..., Any], *, verbose: bool = True, kill: bool = True) -> GradeResult:
    """Grade an ``atomic_save(payload, path)`` (see the module docstring for the cases).

    Args:
        fn: The learner's function. For the kill case it must be defined in a
            file or notebook cell (its source is sent to a child process).
        verbose: Print the verdict line.
        kill: Run the SIGKILL case (a child process; about two seconds).

    Example:
        >>> from ckpt_lesson.course.solutions import atomic_save
        >>> check_atomic_save(atomic_save, verbose=False).passed
        True
    """
    with tempfile.TemporaryDirectory(prefix="ckpt-lesson-grader-") as tmp:
        root = Path(tmp)
        cases = [
            _fresh_case(root / "fresh"),
            _overwrite_case(root / "overwrite"),
            _unique_case(root / "unique"),
            _error_case(root / "error"),
            _error_case(root / "interrupt", interrupt=True),
        ]
        if kill:
            cases.append(kill_case(root / "kill"))
        scrub = lambda text: text.replace(tmp, "<tmp>")  # noqa: E731
        return _grade("check_atomic_save", "atomic_save", fn, cases, verbose, scrub)


def _fresh_case(folder: Path) -> _Case:
    def call(f: Callable[..., Any]) -> Any:
        folder.mkdir()
        with _Watch() as watch:
            f(_PAYLOAD_NEW, folder / "ckpt.pt")
        return watch.events

    def judge(events: list[tuple[str, str, str]]) -> str | None:
        target = folder / "ckpt.pt"
        if not target.is_file():
            return "no file at the target path after the save returned"
        if not _same(_loads(target), _PAYLOAD_NEW):
            return "the target does not load back (weights_only=True) as the payload saved"
        if _leftovers(folder, "ckpt.pt"):
            return f"left {_leftovers(folder, 'ckpt.pt')} beside the target after a successful save"
        renames = [e for e in events if e[0] == "rename"]
        if not renames:
            return "never renamed a temp file onto the target (write elsewhere, then os.replace)"
        src, dst = renames[-1][1:]
        if Path(dst) != target or Path(src).parent != folder:
            return f"renamed {src} -> {dst}; write the temp file in the target's own directory"
        at = events.index(renames[-1])
        if ("fsync", "file", "") not in events[:at]:
            return (
                "did not os.fsync the temp file before the rename: after a power loss the name may point "
                "at nothing"
            )
        if ("fsync", "dir", "") not in events[at:]:
            return (
                "did not os.fsync the directory after the rename: the rename itself may not survive a "
                "power loss"
            )
        return None

    return _Case(
        "[a save to a new file, fsync and renames watched] atomic_save(payload, 'ckpt.pt')", call, judge
    )


def _overwrite_case(folder: Path) -> _Case:
    def call(f: Callable[..., Any]) -> Any:
        folder.mkdir()
        torch.save(_PAYLOAD_OLD, folder / "ckpt.pt")
        f(_PAYLOAD_NEW, folder / "ckpt.pt")

    def judge(got: Any) -> str | None:
        if not _same(_loads(folder / "ckpt.pt"), _PAYLOAD_NEW):
            return "after overwriting, the target does not hold the new payload"
        return None

    return _Case("[overwriting an existing checkpoint] atomic_save(payload, 'ckpt.pt')", call, judge)


def _unique_case(folder: Path) -> _Case:
    def call(f: Callable[..., Any]) -> Any:
        folder.mkdir()
        with _Watch() as watch:
            f(_PAYLOAD_OLD, folder / "ckpt.pt")
            f(_PAYLOAD_NEW, folder / "ckpt.pt")
        return [e[1] for e in watch.events if e[0] == "rename"]

    def judge(sources: list[str]) -> str | None:
        if len(sources) >= 2 and sources[-1] == sources[-2]:
            return (
                f"both saves used the temp name {Path(sources[-1]).name}; two writers would share (and "
                "corrupt) one temp file: add the process id and a random part to the name"
            )
        return None

    return _Case("[two saves in a row] their temp file names differ", call, judge)


def _error_case(folder: Path, *, interrupt: bool = False) -> _Case:
    """torch.save fails after writing some bytes: the old file stays, no temp file stays, the error goes up.

    The failure is a full disk (``OSError``) or, with ``interrupt``, Ctrl-C (``KeyboardInterrupt``, a
    ``BaseException``): a cleanup under ``except Exception`` misses the second one.
    """
    error: type[BaseException] = KeyboardInterrupt if interrupt else OSError

    def call(f: Callable[..., Any]) -> Any:
        folder.mkdir()
        torch.save(_PAYLOAD_OLD, folder / "ckpt.pt")
        real_save = torch.save

        def failing_save(obj: Any, file: Any, *args: Any, **kwargs: Any) -> None:
            if isinstance(file, (str, os.PathLike)):
                with open(file, "wb") as fh:
                    fh.write(b"PK\x03\x04 half a zip archive")
            else:
                file.write(b"PK\x03\x04 half a zip archive")
            if interrupt:
                raise KeyboardInterrupt("Ctrl-C (simulated by the grader)")
            raise OSError(28, "No space left on device (simulated by the grader)")

        torch.save = failing_save  # type: ignore[assignment]
        try:
            f(_PAYLOAD_NEW, folder / "ckpt.pt")
        except error:
            return "raised"
        finally:
            torch.save = real_save  # type: ignore[assignment]
        return "returned"

    def judge(got: str) -> str | None:
        if not _same(_loads(folder / "ckpt.pt"), _PAYLOAD_OLD):
            return "the old checkpoint is damaged after a failed save"
        if _leftovers(folder, "ckpt.pt"):
            why = (
                " (except Exception misses it: catch BaseException, or use try/finally)" if interrupt else ""
            )
            return (
                f"left {_leftovers(folder, 'ckpt.pt')} behind: remove the temp file when the save fails{why}"
            )
        if got != "raised":
            return f"returned normally although the save failed: let the {error.__name__} reach the caller"
        return None

    what = "Ctrl-C arrives" if interrupt else "fails half way (disk full)"
    return _Case(f"[torch.save {what}] atomic_save(payload, 'ckpt.pt')", call, judge)


def check_round_trip(
    save: Callable[..., Any], load: Callable[..., Any], *, verbose: bool = True
) -> GradeResult:
    """Grade ``save_checkpoint(model, optimizer, scheduler, state, path)`` and
    ``load_checkpoint(path, model, optimizer, scheduler) -> TrainState``.

    The cases are built in :mod:`ckpt_lesson.course.round_trip_cases`.

    Example:
        >>> from ckpt_lesson.course.solutions import load_checkpoint, save_checkpoint
        >>> check_round_trip(save_checkpoint, load_checkpoint, verbose=False).passed
        True
    """
    with tempfile.TemporaryDirectory(prefix="ckpt-lesson-grader-") as tmp:
        scrub = lambda text: text.replace(tmp, "<tmp>")  # noqa: E731
        cases = round_trip_cases(Path(tmp))
        return _grade(
            "check_round_trip", "save_checkpoint/load_checkpoint", (save, load), cases, verbose, scrub
        )
