"""Single-file checkpoints: every bucket comes back, resume is bit-for-bit, mismatches are refused.

"Refused" always means two things: a :class:`CheckpointError` that names the
file, and live objects left exactly as they were before the load was tried.
"""

from __future__ import annotations

import copy
import logging
import random

import numpy as np
import pytest
import torch
from torch import nn

from ckpt_lesson.errors import CheckpointError, CorruptCheckpointError, SchemaError, StateMismatchError
from ckpt_lesson.files.atomic import atomic_save
from ckpt_lesson.files.checkpoint import (
    BUCKETS,
    TrainState,
    apply_payload,
    build_payload,
    load_checkpoint,
    read_checkpoint,
    save_checkpoint,
)
from ckpt_lesson.files.integrity import file_digest
from ckpt_lesson.files.schema import CURRENT_SCHEMA, SCHEMA_V1


def same(a, b) -> bool:
    """Deep equality where tensors must be bitwise equal (and of the same dtype and shape)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and a.dtype == b.dtype
            and torch.equal(a, b)
        )
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def snapshot(run) -> dict:
    """Everything a failed load must leave untouched."""
    return {
        "model": copy.deepcopy(run.model.state_dict()),
        "optimizer": copy.deepcopy(run.optimizer.state_dict()),
        "scheduler": None if run.scheduler is None else copy.deepcopy(run.scheduler.state_dict()),
        "torch_rng": torch.get_rng_state(),
    }


def draws() -> tuple:
    return random.random(), float(np.random.rand()), torch.rand(3).tolist()


def scramble_generators() -> None:
    random.seed(999)
    np.random.seed(999)
    torch.manual_seed(999)


@pytest.fixture
def saved(tmp_path, tiny_run):
    """A run trained for 5 steps and saved: (run, path)."""
    run = tiny_run(0)
    run.train(5)
    path = tmp_path / "step_5.pt"
    run.save(path)
    return run, path


def test_load_restores_every_bucket(saved, tiny_run):
    run, path = saved
    expected_draws = draws()  # the generators right after the save
    other = tiny_run(7)  # different initial weights...
    other.train(2)  # ...and non-trivial optimizer and scheduler state
    scramble_generators()

    state = other.load(path)

    assert state == TrainState(step=5, epoch=0, batch_in_epoch=5, losses=run.state.losses)
    assert same(other.model.state_dict(), run.model.state_dict())
    assert same(other.optimizer.state_dict(), run.optimizer.state_dict())
    assert other.scheduler.last_epoch == run.scheduler.last_epoch == 5
    assert other.scheduler.get_last_lr() == run.scheduler.get_last_lr()
    assert draws() == expected_draws


@pytest.mark.parametrize("stop", [3, 8, 11], ids=["mid_epoch", "epoch_end", "second_epoch"])
def test_resume_continues_bit_for_bit(tmp_path, tiny_run, stop):
    full = tiny_run(3)
    full_records = full.train(20)

    first = tiny_run(3)
    first.train(stop)
    first.save(tmp_path / "ckpt.pt")

    resumed = tiny_run(3)  # the documented recipe: seed, build, load, train
    scramble_generators()  # whatever happened in between must not matter
    resumed.load(tmp_path / "ckpt.pt")
    records = resumed.train(20)

    assert resumed.state.losses == full.state.losses  # exact, not approximately
    assert records == full_records[stop:]  # same steps, losses and sample ids
    assert resumed.state == full.state


def test_without_the_rng_bucket_the_resumed_run_drifts(tmp_path, tiny_run):
    # The control for the test above: dropout and jitter depend on the generators,
    # so comparing losses exactly really does detect a missing RNG restore.
    full = tiny_run(3)
    full.train(12)
    first = tiny_run(3)
    first.train(6)
    first.save(tmp_path / "ckpt.pt")
    resumed = tiny_run(3)
    resumed.load(tmp_path / "ckpt.pt")
    scramble_generators()  # as if the RNG bucket had not been restored
    resumed.train(12)
    assert resumed.state.losses[:6] == full.state.losses[:6]
    assert resumed.state.losses[6:] != full.state.losses[6:]


@pytest.mark.parametrize("bucket", BUCKETS)
def test_a_missing_bucket_is_refused_never_filled_with_fresh_state(tmp_path, tiny_run, bucket):
    run = tiny_run(0)
    run.train(2)
    payload = build_payload(run.model, run.optimizer, run.scheduler, run.state)
    del payload[bucket]
    path = tmp_path / f"no_{bucket}.pt"
    atomic_save(payload, path)
    fresh = tiny_run(1)
    before = snapshot(fresh)
    with pytest.raises(StateMismatchError, match=bucket) as info:
        fresh.load(path)
    assert str(path) in str(info.value)
    assert same(snapshot(fresh), before)


@pytest.mark.parametrize("payload", [{"schema": CURRENT_SCHEMA}, ["not", "a", "dict"]], ids=["empty", "list"])
def test_apply_payload_called_directly_refuses_a_payload_without_buckets(tiny_run, payload):
    run = tiny_run(0)
    with pytest.raises(StateMismatchError, match="shard-3"):
        apply_payload(payload, run.model, run.optimizer, run.scheduler, source="shard-3")


def refused_without_change(run, path, error=StateMismatchError):
    before = snapshot(run)
    with pytest.raises(error) as info:
        load_checkpoint(path, run.model, run.optimizer, run.scheduler)
    assert str(path) in str(info.value)
    assert same(snapshot(run), before)
    return info.value


def test_a_model_shape_mismatch_is_refused_and_the_model_is_unchanged(saved, tiny_run):
    _, path = saved
    narrower = tiny_run(0, hidden=16)
    message = str(refused_without_change(narrower, path))
    assert "shape" in message and "0.weight" in message


def test_a_model_key_mismatch_is_refused_and_the_model_is_unchanged(saved, tiny_run):
    _, path = saved
    run = tiny_run(0)
    run.model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))
    run.optimizer = torch.optim.AdamW(run.model.parameters())
    run.scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(run.optimizer, T_max=50)
    assert "keys differ" in str(refused_without_change(run, path))


def test_different_optimizer_parameter_groups_are_refused(saved, tiny_run):
    _, path = saved
    run = tiny_run(0)
    params = list(run.model.parameters())
    run.optimizer = torch.optim.AdamW([{"params": params[:2]}, {"params": params[2:]}])
    run.scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(run.optimizer, T_max=50)
    assert "parameter groups" in str(refused_without_change(run, path))


def test_a_saved_scheduler_cannot_be_loaded_without_one(saved, tiny_run):
    _, path = saved
    message = str(refused_without_change(tiny_run(0, with_scheduler=False), path))
    assert "saved one but no scheduler" in message


def test_a_run_without_scheduler_cannot_be_loaded_into_one_with_a_scheduler(tmp_path, tiny_run):
    plain = tiny_run(0, with_scheduler=False)
    plain.train(2)
    plain.save(tmp_path / "plain.pt")
    assert "saved none but a scheduler" in str(refused_without_change(tiny_run(0), tmp_path / "plain.pt"))
    # and the matching kind loads
    again = tiny_run(0, with_scheduler=False)
    assert again.load(tmp_path / "plain.pt").step == 2


def _damage(payload: dict, damage: str) -> None:
    opt = payload["optimizer"]
    if damage == "rng_malformed":
        payload["rng"]["numpy"]["keys"] = [1, 2, 3]
    elif damage == "rng_from_two_gpus":
        payload["rng"]["torch_cuda"] = [torch.zeros(16, dtype=torch.uint8)] * (torch.cuda.device_count() + 2)
    elif damage == "optimizer_not_a_state_dict":
        payload["optimizer"] = {"state": {}, "param_groups": "oops"}
    elif damage == "optimizer_param_ids_not_ints":
        opt["param_groups"][0]["params"] = [{} for _ in opt["param_groups"][0]["params"]]
    elif damage == "adamw_state_without_step":
        del opt["state"][0]["step"]  # torch fails on this only after replacing the optimizer's state
    elif damage == "adamw_step_not_a_number":
        opt["state"][0]["step"] = {"a": 1}
    else:
        raise AssertionError(damage)


@pytest.mark.parametrize(
    "damage",
    [
        "rng_malformed",
        "rng_from_two_gpus",
        "optimizer_not_a_state_dict",
        "optimizer_param_ids_not_ints",
        "adamw_state_without_step",
        "adamw_step_not_a_number",
    ],
)
def test_a_bad_bucket_is_refused_before_anything_is_overwritten(tmp_path, tiny_run, damage):
    run = tiny_run(0)
    run.train(2)
    payload = build_payload(run.model, run.optimizer, run.scheduler, run.state)
    _damage(payload, damage)
    atomic_save(payload, tmp_path / "bad.pt")
    target = tiny_run(1)
    target.train(1)  # live optimizer state that a half-done load would overwrite
    refused_without_change(target, tmp_path / "bad.pt")


@pytest.mark.parametrize(
    "state",
    [{"step": -1}, {"step": True}, {"epoch": 1.5}, {"losses": ["nan?"]}, {"losses": None}],
    ids=["negative", "bool", "float", "string_loss", "no_list"],
)
def test_malformed_train_state_is_refused(tmp_path, tiny_run, state):
    run = tiny_run(0)
    payload = build_payload(run.model, run.optimizer, run.scheduler, TrainState(step=1, losses=[0.5]))
    payload["state"].update(state)
    atomic_save(payload, tmp_path / "bad_state.pt")
    refused_without_change(tiny_run(1), tmp_path / "bad_state.pt")


@pytest.mark.parametrize(
    "schema, words",
    [(None, "no 'schema' field"), ("hello", "not a ckpt_lesson"), ("ckpt.v3", "upgrade ckpt_lesson")],
)
def test_a_missing_unknown_or_newer_schema_is_refused(tmp_path, tiny_run, schema, words):
    run = tiny_run(0)
    payload = build_payload(run.model, run.optimizer, run.scheduler, run.state)
    if schema is None:
        del payload["schema"]
    else:
        payload["schema"] = schema
    atomic_save(payload, tmp_path / "odd.pt")
    assert words in str(refused_without_change(tiny_run(1), tmp_path / "odd.pt", SchemaError))


def test_a_file_holding_something_other_than_a_dict_is_a_schema_error(tmp_path, tiny_run):
    atomic_save([torch.ones(2)], tmp_path / "list.pt")
    refused_without_change(tiny_run(0), tmp_path / "list.pt", SchemaError)


def test_a_v2_payload_without_its_footer_is_refused(tmp_path, tiny_run):
    run = tiny_run(0)
    payload = build_payload(run.model, run.optimizer, run.scheduler, run.state)
    torch.save(payload, tmp_path / "no_footer.pt")  # plain torch.save: no integrity record
    message = str(refused_without_change(tiny_run(1), tmp_path / "no_footer.pt", CorruptCheckpointError))
    assert "without its integrity footer" in message


def test_a_legacy_v1_file_without_footer_loads_with_a_warning(tmp_path, tiny_run, caplog):
    run = tiny_run(0)
    run.train(4)
    payload = build_payload(run.model, run.optimizer, run.scheduler, run.state, extras={"note": "old"})
    payload["schema"] = SCHEMA_V1
    del payload["env"], payload["data"]
    path = tmp_path / "legacy.pt"
    torch.save(payload, path)  # how the lesson's original code saved

    fresh = tiny_run(1)
    with caplog.at_level(logging.WARNING, logger="ckpt_lesson.files.checkpoint"):
        state = fresh.load(path)
    assert state == run.state
    assert same(fresh.model.state_dict(), run.model.state_dict())
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and str(path) in warnings[0] and "no integrity record" in warnings[0]

    migrated = read_checkpoint(path)
    assert migrated["schema"] == CURRENT_SCHEMA
    assert migrated["env"] == {"recorded": False} and migrated["data"]["recorded"] is False
    assert migrated["extras"] == {"note": "old"}


def test_a_current_checkpoint_loads_without_any_warning(saved, tiny_run, caplog):
    _, path = saved
    with caplog.at_level(logging.WARNING):
        tiny_run(1).load(path)
    assert caplog.records == []


def test_extras_data_and_env_blocks_are_saved(tmp_path, tiny_run):
    run = tiny_run(0)
    data = {"fingerprint": run.data.fingerprint(), "order_seed": 0}
    save_checkpoint(
        run.model, run.optimizer, run.scheduler, run.state, tmp_path / "c.pt", extras={"lr": 0.01}, data=data
    )
    payload = read_checkpoint(tmp_path / "c.pt")
    assert payload["schema"] == CURRENT_SCHEMA
    assert payload["extras"] == {"lr": 0.01}
    assert payload["data"] == {"recorded": True, **data}
    assert payload["env"]["torch"] == str(torch.__version__) and payload["env"]["world_size"] == 1
    assert read_checkpoint(tmp_path / "c.pt", expected_sha256=None)["data"]["recorded"] is True


def test_expected_sha256_is_checked_on_load(saved, tiny_run):
    _, path = saved
    good = file_digest(path, algo="sha256").digest
    fresh = tiny_run(1)
    state = load_checkpoint(path, fresh.model, fresh.optimizer, fresh.scheduler, expected_sha256=good)
    assert state.step == 5
    before = snapshot(fresh)
    with pytest.raises(CorruptCheckpointError, match="does not match"):
        load_checkpoint(path, fresh.model, fresh.optimizer, fresh.scheduler, expected_sha256="ab" * 32)
    assert same(snapshot(fresh), before)


@pytest.mark.parametrize("kind", ["missing", "directory"])
def test_a_missing_file_or_a_directory_is_a_checkpoint_error_naming_it(tmp_path, tiny_run, kind):
    path = tmp_path / "ckpt.pt"
    if kind == "directory":
        path.mkdir()
    refused_without_change(tiny_run(0), path, CheckpointError)


def test_build_payload_refuses_a_state_that_is_not_a_train_state(tiny_run):
    run = tiny_run(0)
    with pytest.raises(CheckpointError, match="TrainState"):
        build_payload(run.model, run.optimizer, run.scheduler, {"step": 3})


def test_train_state_round_trips_through_plain_values():
    state = TrainState(step=3, epoch=1, batch_in_epoch=2, losses=[0.5, 0.25, 0.125])
    assert TrainState.from_dict(state.to_dict()) == state
    ints = TrainState.from_dict({**state.to_dict(), "losses": [1, 2, 3]})
    assert ints.losses == [1.0, 2.0, 3.0] and all(type(x) is float for x in ints.losses)


def test_an_optimizer_that_once_loaded_our_file_with_plain_torch_still_loads_it_with_ours(saved, tiny_run):
    # optimizer.load_state_dict() copies our group binding into the live optimizer; it is not a setting.
    _, path = saved
    run = tiny_run(0)
    plain = torch.load(path, weights_only=True)
    run.optimizer.load_state_dict(plain["optimizer"])
    state = load_checkpoint(path, run.model, run.optimizer, run.scheduler)
    assert state.step == 5


# --- restoring through a file mapping --------------------------------------------------------


def test_a_mapped_load_resumes_bit_for_bit_like_a_read(tmp_path, tiny_run):
    full = tiny_run(3)
    full.train(12)
    first = tiny_run(3)
    first.train(5)
    first.save(tmp_path / "ckpt.pt")
    resumed = tiny_run(3)
    scramble_generators()
    state = load_checkpoint(
        tmp_path / "ckpt.pt", resumed.model, resumed.optimizer, resumed.scheduler, mmap=True
    )
    resumed.state = state
    resumed.train(12)
    assert resumed.state.losses == full.state.losses


_TRUNCATE_AFTER_MAPPED_LOAD = """
import sys, torch
sys.path.insert(0, {tests!r})
from conftest import build_tiny_run
import ckpt_lesson.files.checkpoint as checkpoint
run = build_tiny_run(0)
if sys.argv[1] == "plain-torch-mmap":  # the control: a mapping of the file itself
    payload = torch.load({path!r}, mmap=True, weights_only=True)
    run.optimizer.load_state_dict(payload["optimizer"])  # keeps the moments: they map the file
