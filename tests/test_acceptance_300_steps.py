"""Acceptance: 300 steps, saves every 40, the machine lost at step 300 with step 280's save half written.

The story of the issue, made exact and fast:

* steps 1-240 run under ``run_managed_training``; saves at 40, 80, ..., 240 publish;
* a second process continues from 240. At step 280 it snapshots the state and
  starts the save in the background (an asynchronous save, as a slow disk or
  an upload makes it), and the write stalls half-way through ``checkpoint.pt``;
  training goes on to step 300, where the machine is lost (SIGKILL);
* a fresh restore must choose 240 (280 never published), print its save id,
  data fingerprint and expected environment before computing, start at step
  241, report 60 steps redone (300 - 240, not the 20 a naive "newest folder"
  reading of 280 suggests) and finish bit-for-bit equal to a run never interrupted.

Then a variant: a published step-280 whose payload lacks the optimizer state
(its manifest claims to cover it). Resume refuses it; only ``warm_start_from``
can use it, as a new experiment.
"""

from __future__ import annotations

import copy
import multiprocessing
import os
import shutil
import signal
import threading
import uuid

import pytest

from ckpt_lesson.course.managed import run_managed_training
from ckpt_lesson.course.training import (
    SyntheticRegression,
    make_model,
    make_optimizer_and_scheduler,
    seed_everything,
    train,
)
from ckpt_lesson.errors import CheckpointError
from ckpt_lesson.files.atomic import atomic_save, atomic_write_json
from ckpt_lesson.files.checkpoint import TrainState, build_payload
from ckpt_lesson.files.record_seal import seal_record
from ckpt_lesson.runs.layout import read_manifest
from ckpt_lesson.runs.manager import CheckpointManager
from ckpt_lesson.runs.report import RecoveryRecorder, read_recovery_log
from ckpt_lesson.runs.warm_start import read_warm_start, warm_start_from

SEED, TOTAL, EVERY, KEEP = 11, 300, 40, 3
LOST_SAVE, LOST_AT = 280, 300


def build():
    seed_everything(SEED)
    data = SyntheticRegression(seed=SEED)
    model = make_model()
    opt, sched = make_optimizer_and_scheduler(model, total_steps=TOTAL)
    return data, model, opt, sched


@pytest.fixture(scope="module")
def baseline():
    """The uninterrupted run, plus a snapshot of everything at step 280."""
    data, model, opt, sched = build()
    state = TrainState()
    at_280 = {}

    def after(st, rec):
        if st.step == LOST_SAVE:
            at_280["payload"] = copy.deepcopy(build_payload(model, opt, sched, st))

    train(model, opt, sched, state, data, until_step=TOTAL, seed=SEED, after_step=after)
    return state.losses, at_280["payload"]


def second_process(run_dir, half_bytes):
    """Resume at 240, stall the step-280 save half-way, lose the machine at step 300."""
    from ckpt_lesson.files import integrity

    stall, written, original = threading.Event(), {"n": 0}, integrity.FooterWriter.write

    def stalling_write(self, data):
        if threading.current_thread() is not threading.main_thread():
            n = len(memoryview(data).cast("B"))
            if written["n"] + n >= half_bytes:
                original(self, bytes(memoryview(data).cast("B")[: half_bytes - written["n"]]))
                self.flush()
                os.fsync(self._raw.fileno())
                stall.wait()  # the disk (or the upload) never comes back
            written["n"] += n
        return original(self, data)

    integrity.FooterWriter.write = stalling_write
    manifest = read_manifest(run_dir / "step-00000240")
    data, model, opt, sched = build()
    recorder = RecoveryRecorder(run_dir)
    mgr = CheckpointManager(
        run_dir, keep_last=KEEP, every_steps=EVERY, data=manifest["data"], metadata=manifest["metadata"]
    )
    state = mgr.restore_latest(model, opt, sched)
    recorder.restored(mgr.last_restore)

    def after(st, rec):
        recorder.step_done(st.step)
        if st.step == LOST_SAVE:
            # An asynchronous save: snapshot first, then write in the background.
            snap = copy.deepcopy((model, opt, sched, st))
            threading.Thread(target=mgr.save, args=snap, daemon=True).start()
        if st.step == LOST_AT:
            os.kill(os.getpid(), signal.SIGKILL)

    train(model, opt, sched, state, data, until_step=TOTAL, seed=SEED, after_step=after)
    os._exit(1)  # never reached: the machine is lost first


@pytest.fixture(scope="module")
def lost_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("acceptance") / "run"
    first = run_managed_training(run_dir, total_steps=TOTAL, seed=SEED, every_steps=EVERY, keep_last=KEEP,
                                 stop_after_step=240)  # fmt: skip
    assert first["saved_steps"] == [40, 80, 120, 160, 200, 240] and first["stopped_early"]
    half = (run_dir / "step-00000240" / "checkpoint.pt").stat().st_size // 2
    proc = multiprocessing.get_context("fork").Process(target=second_process, args=(run_dir, half))
    proc.start()
    proc.join(120)
    assert proc.exitcode == -signal.SIGKILL
    return run_dir


