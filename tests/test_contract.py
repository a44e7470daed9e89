"""The resume contract: data, model, config and environment are checked before any tensor loads."""

from __future__ import annotations

import copy
import json
import logging

import pytest
import torch

from ckpt_lesson.course.training import SyntheticRegression, make_model
from ckpt_lesson.errors import CheckpointError, ContractMismatchError, StateMismatchError
from ckpt_lesson.files.record_seal import seal_record
from ckpt_lesson.files.schema import current_env
from ckpt_lesson.runs.contract import (
    check_contract,
    config_fingerprint,
    contract_metadata,
    current_contract,
    model_fingerprint,
    resume_report,
)

CONFIG = {"lr": 0.01, "batch_size": 16, "total_steps": 60}


def saved_manifest(**overrides):
    """A manifest shaped like the manager's, for a run on seed-0 data with CONFIG."""
    data = SyntheticRegression(seed=0)
    manifest = {
        "schema": "ckpt.manifest.v1",
        "save_id": "a" * 32,
        "step": 40,
        "env": current_env(),
        "data": {"fingerprint": data.fingerprint(), "order_seed": 11},
        "metadata": contract_metadata(model=make_model(), config=CONFIG),
    }
    manifest.update(overrides)
    return manifest


def current(**kw):
    args = {
        "data": {"fingerprint": SyntheticRegression(seed=0).fingerprint(), "order_seed": 11},
        "model": make_model(),
        "config": CONFIG,
    }
    args.update(kw)
    return current_contract(**args)


def test_an_unchanged_run_passes_and_every_field_matches():
    report = resume_report(saved_manifest(), current=current())
    assert check_contract(report) == []
    assert {r.status for r in report.rows} == {"match"}
    assert report.save_id == "a" * 32 and report.step == 40


def test_different_data_is_refused_naming_field_saved_current_and_fix():
    other = SyntheticRegression(seed=1).fingerprint()
    report = resume_report(saved_manifest(), current=current(data={"fingerprint": other, "order_seed": 11}))
    with pytest.raises(ContractMismatchError) as info:
        check_contract(report, env_policy="allow")
    msg = str(info.value)
    assert "data.fingerprint" in msg and other in msg and SyntheticRegression(seed=0).fingerprint() in msg
    assert "warm_start_from" in msg and "step 40" in msg


def test_a_different_order_seed_is_refused():
    fp = SyntheticRegression(seed=0).fingerprint()
    report = resume_report(saved_manifest(), current=current(data={"fingerprint": fp, "order_seed": 12}))
    with pytest.raises(ContractMismatchError, match="data.order_seed"):
        check_contract(report)


def test_a_different_model_is_refused():
    report = resume_report(saved_manifest(), current=current(model=make_model(hidden=16)))
    with pytest.raises(ContractMismatchError, match="model_fingerprint.*architecture"):
        check_contract(report)


def test_a_different_config_is_refused_even_when_environment_changes_are_allowed():
    report = resume_report(saved_manifest(), current=current(config={**CONFIG, "lr": 0.02}))
    with pytest.raises(ContractMismatchError, match="config_fingerprint"):
        check_contract(report, env_policy="allow")


def incompatible_env_manifest():
    env = dict(current_env(), torch="1.13.1", device_type="cuda")
    return saved_manifest(env=env)


def test_an_environment_change_is_refused_by_default():
    report = resume_report(incompatible_env_manifest(), current=current())
    with pytest.raises(ContractMismatchError) as info:
        check_contract(report)
    msg = str(info.value)
    assert "env.torch: saved '1.13.1'" in msg and "env.device_type" in msg and "env_policy='warn'" in msg


def test_an_environment_change_under_warn_is_logged_and_returned(caplog):
    report = resume_report(incompatible_env_manifest(), current=current())
    with caplog.at_level(logging.WARNING, logger="ckpt_lesson.runs.contract"):
        warnings = check_contract(report, env_policy="warn")
    assert len(warnings) == 2 and all("environment changed" in w for w in warnings)
    assert "env.torch" in caplog.text


def test_an_environment_change_under_allow_passes_silently():
    report = resume_report(incompatible_env_manifest(), current=current())
    assert check_contract(report, env_policy="allow") == []


