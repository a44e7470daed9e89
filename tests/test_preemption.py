"""Preemption: signals only set a flag; the loop saves at a step boundary and exits 75."""

from __future__ import annotations

import json
import logging
import multiprocessing
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from ckpt_lesson.course.preemptible import train_until_preempted
from ckpt_lesson.course.training import (
    SyntheticRegression,
    make_model,
    make_optimizer_and_scheduler,
    seed_everything,
    train,
)
from ckpt_lesson.errors import CheckpointError
from ckpt_lesson.files.checkpoint import TrainState, load_checkpoint, read_checkpoint, save_checkpoint
from ckpt_lesson.runs.preemption import (
    PREEMPTED_EXIT_CODE,
    PreemptionHandler,
)

SEED = 5
UNTIL = 40


def child_main(run: Path, until: int, pause: float, seed: int, conn=None) -> None:
    """One training process: resume if a save exists, train, save and exit 75 on SIGTERM."""
    seed_everything(seed)
    data = SyntheticRegression(seed=seed)
    model = make_model()
    opt, sched = make_optimizer_and_scheduler(model, total_steps=until)
    ckpt = run / "last.pt"
    state = load_checkpoint(ckpt, model, opt, sched) if ckpt.exists() else TrainState()
    print(f"start {state.step}", flush=True)

    handler = PreemptionHandler(grace_seconds=30.0)

    def after(st, rec):
        if conn is not None:
            conn.send(st.step)
            if st.step == 5:  # hold until the signal arrives: no dependence on timing
                deadline = time.monotonic() + 60
                while not handler.requested and time.monotonic() < deadline:
                    time.sleep(pause)

    with handler:
        out = train_until_preempted(
            model, opt, sched, state, data, until_step=until, seed=seed, handler=handler,
            save=lambda st: save_checkpoint(model, opt, sched, st, ckpt), after_step=after,
        )  # fmt: skip
    if not out.preempted:
        (run / "losses.json").write_text(json.dumps(state.losses))
    sys.exit(out.exit_code)


# A fresh interpreter for the resume: nothing survives from the preempted process but the file.
RESUME_SCRIPT = textwrap.dedent(
    """
    import sys
    from pathlib import Path
    sys.path.insert(0, sys.argv[1])
    from test_preemption import child_main
    child_main(Path(sys.argv[2]), int(sys.argv[3]), 0.0, int(sys.argv[4]))
    """
)


def baseline_losses(until: int = UNTIL) -> list[float]:
    seed_everything(SEED)
    data = SyntheticRegression(seed=SEED)
    model = make_model()
    opt, sched = make_optimizer_and_scheduler(model, total_steps=until)
    state = TrainState()
    train(model, opt, sched, state, data, until_step=until, seed=SEED)
    return state.losses