else:
    if sys.argv[1] == "without-copies":  # the moments stay mapped, but on the sealed private copy
        checkpoint.copy_out = lambda tree, **_: tree
    state = checkpoint.load_checkpoint({path!r}, run.model, run.optimizer, run.scheduler, mmap=True)
open({path!r}, "r+b").truncate(0)  # a mapping of the file would now fault (SIGBUS)
total = sum(float(t.float().sum()) for t in run.model.state_dict().values())
for group in run.optimizer.state.values():
    total += sum(float(t.float().sum()) for t in group.values() if isinstance(t, torch.Tensor))
print("ok", 5 if sys.argv[1] == "plain-torch-mmap" else state.step)
"""


@pytest.mark.parametrize("mode", ["ours", "without-copies", "plain-torch-mmap"])
def test_nothing_a_mapped_load_returns_still_reads_the_file(tmp_path, tiny_run, mode):
    import subprocess
    import sys
    from pathlib import Path

    run = tiny_run(0)
    run.train(5)
    run.save(tmp_path / "ckpt.pt")
    script = _TRUNCATE_AFTER_MAPPED_LOAD.format(
        tests=str(Path(__file__).resolve().parent), path=str(tmp_path / "ckpt.pt")
    )
    done = subprocess.run([sys.executable, "-c", script, mode], capture_output=True, text=True, timeout=120)
    if mode != "plain-torch-mmap":  # ours maps only its sealed private copy, never the file
        assert done.returncode == 0 and done.stdout.strip() == "ok 5", done.stderr[-2000:]
    else:  # proves the check can fail: tensors that map the file itself fault once it is cut
        import signal

        assert done.returncode == -signal.SIGBUS, done.stderr[-2000:]


def test_a_file_system_that_cannot_map_falls_back_to_reading_the_file(saved, tiny_run, monkeypatch):
    run, path = saved
    real_load = torch.load

    def no_mmap(*args, **kwargs):
        if kwargs.get("mmap"):
            raise RuntimeError("mmap: operation not supported by this file system")
        return real_load(*args, **kwargs)

    monkeypatch.setattr(torch, "load", no_mmap)
    other = tiny_run(7)
    state = load_checkpoint(path, other.model, other.optimizer, other.scheduler)  # mmap=True by default
    assert state.step == 5
    assert same(other.model.state_dict(), run.model.state_dict())
    assert same(other.optimizer.state_dict(), run.optimizer.state_dict())


def test_the_private_copy_after_a_mapped_load_copies_cpu_tensors_and_leaves_device_tensors_alone():
    from ckpt_lesson.files.mapped_restore import copy_out

    cpu, meta = torch.ones(3), torch.empty(3, device="meta")  # "meta" stands in for a CUDA tensor here
    out = copy_out({"moments": [cpu, (meta, 1)], "step": 3})
    assert out["moments"][0] is not cpu and torch.equal(out["moments"][0], cpu)
    assert out["moments"][1][0] is meta and out["step"] == 3
