"""Every generator a training step touches is captured, survives a weights-only save, and replays."""

from __future__ import annotations

import copy
import random

import numpy as np
import pytest
import torch

from ckpt_lesson.errors import CheckpointError, UnsafeCheckpointError
from ckpt_lesson.files.atomic import atomic_save
from ckpt_lesson.files.checkpoint import load_verified_file
from ckpt_lesson.files.rng import RNG_SOURCES, capture_rng_state, restore_rng_state, validate_rng_state


def draw_python() -> list[float]:
    return [random.random() for _ in range(5)] + [random.gauss(0.0, 1.0)]


def draw_numpy() -> list[float]:
    return np.random.rand(5).tolist() + [float(np.random.normal())]


def draw_torch_cpu() -> list[float]:
    return torch.rand(5).tolist()


DRAWS = {"python": draw_python, "numpy": draw_numpy, "torch_cpu": draw_torch_cpu}


def scramble_all_generators() -> None:
    random.seed(12345)
    np.random.seed(12345)
    torch.manual_seed(12345)


@pytest.mark.parametrize("source", sorted(DRAWS))
def test_restore_replays_each_source_exactly(source):
    draw = DRAWS[source]
    draw()  # move away from any seeded start
    saved = capture_rng_state()
    expected = draw()
    scramble_all_generators()
    assert draw() != expected  # the scramble really moved this generator
    restore_rng_state(saved)
    assert draw() == expected


def test_gauss_cache_of_python_and_numpy_is_restored_too():
    # gauss() and the legacy normal() keep a second value cached between calls:
    # capture in the middle of a pair so the cache is non-empty.
    random.gauss(0.0, 1.0)
    np.random.seed(3)
    np.random.standard_normal()
    saved = capture_rng_state()
    assert saved["python"]["gauss_next"] is not None
    assert saved["numpy"]["has_gauss"] == 1
    expected = (random.gauss(0.0, 1.0), float(np.random.standard_normal()))
    scramble_all_generators()
    restore_rng_state(saved)
    assert (random.gauss(0.0, 1.0), float(np.random.standard_normal())) == expected


def test_captured_state_survives_atomic_save_and_weights_only_load_without_allowlisting(tmp_path):
    saved = capture_rng_state()
    expected = {name: draw() for name, draw in DRAWS.items()}
    atomic_save({"rng": saved}, tmp_path / "rng.pt")
    loaded, _ = load_verified_file(tmp_path / "rng.pt")
    scramble_all_generators()
    restore_rng_state(loaded["rng"])
    assert {name: draw() for name, draw in DRAWS.items()} == expected


def test_raw_numpy_legacy_state_is_refused_by_the_weights_only_loader(tmp_path):
    # This is why capture_rng_state() converts NumPy's key array with tolist():
    # the raw tuple holds an ndarray, and the weights-only unpickler refuses it.
    atomic_save({"numpy": np.random.get_state()}, tmp_path / "raw.pt")
    with pytest.raises(UnsafeCheckpointError, match="raw.pt"):
        load_verified_file(tmp_path / "raw.pt")


def test_capture_holds_only_tensors_and_plain_values():
    def plain(value):
        if isinstance(value, dict):
            return all(isinstance(k, str) and plain(v) for k, v in value.items())
        if isinstance(value, (list, tuple)):
            return all(plain(v) for v in value)
        return value is None or isinstance(value, (int, float, str, torch.Tensor))

    saved = capture_rng_state()
    assert tuple(saved) == RNG_SOURCES
    assert plain(saved)


def _broken(mutate):
    state = copy.deepcopy(capture_rng_state())
    mutate(state)
    return state


MALFORMED = {
    "not a dict": lambda s: None,
    "missing numpy": lambda s: s.pop("numpy"),
    "python state too short": lambda s: s["python"].update(state=s["python"]["state"][:10]),
    "numpy keys too short": lambda s: s["numpy"].update(keys=[1, 2, 3]),
    "numpy unknown generator": lambda s: s["numpy"].update(bit_generator="NotAGenerator"),
    "torch state wrong size": lambda s: s.update(torch_cpu=torch.zeros(7, dtype=torch.uint8)),
    "torch state wrong dtype": lambda s: s.update(torch_cpu=s["torch_cpu"].float()),
    "torch state a string": lambda s: s.update(torch_cpu="abc"),
    "cuda not a list": lambda s: s.update(torch_cuda=3),
    "gauss_next not a number": lambda s: s["python"].update(gauss_next="x"),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_malformed_state_raises_checkpoint_error(case):
    state = None if case == "not a dict" else _broken(MALFORMED[case])
    with pytest.raises(CheckpointError):
        restore_rng_state(state)
    with pytest.raises(CheckpointError):
        validate_rng_state(state)


def test_a_malformed_state_changes_no_generator_at_all():
    # Python's block is fine and NumPy's is broken: restoring must not stop half way.
    random.seed(1)
    saved = capture_rng_state()
    random.seed(2)
    bad = _broken(lambda s: s["numpy"].update(keys=[1, 2, 3]))
    bad["python"] = saved["python"]
    before = random.getstate()
    with pytest.raises(CheckpointError, match="malformed"):
        restore_rng_state(bad)
    assert random.getstate() == before


def test_cuda_entries_saved_elsewhere_are_refused_on_a_machine_with_other_device_count(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    state = capture_rng_state()
    state["torch_cuda"] = [torch.zeros(16, dtype=torch.uint8), torch.zeros(16, dtype=torch.uint8)]
    with pytest.raises(CheckpointError, match="2 CUDA device"):
        restore_rng_state(state)


def test_device_count_mismatch_is_refused_when_this_process_sees_more_gpus(monkeypatch):
    state = capture_rng_state()
    state["torch_cuda"] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(CheckpointError, match="sees 2"):
        restore_rng_state(state)


def test_allow_device_change_skips_cuda_but_restores_the_cpu_generators(monkeypatch):
    state = capture_rng_state()
    expected = draw_torch_cpu()
    state["torch_cuda"] = [torch.zeros(16, dtype=torch.uint8)]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    scramble_all_generators()
    restore_rng_state(state, allow_device_change=True)
    assert draw_torch_cpu() == expected


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (this machine has none)")
def test_cuda_generators_round_trip_through_a_weights_only_save(tmp_path):
    saved = capture_rng_state()
    assert len(saved["torch_cuda"]) == torch.cuda.device_count()
    expected = torch.rand(5, device="cuda").tolist()
    atomic_save({"rng": saved}, tmp_path / "rng.pt")
    loaded, _ = load_verified_file(tmp_path / "rng.pt")
    torch.cuda.manual_seed_all(999)
    restore_rng_state(loaded["rng"])
    assert torch.rand(5, device="cuda").tolist() == expected