def test_sigterm_finishes_the_step_saves_exits_75_and_a_fresh_process_resumes_bit_for_bit(tmp_path):
    expected = baseline_losses()  # also warms torch up before the fork, so the child starts at once
    run = tmp_path / "run"
    run.mkdir()
    # The preempted process is forked from this (already imported) one: a real
    # process receiving a real SIGTERM, without paying for a second torch import.
    ctx = multiprocessing.get_context("fork")
    parent_conn, child_conn = ctx.Pipe(duplex=False)
    child = ctx.Process(target=child_main, args=(run, UNTIL, 0.02, SEED, child_conn))
    child.start()
    try:
        seen = 0
        while seen < 5:
            assert parent_conn.poll(60), "child made no progress"
            seen = parent_conn.recv()
        os.kill(child.pid, signal.SIGTERM)
        child.join(60)
    finally:
        if child.is_alive():
            child.kill()
    assert child.exitcode == PREEMPTED_EXIT_CODE
    stopped = read_checkpoint(run / "last.pt")["state"]["step"]
    assert stopped == 5  # saved at the step boundary where the signal arrived
    assert not (run / "losses.json").exists()

    resumed = subprocess.run(
        [sys.executable, "-c", RESUME_SCRIPT, str(Path(__file__).parent), str(run), str(UNTIL), str(SEED)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert resumed.returncode == 0, resumed.stderr
    assert f"start {stopped}" in resumed.stdout
    assert json.loads((run / "losses.json").read_text()) == expected


def send_to_main_thread(signum: int) -> None:
    """Deliver `signum` to this thread and run its Python handler before returning.

    `os.kill(os.getpid(), ...)` sends to the process: with other threads alive (torch starts some)
    the kernel may hand it to one of them, and the Python handler then runs at some later bytecode
    boundary, possibly after the next assert. `signal.pthread_kill` targets this thread, and CPython
    checks for pending signals before it returns, so the handler has run (or raised) by then.
    """
    signal.pthread_kill(threading.main_thread().ident, signum)


def test_a_caught_sigint_sets_the_flag_instead_of_raising_and_old_handlers_come_back():
    before = signal.getsignal(signal.SIGINT)
    with PreemptionHandler(signals=(signal.SIGINT,)) as handler:
        assert not handler.requested
        send_to_main_thread(signal.SIGINT)
        assert handler.requested
        assert handler.signal_received == signal.SIGINT
    assert signal.getsignal(signal.SIGINT) is before


def test_a_second_sigint_reaches_the_previous_handler_so_a_hung_save_stays_interruptible():
    # The previous handler is set here, not inherited: in a full run, a library imported by an earlier
    # test may have replaced Python's default SIGINT handler in this process (seen once in a full run).
    outer = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with PreemptionHandler(signals=(signal.SIGINT,)) as handler:
            send_to_main_thread(signal.SIGINT)
            assert handler.requested
            with pytest.raises(KeyboardInterrupt):
                send_to_main_thread(signal.SIGINT)
    finally:
        signal.signal(signal.SIGINT, outer)


def run_child(run_dir, conn):
    """run_managed_training under a PreemptionHandler, slowed so a signal lands mid-run."""
    from ckpt_lesson.course.managed import run_managed_training

    handler = PreemptionHandler()

    def after(st, rec):
        if st.step == 7:
            conn.send(st.step)
            # Hold here until the signal arrives, so the test does not depend on timing.
            deadline = time.monotonic() + 60
            while not handler.requested and time.monotonic() < deadline:
                time.sleep(0.005)

    with handler:
        out = run_managed_training(run_dir, total_steps=UNTIL, seed=SEED, every_steps=25, preemption=handler,
                                   after_step=after)  # fmt: skip
    os._exit(out["exit_code"])


def test_run_managed_training_saves_on_sigterm_exits_75_and_resumes_bit_for_bit(tmp_path):
    from ckpt_lesson.course.managed import run_managed_training

    reference = run_managed_training(tmp_path / "reference", total_steps=UNTIL, seed=SEED, every_steps=25)
    expected = reference["losses"]
    ctx = multiprocessing.get_context("fork")
    parent_conn, child_conn = ctx.Pipe(duplex=False)
    child = ctx.Process(target=run_child, args=(tmp_path / "run", child_conn))
    child.start()
    try:
        assert parent_conn.poll(60) and parent_conn.recv() == 7
        os.kill(child.pid, signal.SIGTERM)
        child.join(60)
    finally:
        if child.is_alive():
            child.kill()
    assert child.exitcode == PREEMPTED_EXIT_CODE
    out = run_managed_training(tmp_path / "run", total_steps=UNTIL, seed=SEED, every_steps=25)
    assert out["resumed_from"] == 7  # the preemption save, not a cadence save
    assert out["losses"] == expected


def test_the_loop_saves_once_at_the_step_the_request_arrived_and_returns_75():
    seed_everything(SEED)
    data = SyntheticRegression(seed=SEED)
    model = make_model()
    opt, sched = make_optimizer_and_scheduler(model, total_steps=UNTIL)
    saved: list[int] = []
    handler = PreemptionHandler(clock=lambda: 0.0)

    def after(st, rec):
        if st.step == 3:
            handler.request()

    out = train_until_preempted(
        model, opt, sched, TrainState(), data, until_step=UNTIL, seed=SEED, handler=handler,
        save=lambda st: saved.append(st.step), after_step=after,
    )  # fmt: skip
    assert out.exit_code == PREEMPTED_EXIT_CODE and out.preempted
    assert saved == [3]
    assert [r.step for r in out.records] == [1, 2, 3]


def test_periodic_saves_are_measured_and_a_run_that_finishes_exits_zero():
    seed_everything(SEED)
    data = SyntheticRegression(seed=SEED)
    model = make_model()
    opt, sched = make_optimizer_and_scheduler(model, total_steps=10)
    saved: list[int] = []
    out = train_until_preempted(
        model, opt, sched, TrainState(), data, until_step=10, seed=SEED, handler=PreemptionHandler(),
        save=lambda st: saved.append(st.step) or st.step, every_steps=4,
    )  # fmt: skip
    assert out.exit_code == 0
    assert saved == [4, 8]
    assert [s.result for s in out.saves] == [4, 8]
    assert all(s.since_signal_seconds is None for s in out.saves)


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_save_that_ends_after_the_grace_period_is_reported_and_logged(caplog):
    clock = FakeClock()
    handler = PreemptionHandler(grace_seconds=30.0, clock=clock)
    handler.request()
    clock.now += 20.0  # the step in flight took 20 s

    def slow_save() -> str:
        clock.now += 15.0
        return "saved"

    with caplog.at_level(logging.WARNING, logger="ckpt_lesson.runs.preemption"):
        timed = handler.timed_save(slow_save)
    assert timed.result == "saved"
    assert timed.save_seconds == 15.0
    assert timed.since_signal_seconds == 35.0
    assert timed.fits_grace is False
    assert timed.warning is not None and "grace period" in timed.warning
    assert "grace period" in caplog.text
    assert handler.remaining_grace() == -5.0


def test_a_quick_save_after_a_signal_fits_and_logs_nothing(caplog):
    clock = FakeClock()
    handler = PreemptionHandler(grace_seconds=30.0, clock=clock)
    handler.request()

    def save() -> None:
        clock.now += 2.0

    with caplog.at_level(logging.WARNING):
        timed = handler.timed_save(save)
    assert timed.fits_grace and timed.warning is None
    assert caplog.records == []


def test_a_periodic_save_longer_than_the_grace_period_warns_before_any_preemption():
    clock = FakeClock()
    handler = PreemptionHandler(grace_seconds=10.0, clock=clock)

    def save() -> None:
        clock.now += 12.0

    timed = handler.timed_save(save)
    assert timed.since_signal_seconds is None
    assert not timed.fits_grace
    assert timed.warning is not None and "longer than" in timed.warning


def test_exit_code_is_ex_tempfail():
    assert PREEMPTED_EXIT_CODE == 75


@pytest.mark.parametrize("grace", [0, -1.0])
def test_a_non_positive_grace_period_is_refused(grace):
    with pytest.raises(CheckpointError, match="grace_seconds"):
        PreemptionHandler(grace_seconds=grace)


def test_entering_the_handler_outside_the_main_thread_is_refused():
    import threading

    errors: list[BaseException] = []

    def worker() -> None:
        try:
            with PreemptionHandler():
                pass
        except CheckpointError as exc:
            errors.append(exc)

    t = threading.Thread(target=worker)
    t.start()
    t.join()
    assert len(errors) == 1 and "main thread" in str(errors[0])