def test_the_lost_machine_left_240_published_and_280_half_written(lost_run):
    names = sorted(p.name for p in lost_run.iterdir())
    assert "step-00000240" in names and "step-00000280" not in names
    [staging] = [lost_run / n for n in names if n.startswith(".staging-step-00000280-")]
    [torn] = [p for p in staging.iterdir() if p.name.startswith(".checkpoint.pt.tmp-")]
    full = (lost_run / "step-00000240" / "checkpoint.pt").stat().st_size
    assert 0 < torn.stat().st_size < full  # half written, never renamed, never published


def test_restore_chooses_240_reports_before_computing_and_redoes_60_steps(lost_run, baseline, capsys):
    losses, _ = baseline
    run_dir = lost_run.parent / "restore-copy"
    shutil.copytree(lost_run, run_dir)
    save_240 = read_manifest(run_dir / "step-00000240")
    first_step = []

    def after(st, rec):
        if not first_step:
            first_step.append(st.step)
            print(f"first step computed: {st.step}", flush=True)

    out = run_managed_training(run_dir, total_steps=TOTAL, seed=SEED, every_steps=EVERY, keep_last=KEEP,
                               show_contract=True, after_step=after)  # fmt: skip
    text = capsys.readouterr().out
    report_at = text.index(f"resume contract for save {save_240['save_id']} at step 240")
    assert report_at < text.index("first step computed: 241")
    contract = text[report_at : text.index("first step computed")]
    assert f"{save_240['data']['fingerprint'][:16]}..." in contract  # the data fingerprint, expected ...
    for field in (
        "data.fingerprint",
        "env.torch",
        "env.numpy",
        "env.python",
        "env.device_type",
        "env.world_size",
    ):
        assert field in contract  # ... and the environment, each compared before any compute
    assert out["resumed_from"] == 240 and first_step == [241]
    assert out["losses"] == losses  # bit for bit, all 300 steps
    first_resume, record = read_recovery_log(run_dir)  # the second process's resume, then ours
    assert first_resume["steps_redone"] == 0  # it continued exactly where the first process stopped
    assert record["chosen"] == {"step": 240, "save_id": save_240["save_id"]}
    assert record["last_executed_step"] == 300
    assert record["steps_redone"] == 60  # not 20: step 280 was never a save


def publish_280_without_optimizer(run_dir, payload, *, covers_optimizer=True):
    step_dir = run_dir / "step-00000280"
    step_dir.mkdir()
    payload = dict(payload)
    del payload["optimizer"]
    digest = atomic_save(payload, step_dir / "checkpoint.pt")
    manifest = read_manifest(run_dir / "step-00000240")
    manifest.update(
        save_id=uuid.uuid4().hex,
        step=280,
        parts=[{"file": "checkpoint.pt", **digest.record()}],
        state={
            "step": 280,
            "epoch": payload["state"]["epoch"],
            "batch_in_epoch": payload["state"]["batch_in_epoch"],
        },
    )
    if not covers_optimizer:
        manifest["covers"] = [b for b in manifest["covers"] if b != "optimizer"]
    manifest = seal_record(manifest)  # a verified record: its refusal is the contract's, not damage
    atomic_write_json(manifest, step_dir / "manifest.json")
    return step_dir, manifest


@pytest.mark.parametrize("covers_optimizer", [True, False])
def test_a_280_without_optimizer_state_is_refused_by_resume_and_only_warm_starts(
    lost_run, baseline, tmp_path, covers_optimizer
):
    _, payload_280 = baseline
    run_dir = tmp_path / "run"
    shutil.copytree(lost_run, run_dir)
    step_dir, manifest = publish_280_without_optimizer(
        run_dir, payload_280, covers_optimizer=covers_optimizer
    )
    with pytest.raises(CheckpointError, match="optimizer.*warm_start_from|warm_start_from.*optimizer"):
        run_managed_training(run_dir, total_steps=TOTAL, seed=SEED, every_steps=EVERY, keep_last=KEEP)

    model = make_model()
    record = warm_start_from(step_dir, model, run_dir=tmp_path / "new-experiment")
    assert (record.kind, record.source_step, record.source_save_id) == (
        "warm_start",
        280,
        manifest["save_id"],
    )
    assert read_warm_start(tmp_path / "new-experiment") == record
    # The new experiment holds no save, so the managed loop starts it fresh: never a resume of 280.
    fresh = run_managed_training(tmp_path / "new-experiment", total_steps=3, seed=SEED, every_steps=3)
    assert fresh["resumed_from"] is None
