"""Async failures are never silent: a failed writer_nice warns, an unreported failure is printed at exit."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path

from ckpt_lesson.runs.async_report import unreported_failures
from ckpt_lesson.runs.async_save import AsyncCheckpointer
from ckpt_lesson.runs.manager import CheckpointManager

SCRIPT = textwrap.dedent(
    """
    import sys
    import torch
    from ckpt_lesson.files.checkpoint import TrainState
    from ckpt_lesson.runs.async_save import AsyncCheckpointer
    from ckpt_lesson.runs.manager import CheckpointManager

    def broken(name, info):
        if name == "part_begin":
            raise OSError(28, "No space left on device (test)")

    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ckpt = AsyncCheckpointer(CheckpointManager(sys.argv[1], every_steps=1, on_event=broken))
    ckpt.save_async(model, opt, None, TrainState(step=3))
    if sys.argv[2] == "wait":
        try:
            ckpt.wait()
        except Exception as exc:
            print("caught", type(exc).__name__)
    # otherwise the script simply ends, as many training scripts do
    """
)


# The multi-rank manager (here a world of one) writes and commits in DCP's executor thread; the
# hook fails its commit there, after every file was written.
DCP_SCRIPT = textwrap.dedent(
    """
    import sys
    import torch
    from ckpt_lesson.distributed import DistributedCheckpointManager
    from ckpt_lesson.files.checkpoint import TrainState

    def broken(name, info):
        if name == "finish_begin":
            raise OSError(28, "No space left on device (test)")

    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mgr = DistributedCheckpointManager(sys.argv[1], every_steps=1, on_event=broken)
    mgr.save_async(model, opt, None, TrainState(step=3))
    if sys.argv[2] == "wait":
        try:
            mgr.wait()
        except Exception as exc:
            print("caught", type(exc).__name__)
    # otherwise the script simply ends
    """
)


def run_script(tmp_path: Path, mode: str, script: str = SCRIPT) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    return subprocess.run(
        [sys.executable, "-c", script, str(tmp_path / "run"), mode],
        capture_output=True, text=True, timeout=120, env=env,
    )  # fmt: skip


def test_a_failed_last_async_save_is_reported_on_stderr_at_exit_naming_the_step(tmp_path):
    done = run_script(tmp_path, "end")
    assert "asynchronous save of step 3 failed: OSError" in done.stderr
    assert "No space left on device (test)" in done.stderr and "Traceback" not in done.stderr
    assert not list((tmp_path / "run").glob("step-*"))


def test_a_failure_already_raised_by_wait_is_not_reported_again_at_exit(tmp_path):
    done = run_script(tmp_path, "wait")
    assert done.returncode == 0 and "caught CheckpointError" in done.stdout
    assert "asynchronous save of step" not in done.stderr


def test_a_writer_nice_that_cannot_be_applied_warns_and_the_save_still_runs(
    tmp_path, tiny_run, monkeypatch, caplog
):
    def forbidden(which: int, who: int, prio: int) -> None:
        raise PermissionError(1, "Operation not permitted (a sandbox without setpriority)")

    # Fault injection at the OS boundary: no real kernel here refuses to raise a nice value.
    monkeypatch.setattr(os, "setpriority", forbidden)
    run = tiny_run(0)
    run.train(2)
    with (
        caplog.at_level(logging.WARNING),
        AsyncCheckpointer(CheckpointManager(tmp_path, every_steps=1), writer_nice=5) as ckpt,
    ):
        ckpt.save_async(run.model, run.optimizer, run.scheduler, run.state)
        assert ckpt.wait() == tmp_path / "step-00000002"
    assert "writer_nice=5 could not be applied" in caplog.text
    assert unreported_failures() == []


def test_a_failed_last_multi_rank_async_save_is_reported_on_stderr_at_exit_naming_the_step(tmp_path):
    done = run_script(tmp_path, "end", DCP_SCRIPT)
    assert "asynchronous save of step 3 failed" in done.stderr, done.stderr[-2000:]
    assert "No space left on device (test)" in done.stderr
    assert not list((tmp_path / "run").glob("step-*"))


def test_a_multi_rank_async_failure_raised_by_wait_is_not_reported_again_at_exit(tmp_path):
    done = run_script(tmp_path, "wait", DCP_SCRIPT)
    assert done.returncode == 0 and "caught CheckpointError" in done.stdout, done.stderr[-2000:]
    assert "asynchronous save of step" not in done.stderr
