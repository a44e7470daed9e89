"""Per-rank blobs, the state dicts handed to DCP, and the state API on 2 gloo ranks (DDP and FSDP2)."""

from __future__ import annotations

import io
import json
import pickle
import random
from pathlib import Path

import numpy as np
import pytest
import torch
from _distributed_local import RunsCode, save_locally
from _distributed_workers import make_run
from _state_api_workers import w_state_api_resume, w_state_api_train

import ckpt_lesson as cl
from ckpt_lesson import (
    CheckpointError,
    StateMismatchError,
    TrainState,
    UnsafeCheckpointError,
    capture_rng_state,
)
from ckpt_lesson.distributed import DistributedCheckpointManager
from ckpt_lesson.distributed.state import (
    dcp_state_dict,
    decode_rank_state,
    encode_rank_state,
    rank_key,
    reseed_generators,
)
from ckpt_lesson.faults.rank_launch import launch


def test_a_rank_blob_round_trips_counters_rng_and_a_data_position_with_tensors() -> None:
    state = TrainState(step=7, epoch=1, batch_in_epoch=3, losses=[0.5, 0.25])
    data = {"sampler": torch.Generator().manual_seed(3).get_state(), "order": [3, 1, 2]}
    decoded = decode_rank_state(encode_rank_state(state, capture_rng_state(), data), where="t")
    assert decoded["train"] == state
    assert torch.equal(decoded["data"]["sampler"], data["sampler"]) and decoded["data"]["order"] == [3, 1, 2]
    assert torch.equal(decoded["rng"]["torch_cpu"], torch.get_rng_state())


def test_a_data_state_a_weights_only_load_cannot_read_is_refused_when_saving() -> None:
    with pytest.raises(CheckpointError, match=r"weights-only.*tolist"):
        encode_rank_state(TrainState(step=1), capture_rng_state(), {"perm": np.arange(4)})


def test_a_state_that_is_not_a_train_state_is_refused() -> None:
    with pytest.raises(CheckpointError, match="TrainState"):
        encode_rank_state({"step": 1}, capture_rng_state(), None)  # type: ignore[arg-type]