def test_an_unknown_env_policy_is_refused():
    with pytest.raises(CheckpointError, match="env_policy"):
        check_contract(resume_report(saved_manifest(), current=current()), env_policy="ignore")


def test_fields_the_save_never_recorded_are_reported_not_silently_passed():
    manifest = saved_manifest(metadata={}, data={"recorded": False, "fingerprint": None, "order_seed": None})
    report = resume_report(manifest, current=current())
    warnings = check_contract(report)
    assert {r.field for r in report.rows if r.status == "not recorded"} == {
        "data.fingerprint",
        "data.order_seed",
        "model_fingerprint",
        "config_fingerprint",
    }
    assert len(warnings) == 4


def test_fields_the_current_run_does_not_give_are_not_checked():
    report = resume_report(saved_manifest(), current=current_contract())
    assert [r.status for r in report.rows if r.kind != "env"] == ["not checked"] * 4
    assert check_contract(report) == []


def test_the_report_table_names_save_step_and_fields_without_paths():
    text = resume_report(saved_manifest(), current=current()).format()
    assert text.splitlines()[0] == f"resume contract for save {'a' * 32} at step 40"
    fields = ("data.fingerprint", "model_fingerprint", "config_fingerprint", "env.torch", "env.world_size")
    for field in fields:
        assert field in text
    assert "/" not in text.replace("saved -> current", "")


def test_a_single_file_payload_reports_its_step_and_extras_contract():
    payload = {
        "state": {"step": 7},
        "env": current_env(),
        "data": {"fingerprint": "f", "order_seed": 1},
        "extras": contract_metadata(config=CONFIG),
    }
    report = resume_report(payload, current=current_contract(config=CONFIG, data={"fingerprint": "f"}))
    assert report.step == 7 and report.save_id is None
    assert {r.field: r.status for r in report.rows}["config_fingerprint"] == "match"


def test_fingerprints_ignore_values_and_key_order_but_not_shapes():
    trained = make_model()
    for p in trained.parameters():
        p.data.add_(1.0)
    assert model_fingerprint(trained) == model_fingerprint(make_model())
    assert model_fingerprint(make_model()) == model_fingerprint(make_model().state_dict())
    assert model_fingerprint(make_model(in_dim=9)) != model_fingerprint(make_model())
    assert config_fingerprint({"a": 1, "b": 2}) == config_fingerprint({"b": 2, "a": 1})
    assert config_fingerprint({"a": 1}) != config_fingerprint({"a": 1.5})
    with pytest.raises(CheckpointError, match="JSON"):
        config_fingerprint({"fn": print})


def test_resume_report_does_not_modify_the_manifest():
    manifest = saved_manifest()
    before = copy.deepcopy(manifest)
    resume_report(manifest, current=current())
    assert manifest == before


# ---------------------------------------------------------------- the contract inside CheckpointManager


def managed_save(run_dir, *, step=4, num_shards=None):
    from ckpt_lesson.course.training import make_optimizer_and_scheduler, seed_everything
    from ckpt_lesson.files.checkpoint import TrainState
    from ckpt_lesson.runs.manager import CheckpointManager

    seed_everything(0)
    model = make_model()
    opt, sched = make_optimizer_and_scheduler(model)
    data = {"fingerprint": SyntheticRegression(seed=0).fingerprint(), "order_seed": 11}
    meta = contract_metadata(model=model, config=CONFIG)
    with CheckpointManager(run_dir, every_steps=step, num_shards=num_shards, data=data, metadata=meta) as mgr:
        for s in (step, 2 * step):
            mgr.save(model, opt, sched, TrainState(step=s, losses=[0.5] * s))
    return data


def restore(run_dir, *, env_policy="refuse", **expect_overrides):
    from ckpt_lesson.course.training import make_optimizer_and_scheduler
    from ckpt_lesson.runs.manager import CheckpointManager

    model = make_model()
    opt, sched = make_optimizer_and_scheduler(model)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    data = {"fingerprint": SyntheticRegression(seed=0).fingerprint(), "order_seed": 11}
    expect = {
        "data": data,
        "model_fingerprint": model_fingerprint(model),
        "config_fingerprint": config_fingerprint(CONFIG),
        **expect_overrides,
    }
    mgr = CheckpointManager(run_dir, every_steps=4, expect=expect, env_policy=env_policy)
    try:
        return mgr, mgr.restore_latest(model, opt, sched), model, before
    except Exception as exc:
        exc.model_unchanged = all(torch.equal(before[k], v) for k, v in model.state_dict().items())
        raise
    finally:
        mgr.close()


