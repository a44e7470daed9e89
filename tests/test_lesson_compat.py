"""Code written against the lesson's ``code/main.py`` runs unchanged with ``import ckpt_lesson as ckpt``.

Each test uses one of the lesson's public names the way the lesson's code, its
tests and its text do (positional arguments where it passes them positionally,
keywords where it uses keywords), and checks what the lesson relies on: types,
shapes, file names and layout. Where ours deliberately differs (errors instead
of asserts, and the rest of the table in ``notebooks/README.md``), the test
says so. The demo runs spawn child processes, so each variant runs once per module.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

import ckpt_lesson as ckpt
from ckpt_lesson.cli import main as cli_main

#: Every public name of the lesson's main.py except HERE and OUT_DIR (paths of its own folder).
LESSON_NAMES = [
    "CHECKPOINT_SCHEMA",
    "SHARD_SCHEMA",
    "TrainState",
    "atomic_save",
    "atomic_write_json",
    "capture_rng_state",
    "file_sha256",
    "load_checkpoint",
    "load_sharded_checkpoint",
    "main",
    "make_model",
    "make_optimizer_and_scheduler",
    "parse_args",
    "restore_rng_state",
    "run_resume_demo",
    "save_checkpoint",
    "save_sharded_checkpoint",
    "seed_everything",
    "shard_keys_by_prefix",
    "step_one",
    "synthetic_loader",
    "train_until",
    "tuple_from_nested",
]


def _components(total_steps: int = 10, lr: float = 0.01):
    # The lesson's tests build their objects exactly like this.
    model = ckpt.make_model(8, 12, 4)
    optimizer, scheduler = ckpt.make_optimizer_and_scheduler(model, lr=lr, total_steps=total_steps)
    return model, optimizer, scheduler


def _tensors_equal(a: nn.Module, b: nn.Module) -> bool:
    return all(
        torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values(), strict=True)
    )


# --- names and small helpers ----------------------------------------------------


@pytest.mark.parametrize("name", LESSON_NAMES)
def test_every_public_name_of_the_lessons_main_py_is_exported(name: str) -> None:
    # The course harness's names are importable but listed apart from the library (COURSE_NAMES).
    assert (name in ckpt.__all__ or name in ckpt.COURSE_NAMES) and getattr(ckpt, name) is not None


def test_train_state_takes_the_lessons_positional_fields_and_defaults_losses_to_empty() -> None:
    state = ckpt.TrainState(3, 1, 2, [0.5, 0.4, 0.3])
    assert (state.step, state.epoch, state.batch_in_epoch, state.losses) == (3, 1, 2, [0.5, 0.4, 0.3])
    fresh = ckpt.TrainState(step=0, epoch=0, batch_in_epoch=0)
    assert fresh.losses == [] and fresh.losses is not ckpt.TrainState(0, 0, 0).losses
    state.step += 1  # mutable, as the lesson's training loop needs
    assert state.step == 4


def test_seed_everything_makes_python_numpy_and_torch_repeat() -> None:
    draws = []
    for _ in range(2):
        ckpt.seed_everything(7)
        draws.append((random.random(), float(np.random.rand()), torch.rand(2).tolist()))
    assert draws[0] == draws[1]


def test_make_model_and_optimizer_take_the_lessons_arguments() -> None:
    model, optimizer, scheduler = _components(total_steps=10, lr=0.01)
    assert isinstance(model, nn.Module)
    assert model(torch.randn(5, 8)).shape == (5, 4)
    assert isinstance(optimizer, torch.optim.AdamW) and optimizer.param_groups[0]["lr"] == 0.01
    assert isinstance(scheduler, torch.optim.lr_scheduler.CosineAnnealingLR) and scheduler.T_max == 10
    positional = ckpt.make_optimizer_and_scheduler(ckpt.make_model(4, 6, 3), 0.1, 20)
    assert positional[0].param_groups[0]["lr"] == 0.1 and positional[1].T_max == 20


def test_synthetic_loader_yields_the_lessons_batches_from_the_given_generator() -> None:
    batches = list(ckpt.synthetic_loader(4, 3, 16, 5, torch.Generator().manual_seed(1)))
    assert len(batches) == 3
    for x, y in batches:
        assert x.shape == (4, 16) and x.dtype == torch.float32
        assert y.shape == (4,) and y.dtype == torch.int64 and 0 <= int(y.min()) and int(y.max()) < 5
    again = list(ckpt.synthetic_loader(4, 3, 16, 5, torch.Generator().manual_seed(1)))
    assert all(
        torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(batches, again, strict=True)
    )


def test_tuple_from_nested_turns_lists_into_tuples_all_the_way_down() -> None:
    assert ckpt.tuple_from_nested([1, [2, [3]], "s"]) == (1, (2, (3,)), "s")
    assert ckpt.tuple_from_nested(5) == 5


def test_capture_and_restore_rng_state_put_every_generator_back() -> None:
    state = ckpt.capture_rng_state()
    assert {"python", "numpy", "torch_cpu"} <= set(state)  # the lesson's keys ("torch_cuda" always here)
    first = (random.random(), float(np.random.rand()), torch.rand(3))
    ckpt.restore_rng_state(state)
    second = (random.random(), float(np.random.rand()), torch.rand(3))
    assert first[:2] == second[:2] and torch.equal(first[2], second[2])


# --- files ---------------------------------------------------------------------------


def test_atomic_save_creates_the_folder_and_leaves_no_temp_file(tmp_path: Path) -> None:
    target = tmp_path / "new" / "ckpt.pt"  # the lesson's atomic_save makes missing parents too
    ckpt.atomic_save({"schema": ckpt.CHECKPOINT_SCHEMA, "value": torch.zeros(3)}, target)
    assert target.is_file()
    assert [p.name for p in target.parent.iterdir()] == ["ckpt.pt"]
    assert torch.equal(torch.load(target, weights_only=True)["value"], torch.zeros(3))


def test_atomic_write_json_round_trips(tmp_path: Path) -> None:
    ckpt.atomic_write_json({"schema": ckpt.CHECKPOINT_SCHEMA, "n": 7}, tmp_path / "index.json")
    assert json.loads((tmp_path / "index.json").read_text(encoding="utf-8"))["n"] == 7


def test_file_sha256_is_the_plain_sha256_of_the_files_bytes(tmp_path: Path) -> None:
    path = tmp_path / "w.pt"
    ckpt.atomic_save({"w": torch.ones(4)}, path)
    assert ckpt.file_sha256(path) == hashlib.sha256(path.read_bytes()).hexdigest()
    other = tmp_path / "notes.txt"
    other.write_bytes(b"not a checkpoint")
    assert ckpt.file_sha256(other) == hashlib.sha256(b"not a checkpoint").hexdigest()


def test_file_sha256_refuses_a_fifo_instead_of_waiting_for_a_writer(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "pipe")
    with pytest.raises(ckpt.CheckpointError, match="not a regular file"):
        ckpt.file_sha256(tmp_path / "pipe")


def test_single_file_round_trip_restores_counters_and_every_tensor(tmp_path: Path) -> None:
    ckpt.seed_everything(0)
    model, optimizer, scheduler = _components()
    state = ckpt.TrainState(3, 1, 2, [0.5, 0.4, 0.3])
    ckpt.save_checkpoint(
        model, optimizer, scheduler, state, out_path=tmp_path / "ckpt.pt", extras={"note": "x"}
    )
    ckpt.seed_everything(99)
    model2, optimizer2, scheduler2 = _components()
    assert not any(torch.allclose(a, b) for a, b in zip(model.parameters(), model2.parameters(), strict=True))
    loaded = ckpt.load_checkpoint(tmp_path / "ckpt.pt", model2, optimizer2, scheduler2)
    assert isinstance(loaded, ckpt.TrainState)
    assert (loaded.step, loaded.epoch, loaded.batch_in_epoch, loaded.losses) == (3, 1, 2, [0.5, 0.4, 0.3])
    assert _tensors_equal(model, model2)
    payload = ckpt.read_checkpoint(tmp_path / "ckpt.pt")
    assert payload["schema"].startswith("ckpt") and payload["schema"] == ckpt.CHECKPOINT_SCHEMA
    assert payload["extras"] == {"note": "x"}


def test_save_checkpoint_refuses_a_schema_it_cannot_write_before_writing(tmp_path: Path) -> None:
    model, optimizer, scheduler = _components()
    with pytest.raises(ValueError, match="write_legacy_v1_checkpoint"):
        ckpt.save_checkpoint(
            model, optimizer, scheduler, ckpt.TrainState(), tmp_path / "a.pt", schema="ckpt.v1"
        )
    assert list(tmp_path.iterdir()) == []


def test_shard_layout_is_round_robin_over_sorted_keys_and_complete() -> None:
    state_dict = ckpt.make_model(4, 6, 3).state_dict()
    layout = ckpt.shard_keys_by_prefix(state_dict, 3)
    assert sorted(layout) == [0, 1, 2]
    assert sorted(k for keys in layout.values() for k in keys) == sorted(state_dict)
    sizes = [len(keys) for keys in layout.values()]
    assert max(sizes) - min(sizes) <= 1
    assert layout[0] == sorted(state_dict)[0::3]


def test_shard_layout_refuses_zero_shards_with_a_value_error() -> None:
    with pytest.raises(ValueError, match="num_shards"):
        ckpt.shard_keys_by_prefix({"a": torch.zeros(1)}, 0)


def test_sharded_save_writes_the_lessons_files_and_loads_back(tmp_path: Path) -> None:
    ckpt.seed_everything(0)
    model, optimizer, scheduler = _components()
    ckpt.save_sharded_checkpoint(
        model, optimizer, scheduler, ckpt.TrainState(1, 0, 1, [0.9]), tmp_path, num_shards=2
    )
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["index.json", "meta.pt", "model.shard-000.pt", "model.shard-001.pt"]
    index = json.loads((tmp_path / "index.json").read_text(encoding="utf-8"))
    assert index["num_shards"] == 2 and len(index["shards"]) == 2
    model2, optimizer2, scheduler2 = _components()
    loaded = ckpt.load_sharded_checkpoint(tmp_path, model2, optimizer2, scheduler2)
    assert (loaded.step, loaded.losses) == (1, [0.9]) and _tensors_equal(model, model2)


def test_a_byte_appended_to_a_shard_is_refused_with_a_value_error(tmp_path: Path) -> None:
    # The lesson asserts here (AssertionError); ours raises CheckpointError, a ValueError.
    ckpt.seed_everything(0)
    model, optimizer, scheduler = _components()
    ckpt.save_sharded_checkpoint(
        model, optimizer, scheduler, ckpt.TrainState(1, 0, 1, [0.9]), tmp_path, num_shards=2
    )
    shard = tmp_path / "model.shard-000.pt"
    shard.write_bytes(shard.read_bytes() + b"\x00")
    with pytest.raises(ValueError, match="model.shard-000.pt"):
        ckpt.load_sharded_checkpoint(tmp_path, *_components())


# --- the lesson's training loop ----------------------------------------------------------


def test_step_one_takes_one_step_and_returns_the_loss_as_a_float() -> None:
    ckpt.seed_everything(0)
    model, optimizer, scheduler = _components()
    before = [p.detach().clone() for p in model.parameters()]
    x, y = next(ckpt.synthetic_loader(4, 1, 8, 4, torch.Generator().manual_seed(0)))
    loss = ckpt.step_one(model, optimizer, scheduler, x, y, nn.CrossEntropyLoss())
    assert isinstance(loss, float) and loss > 0
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    assert scheduler.last_epoch == 1


def _train(state: ckpt.TrainState, model, optimizer, scheduler, stop_step: int) -> ckpt.TrainState:
    return ckpt.train_until(
        model,
        optimizer,
        scheduler,
        nn.CrossEntropyLoss(),
        state,
        stop_step=stop_step,
        batches_per_epoch=5,
        batch_size=4,
        in_dim=8,
        out_dim=4,
    )


def test_train_until_updates_the_state_in_place_and_rolls_over_epochs() -> None:
    ckpt.seed_everything(3)
    state = ckpt.TrainState(0, 0, 0)
    returned = _train(state, *_components(total_steps=12), stop_step=7)
    assert returned is state
    assert (state.step, state.epoch, state.batch_in_epoch, len(state.losses)) == (7, 1, 2, 7)
    _train(state, *_components(total_steps=12), stop_step=10)
    assert (state.step, state.epoch, state.batch_in_epoch) == (10, 2, 0)  # a finished epoch rolls over


def test_train_until_resumed_mid_epoch_from_a_checkpoint_repeats_the_uninterrupted_losses(
    tmp_path: Path,
) -> None:
    # The lesson's in-process demo, by hand: train to 7 (mid-epoch), save, carry on to 12;
    # then a fresh model restored from the checkpoint trains 7 -> 12 on the same batches.
    ckpt.seed_everything(3)
    model, optimizer, scheduler = _components(total_steps=12)
    state = _train(ckpt.TrainState(0, 0, 0), model, optimizer, scheduler, stop_step=7)
    ckpt.save_checkpoint(model, optimizer, scheduler, state, tmp_path / "ckpt.pt")
    full = list(_train(state, model, optimizer, scheduler, stop_step=12).losses)
    ckpt.seed_everything(3)
    model2, optimizer2, scheduler2 = _components(total_steps=12)
    loaded = ckpt.load_checkpoint(tmp_path / "ckpt.pt", model2, optimizer2, scheduler2)
    assert (loaded.epoch, loaded.batch_in_epoch) == (1, 2)
    resumed = _train(loaded, model2, optimizer2, scheduler2, stop_step=12).losses
    assert resumed == full and len(resumed) == 12


# --- the demo, as the lesson's tests and main() call it -------------------------------------


@pytest.fixture(scope="module")
def single_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, Path]:
    ckpt_dir = tmp_path_factory.mktemp("single")
    return ckpt.run_resume_demo(
        total_steps=14, interrupt_at=5, ckpt_dir=ckpt_dir, sharded=False, seed=3
    ), ckpt_dir


@pytest.fixture(scope="module")
def sharded_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, Path]:
    ckpt_dir = tmp_path_factory.mktemp("sharded")
    sizes = {"in_dim": 6, "hidden": 10, "out_dim": 2, "batch_size": 3, "batches_per_epoch": 4}
    result = ckpt.run_resume_demo(
        total_steps=12, interrupt_at=4, ckpt_dir=ckpt_dir, sharded=True, num_shards=3, seed=5, **sizes
    )
    return result, ckpt_dir


def test_single_file_demo_resumes_within_the_lessons_tolerance_into_ckpt_pt(single_run) -> None:
    result, ckpt_dir = single_run
    assert result["max_loss_diff_after_resume"] < 1e-5
    assert {
        "interrupt_at",
        "total_steps",
        "max_loss_diff_after_resume",
        "full_losses",
        "resumed_losses",
    } <= set(result)
    assert (result["interrupt_at"], result["total_steps"], result["sharded"]) == (5, 14, False)
    assert (ckpt_dir / "ckpt.pt").is_file()
    assert ckpt.read_checkpoint(ckpt_dir / "ckpt.pt")["state"]["step"] == 5


def test_demo_losses_cover_the_whole_run_in_both_lists(single_run) -> None:
    result, _ = single_run
    assert len(result["full_losses"]) == len(result["resumed_losses"]) == 14
    assert result["resumed_losses"][:5] == result["full_losses"][:5]  # the history the checkpoint carried
    tail = zip(result["resumed_losses"][5:], result["full_losses"][5:], strict=True)
    assert max(abs(a - b) for a, b in tail) == result["max_loss_diff_after_resume"]


def test_sharded_demo_writes_index_meta_and_shards_straight_into_ckpt_dir(sharded_run) -> None:
    result, ckpt_dir = sharded_run
    assert result["max_loss_diff_after_resume"] < 1e-5 and result["sharded"] is True
    index = json.loads((ckpt_dir / "index.json").read_text(encoding="utf-8"))
    assert index["num_shards"] == 3 and len(index["shards"]) == 3
    assert (ckpt_dir / "meta.pt").is_file()


def test_demo_builds_the_model_from_the_sizes_it_is_given(sharded_run) -> None:
    _, ckpt_dir = sharded_run
    model = ckpt.make_model(6, 10, 2)  # the sizes the run was given: its checkpoint fits this model
    optimizer, scheduler = ckpt.make_optimizer_and_scheduler(model, lr=0.01, total_steps=12)
    assert ckpt.load_sharded_checkpoint(ckpt_dir, model, optimizer, scheduler).step == 4
    default = ckpt.make_model(16, 24, 4)  # and not the lesson's default model
    with pytest.raises(ValueError):
        ckpt.load_sharded_checkpoint(ckpt_dir, default, *ckpt.make_optimizer_and_scheduler(default, 0.01, 12))


def test_parse_args_has_the_lessons_flags_and_defaults() -> None:
    args = ckpt.parse_args([])
    assert (args.total_steps, args.interrupt_at, args.sharded, args.num_shards, args.seed) == (
        24,
        10,
        False,
        3,
        11,
    )
    args = ckpt.parse_args(["--sharded", "--num-shards", "2", "--total-steps", "8", "--interrupt-at", "3"])
    assert (args.sharded, args.num_shards, args.total_steps, args.interrupt_at) == (True, 2, 8, 3)


def test_main_runs_both_variants_prints_them_and_writes_the_lessons_summary(tmp_path: Path, capsys) -> None:
    rc = ckpt.main(["--total-steps", "6", "--interrupt-at", "3", "--num-shards", "2", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert rc == 0
    assert (
        "running resume demo (single file checkpoint)" in out
        and "running resume demo (sharded checkpoint)" in out
    )
    assert "full_losses" not in out and "resumed_losses" not in out
    summary = json.loads((tmp_path / "resume-demo.json").read_text(encoding="utf-8"))
    assert summary["schema"] == "resume-demo.v1"
    assert summary["single"] == {"max_loss_diff_after_resume": 0.0, "interrupt_at": 3, "total_steps": 6}
    assert summary["sharded"]["num_shards"] == 2 and summary["sharded"]["max_loss_diff_after_resume"] == 0.0


def test_main_reports_a_drifted_resume_as_exit_1_not_a_traceback(tmp_path: Path, monkeypatch, capsys) -> None:
    def drifted(**kwargs: object) -> dict:
        return {"max_loss_diff_after_resume": 0.5, "interrupt_at": 3, "total_steps": 6, "full_losses": []}

    import ckpt_lesson.course.lesson_run as lesson_run  # the demo's logic; cli/lesson_demo parses flags

    monkeypatch.setattr(lesson_run, "run_resume_demo", drifted)
    assert ckpt.main(["--out", str(tmp_path)]) == 1
    assert "FAILED single: loss drifted after resume" in capsys.readouterr().err


def test_main_names_the_flag_when_the_interrupt_is_outside_the_run(tmp_path: Path, capsys) -> None:
    assert ckpt.main(["--total-steps", "5", "--interrupt-at", "5", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error:") and "--interrupt-at" in err and len(err.strip().splitlines()) == 1


def test_the_lesson_demo_is_a_command_of_python_m_ckpt_lesson(capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        cli_main(["lesson-demo", "--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    for flag in ("--total-steps", "--interrupt-at", "--sharded", "--num-shards", "--seed", "--out"):
        assert flag in out
