"""Warm start: only weights, hashes checked, recorded as a NEW run; resume still refuses."""

from __future__ import annotations

import json
import uuid

import pytest
import torch

from ckpt_lesson.course.training import make_model, make_optimizer_and_scheduler, seed_everything
from ckpt_lesson.errors import CheckpointError, CorruptCheckpointError, StateMismatchError
from ckpt_lesson.files.atomic import atomic_save, atomic_write_json
from ckpt_lesson.files.checkpoint import BUCKETS, TrainState, build_payload, read_checkpoint, save_checkpoint
from ckpt_lesson.files.schema import CURRENT_SCHEMA, current_env
from ckpt_lesson.files.sharded import save_sharded_checkpoint
from ckpt_lesson.runs.warm_start import WARM_START_NAME, read_warm_start, warm_start_from


def trained():
    seed_everything(1)
    model = make_model()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.5)
    opt, sched = make_optimizer_and_scheduler(model)
    return model, opt, sched


def publish(run_dir, step, parts, *, layout="single"):
    """A published save folder with a manifest shaped like CheckpointManager's."""
    step_dir = run_dir / f"step-{step:08d}"
    manifest = {
        "schema": "ckpt.manifest.v1",
        "save_id": uuid.uuid4().hex,
        "step": step,
        "payload_schema": CURRENT_SCHEMA,
        "layout": layout,
        "parts": parts,
        "covers": list(BUCKETS),
        "state": {"step": step, "epoch": 0, "batch_in_epoch": step},
        "env": current_env(),
        "data": {},
        "metadata": {},
        "created_at": 0.0,
    }
    atomic_write_json(manifest, step_dir / "manifest.json")
    return step_dir, manifest


def save_without_optimizer(run_dir, model, opt, sched, step=280):
    """A published save that covers the optimizer on paper but whose payload lost it."""
    step_dir = run_dir / f"step-{step:08d}"
    step_dir.mkdir(parents=True)
    payload = build_payload(model, opt, sched, TrainState(step=step))
    del payload["optimizer"]
    d = atomic_save(payload, step_dir / "checkpoint.pt")
    return publish(run_dir, step, [{"file": "checkpoint.pt", **d.record()}])


def weights_equal(a, b):
    return all(torch.equal(a.state_dict()[k], b.state_dict()[k]) for k in a.state_dict())


def test_a_save_without_optimizer_state_is_refused_as_resume_but_warm_starts_a_new_run(tmp_path):
    model, opt, sched = trained()
    step_dir, manifest = save_without_optimizer(tmp_path / "old", model, opt, sched)
    with pytest.raises(StateMismatchError, match="optimizer"):
        read_checkpoint(step_dir / "checkpoint.pt")  # the resume path refuses

    fresh = make_model()
    record = warm_start_from(step_dir, fresh, run_dir=tmp_path / "new")
    assert weights_equal(fresh, model)
    assert record.kind == "warm_start"
    assert record.source_save_id == manifest["save_id"] and record.source_step == 280
    assert record.verified_by == "manifest"
    assert record.run_id != manifest["save_id"] and len(record.run_id) == 32
    on_disk = json.loads((tmp_path / "new" / WARM_START_NAME).read_text())
    assert on_disk["source_save_id"] == manifest["save_id"] and on_disk["run_id"] == record.run_id
    assert read_warm_start(tmp_path / "new") == record
    # The new run holds no save: nothing can mistake it for a continuation of step 280.
    assert not list((tmp_path / "new").glob("step-*"))


def test_warm_start_checks_the_manifest_hash_before_loading(tmp_path):
    model, opt, sched = trained()
    step_dir, _ = save_without_optimizer(tmp_path / "old", model, opt, sched)
    path = step_dir / "checkpoint.pt"
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    path.write_bytes(bytes(raw))
    fresh = make_model()
    before = {k: v.clone() for k, v in fresh.state_dict().items()}
    with pytest.raises(CorruptCheckpointError):
        warm_start_from(step_dir, fresh, run_dir=tmp_path / "new")
    assert all(torch.equal(before[k], v) for k, v in fresh.state_dict().items())
    assert not (tmp_path / "new" / WARM_START_NAME).exists()