def edit_manifest(step_dir, **changes):
    path = step_dir / "manifest.json"
    manifest = json.loads(path.read_text())
    manifest.update(changes)
    # Re-sealed: these tests are about a *verified* manifest that disagrees (a contract refusal);
    # an unsealed edit would read as damage instead (tests/test_hostile_inputs.py covers that).
    path.write_text(json.dumps(seal_record(manifest)))


def test_manager_restore_checks_the_contract_and_records_the_report(tmp_path, caplog):
    managed_save(tmp_path)
    with caplog.at_level(logging.INFO, logger="ckpt_lesson.runs.manager"):
        mgr, state, _, _ = restore(tmp_path)
    assert state.step == 8
    report = mgr.last_restore["contract"]
    assert report["step"] == 8 and report["save_id"] == mgr.last_restore["save_id"]
    assert {r["status"] for r in report["rows"]} == {"match"}
    assert f"resume contract for save {report['save_id']} at step 8" in caplog.text


def test_manager_refuses_a_save_from_an_incompatible_environment_before_loading_tensors(tmp_path):
    managed_save(tmp_path)
    # The manifest is the commit record, not a part: editing it leaves every part verifying,
    # so the refusal below comes from the contract, not from a hash.
    edit_manifest(tmp_path / "step-00000008", env={**current_env(), "torch": "1.13.1"})
    with pytest.raises(ContractMismatchError, match="env.torch: saved '1.13.1'") as info:
        restore(tmp_path)
    assert info.value.model_unchanged


def test_manager_restores_across_an_environment_change_under_warn(tmp_path):
    managed_save(tmp_path)
    edit_manifest(tmp_path / "step-00000008", env={**current_env(), "numpy": "0.0.1"})
    mgr, state, _, _ = restore(tmp_path, env_policy="warn")
    assert state.step == 8
    now = repr(current_env()["numpy"])
    expected = f"environment changed: env.numpy saved '0.0.1', current {now}"
    assert mgr.last_restore["contract_warnings"] == [expected]


def test_manager_refuses_other_data_and_does_not_fall_back_to_an_older_save(tmp_path):
    managed_save(tmp_path)
    with pytest.raises(ContractMismatchError, match="data.fingerprint") as info:
        restore(tmp_path, data={"fingerprint": "0" * 64, "order_seed": 11})
    assert info.value.model_unchanged


def test_manager_refuses_a_save_whose_manifest_does_not_cover_the_optimizer(tmp_path):
    managed_save(tmp_path)
    edit_manifest(tmp_path / "step-00000008", covers=["model", "scheduler", "state", "rng"])
    with pytest.raises(StateMismatchError, match="warm_start_from"):
        restore(tmp_path)


def test_manager_skips_a_save_with_a_required_part_deleted_and_restores_the_older_one(tmp_path):
    managed_save(tmp_path, num_shards=2)
    (tmp_path / "step-00000008" / "model.shard-001.pt").unlink()
    mgr, state, _, _ = restore(tmp_path)
    assert state.step == 4
    [skip] = mgr.last_restore["skipped"]
    assert skip["step"] == 8 and skip["status"] == "incomplete" and "model.shard-001.pt" in skip["reason"]


def test_manager_refuses_an_unknown_env_policy(tmp_path):
    from ckpt_lesson.runs.manager import CheckpointManager

    with pytest.raises(CheckpointError, match="env_policy"):
        CheckpointManager(tmp_path, every_steps=1, env_policy="maybe")


def test_settings_kept_as_metadata_name_the_config_key_that_differs():
    manifest = saved_manifest(metadata={**contract_metadata(config=CONFIG), **CONFIG})
    now = {**current(config={**CONFIG, "lr": 0.02}), "config": {**CONFIG, "lr": 0.02}}
    report = resume_report(manifest, current=now)
    assert [r.field for r in report.differences()] == ["config_fingerprint", "config.lr"]
    with pytest.raises(ContractMismatchError, match=r"config\.lr: saved .*, current 0\.02"):
        check_contract(report)