def test_a_blob_that_is_not_plain_data_is_refused_as_unsafe_and_runs_nothing(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    buf = io.BytesIO()
    torch.save({"train": {}, "rng": {}, "data": RunsCode(marker)}, buf, pickle_module=pickle)
    with pytest.raises(UnsafeCheckpointError, match="not plain data"):
        decode_rank_state(buf.getvalue(), where="step 4/rank1_local")
    assert not marker.exists()


@pytest.mark.parametrize("blob", [b"junk", "text", {"train": {}}])
def test_a_blob_that_is_not_ours_is_a_state_mismatch(blob: object) -> None:
    with pytest.raises(StateMismatchError):
        decode_rank_state(blob, where="step 4/rank0_local")


def test_a_blob_missing_a_section_is_a_state_mismatch() -> None:
    buf = io.BytesIO()
    torch.save({"train": TrainState().to_dict(), "rng": capture_rng_state()}, buf)
    with pytest.raises(StateMismatchError, match="exactly train, rng and data"):
        decode_rank_state(buf.getvalue(), where="w")


def test_reseeding_is_reproducible_distinct_per_rank_and_reaches_every_generator() -> None:
    assert reseed_generators(0, 40, 1) == reseed_generators(0, 40, 1)
    draws = (random.random(), np.random.rand(), torch.rand(1).item())
    reseed_generators(0, 40, 1)
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == draws
    assert len({reseed_generators(0, 40, rank) for rank in range(8)}) == 8
    assert reseed_generators(1, 40, 0) != reseed_generators(0, 40, 0)


def test_the_save_state_holds_this_ranks_key_and_the_template_has_a_slot_for_the_key_to_load() -> None:
    model, opt, sched, _ = make_run("plain", 1, 0)
    saved = dcp_state_dict(model, opt, sched, {rank_key(3): b"x"})
    assert set(saved) == {"model", "optim", "scheduler", rank_key(3)} and saved[rank_key(3)] == b"x"
    template = dcp_state_dict(model, opt, None, {rank_key(0): b""})
    assert set(template) == {"model", "optim", "rank0_local"} and template["rank0_local"] == b""


@pytest.mark.parametrize("kind", ["ddp", "fsdp"])
def test_a_state_api_save_on_two_ranks_resumes_bit_for_bit(tmp_path, kind):
    assert launch(w_state_api_train, 2, tmp_path, str(tmp_path), kind) == [0, 0]
    assert launch(w_state_api_resume, 2, tmp_path, str(tmp_path), kind) == [0, 0]
    for rank in (0, 1):
        trained = json.loads((tmp_path / kind / f"train-{rank}.json").read_text())
        resumed = json.loads((tmp_path / kind / f"resume-{rank}.json").read_text())
        assert resumed["step"] == 3 and resumed["losses"] == trained  # exact, per rank
        assert resumed["h"] == [rank + 3.0, rank + 3.0]  # each rank gets its own values back


def test_two_modules_are_refused_with_the_fix(tmp_path):
    mgr = DistributedCheckpointManager(tmp_path, keep_last=2, every_steps=1)
    with pytest.raises(cl.CheckpointError, match="one nn.Module part.*ModuleDict"):
        mgr.save(1, {"g": torch.nn.Linear(2, 2), "d": torch.nn.Linear(2, 2)})
    mgr.close()


def test_a_positional_save_is_refused_by_a_state_api_restore_naming_the_difference(tmp_path):
    save_locally(tmp_path, steps=(2,))
    model = torch.nn.Sequential(
        torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Dropout(0.1), torch.nn.Linear(16, 4)
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    mgr = DistributedCheckpointManager(tmp_path, keep_last=5, every_steps=2)
    # The positional save holds a scheduler in DCP's shared state; the state API keeps it per rank.
    with pytest.raises(cl.StateMismatchError, match="saved with a scheduler"):
        mgr.restore_latest({"model": model, "optimizer": opt})
    mgr.close()


def test_wrapped_saves_restore_into_plain_models_and_the_reverse_in_every_saver(tmp_path):
    from _state_api_workers import w_wrapped_round_trips

    assert launch(w_wrapped_round_trips, 1, tmp_path, str(tmp_path)) == [0]
    results = json.loads((tmp_path / "wrapped.json").read_text())
    assert len(results) == 6
    failed = {case: [saver for saver, ok in savers.items() if not ok] for case, savers in results.items()}
    assert failed == {case: [] for case in results}


def test_a_model_without_an_optimizer_saves_and_restores_through_dcp(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    mgr = DistributedCheckpointManager(tmp_path, keep_last=2, every_steps=1)
    mgr.save(4, {"model": model, "ema_decay": 0.99})
    mgr.close()
    fresh = torch.nn.Linear(3, 2)
    mgr = DistributedCheckpointManager(tmp_path, keep_last=2, every_steps=1)
    restored = mgr.restore_latest({"model": fresh, "ema_decay": None})
    mgr.close()
    assert restored.step == 4 and restored.values == {"ema_decay": 0.99}
    assert torch.equal(fresh.weight, model.weight) and torch.equal(fresh.bias, model.bias)


@pytest.mark.parametrize("given", ["optimizer is None", "scheduler left out", "an extra scheduler"])
def test_a_restore_refused_for_its_part_names_leaves_the_weights_and_moments_untouched(tmp_path, given):
    # The part check used to run after DCP had loaded into the live model and optimizer (and after the
    # load template had created a fresh optimizer's moments): now the rank's blob is read and checked first.
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1)
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    mgr = DistributedCheckpointManager(tmp_path, keep_last=2, every_steps=1)
    mgr.save(4, {"model": model, "optimizer": opt, "scheduler": sched})
    mgr.close()
    fresh = torch.nn.Linear(3, 2)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=0.1)
    state = {
        "model": fresh,
        "optimizer": fresh_opt,
        "scheduler": torch.optim.lr_scheduler.StepLR(fresh_opt, 1),
    }
    if given == "optimizer is None":
        state["optimizer"], pattern = None, r"part 'optimizer'.*holds None"
    elif given == "an extra scheduler":
        state["warmup"], pattern = torch.optim.lr_scheduler.StepLR(fresh_opt, 2), r"parts \['warmup'\]"
    else:
        del state["scheduler"]
        pattern = r"parts \['scheduler'\]"
    before = [p.clone() for p in fresh.parameters()]
    mgr = DistributedCheckpointManager(tmp_path, keep_last=2, every_steps=1)
    with pytest.raises(cl.StateMismatchError, match=pattern):
        mgr.restore_latest(state)
    mgr.close()
    assert all(torch.equal(a, b) for a, b in zip(before, fresh.parameters(), strict=True))
    assert fresh_opt.state_dict()["state"] == {}  # no moments loaded either
