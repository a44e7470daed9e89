"""Per-rank blobs and the state dicts handed to DCP."""

from __future__ import annotations

import io
import pickle
import random
from pathlib import Path

import numpy as np
import pytest
import torch
from _distributed_local import RunsCode
from _distributed_workers import make_run

from ckpt_lesson import (
    CheckpointError,
    StateMismatchError,
    TrainState,
    UnsafeCheckpointError,
    capture_rng_state,
)
from ckpt_lesson.distributed.state import (
    build_load_template,
    build_save_state,
    decode_rank_state,
    encode_rank_state,
    rank_key,
    reseed_generators,
)


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
    saved = build_save_state(model, opt, sched, rank=3, blob=b"x")
    assert set(saved) == {"model", "optim", "scheduler", rank_key(3)}
    template = build_load_template(model, opt, None, blob_keys=[rank_key(0)])
    assert set(template) == {"model", "optim", "rank0_local"} and template["rank0_local"] == b""