def test_warm_start_from_a_sharded_save_merges_only_the_model_shards(tmp_path):
    model, opt, sched = trained()
    step_dir = tmp_path / "old" / "step-00000040"
    result = save_sharded_checkpoint(model, opt, sched, TrainState(step=40), step_dir, num_shards=3)
    parts = [
        {"file": f["name"], "bytes": f["bytes"], "algo": f["algo"], "digest": f["digest"]}
        for f in result.files
    ]
    meta = result.meta
    parts.append(
        {"file": meta["name"], "bytes": meta["bytes"], "algo": meta["algo"], "digest": meta["digest"]}
    )
    (step_dir / "meta.pt").unlink()  # the optimizer lives in meta.pt; a warm start never needs it
    publish(tmp_path / "old", 40, parts, layout="sharded")
    fresh = make_model()
    record = warm_start_from(step_dir, fresh)
    assert weights_equal(fresh, model)
    assert sorted(record.source_sha256) == [f["name"] for f in result.files]


def test_warm_start_from_a_checkpoint_file_is_verified_by_its_footer(tmp_path):
    model, opt, sched = trained()
    save_checkpoint(model, opt, sched, TrainState(step=12), tmp_path / "c.pt")
    fresh = make_model()
    record = warm_start_from(tmp_path / "c.pt", fresh)
    assert weights_equal(fresh, model)
    assert (record.verified_by, record.source_step, record.source_save_id) == ("footer", 12, None)


def test_warm_start_from_a_bare_state_dict_says_it_was_not_verified(tmp_path):
    model, _, _ = trained()
    torch.save(model.state_dict(), tmp_path / "weights.pt")
    fresh = make_model()
    assert warm_start_from(tmp_path / "weights.pt", fresh).verified_by == "none"
    assert weights_equal(fresh, model)


def test_weights_for_another_architecture_are_refused_and_change_nothing(tmp_path):
    model, opt, sched = trained()
    save_checkpoint(model, opt, sched, TrainState(), tmp_path / "c.pt")
    other = make_model(hidden=16)
    before = {k: v.clone() for k, v in other.state_dict().items()}
    with pytest.raises(StateMismatchError, match="architecture"):
        warm_start_from(tmp_path / "c.pt", other)
    assert all(torch.equal(before[k], v) for k, v in other.state_dict().items())


def test_a_run_directory_that_already_holds_saves_is_refused(tmp_path):
    model, opt, sched = trained()
    save_checkpoint(model, opt, sched, TrainState(), tmp_path / "c.pt")
    (tmp_path / "busy" / "step-00000010").mkdir(parents=True)
    with pytest.raises(CheckpointError, match="begins a NEW run"):
        warm_start_from(tmp_path / "c.pt", make_model(), run_dir=tmp_path / "busy")
    warm_start_from(tmp_path / "c.pt", make_model(), run_dir=tmp_path / "fresh")
    with pytest.raises(CheckpointError, match="warm_start.json"):
        warm_start_from(tmp_path / "c.pt", make_model(), run_dir=tmp_path / "fresh")


def test_an_unpublished_save_folder_is_refused(tmp_path):
    (tmp_path / "step-00000010").mkdir()
    with pytest.raises(CheckpointError, match="never finished"):
        warm_start_from(tmp_path / "step-00000010", make_model())


def test_each_warm_start_gets_its_own_run_id(tmp_path):
    model, opt, sched = trained()
    save_checkpoint(model, opt, sched, TrainState(), tmp_path / "c.pt")
    a = warm_start_from(tmp_path / "c.pt", make_model())
    b = warm_start_from(tmp_path / "c.pt", make_model())
    assert a.run_id != b.run_id
