"""Capture and restore every random number generator a training step touches.

Dropout masks come from torch's CPU (or CUDA) generator, shuffles and
augmentations often come from NumPy or Python's ``random``. Resume without all
of them and the run continues *plausibly* but not *identically*: the loss curve
drifts away from the uninterrupted one and nobody can tell a bug from noise.

The state is stored only as tensors and plain Python values (ints, floats, str,
lists, dicts) so that ``torch.load(weights_only=True)`` reads it with no
allowlisting. NumPy's legacy state holds an ``ndarray``, which the weights-only
unpickler refuses, so its key array goes through ``tolist()``.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch

from ckpt_lesson.errors import CheckpointError

__all__ = ["RNG_SOURCES", "capture_rng_state", "restore_rng_state", "tuple_from_nested", "validate_rng_state"]

#: The generators captured, in the order they are restored.
RNG_SOURCES = ("python", "numpy", "torch_cpu", "torch_cuda")


def capture_rng_state() -> dict[str, Any]:
    """Snapshot Python, NumPy, torch CPU and every CUDA device's generator.

    Returns:
        A dict with keys ``RNG_SOURCES``; every value is a tensor or a plain
        Python value, safe for ``torch.load(weights_only=True)``.

    Example:
        >>> state = capture_rng_state()
        >>> a = torch.rand(3)
        >>> restore_rng_state(state)
        >>> torch.equal(a, torch.rand(3))
        True
    """
    version, internal, gauss_next = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state()
    cuda: list[torch.Tensor] = []
    if torch.cuda.is_available():
        cuda = [t.clone() for t in torch.cuda.get_rng_state_all()]
    return {
        "python": {"version": int(version), "state": list(internal), "gauss_next": gauss_next},
        "numpy": {
            "bit_generator": str(name),
            "keys": np.asarray(keys).tolist(),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        },
        "torch_cpu": torch.get_rng_state().clone(),
        "torch_cuda": cuda,
    }


def restore_rng_state(state: dict[str, Any], *, allow_device_change: bool = False) -> None:
    """Put every generator back exactly where :func:`capture_rng_state` found it.

    Every source is validated first, so a malformed state changes no
    generator at all (never "Python restored, NumPy not").

    Args:
        state: A dict produced by :func:`capture_rng_state` (possibly after a
            save and a weights-only load).
        allow_device_change: Skip the CUDA generators when the saved number of
            CUDA devices differs from this process's. The run is then *not*
            bit-identical; the default refuses instead.

    Raises:
        CheckpointError: A source is missing or malformed, or the CUDA device
            count differs and ``allow_device_change`` is false.

    Example:
        >>> saved = capture_rng_state()
        >>> restore_rng_state(saved)
    """
    python, legacy_numpy, cpu, cuda = validate_rng_state(state, allow_device_change=allow_device_change)
    random.setstate(python)
    np.random.set_state(legacy_numpy)
    torch.set_rng_state(cpu)
    if cuda:
        torch.cuda.set_rng_state_all(cuda)


def tuple_from_nested(obj: Any) -> Any:
    """Turn every list inside ``obj`` into a tuple, recursively; other values pass through.

    The lesson's helper: ``random.setstate`` and NumPy's ``set_state`` want
    tuples, and a state that went through JSON or ``tolist()`` comes back as
    lists. (:func:`restore_rng_state` does this conversion itself, with checks.)

    Example:
        >>> tuple_from_nested([3, [1, 2], {"k": [4]}])
        (3, (1, 2), {'k': [4]})
    """
    if isinstance(obj, list):
        return tuple(tuple_from_nested(x) for x in obj)
    return obj


def validate_rng_state(
    state: Any, *, allow_device_change: bool = False
) -> tuple[tuple[Any, ...], tuple[Any, ...], torch.Tensor, list[torch.Tensor]]:
    """Check that :func:`restore_rng_state` would succeed, changing no generator.

    Loaders call this before they touch the model, so that a checkpoint with
    a bad RNG block is refused before anything has been overwritten. Each
    value is tried on a *throwaway* generator of the same kind, which runs the
    library's own checks (lengths, types) without touching the global generators.

    Returns:
        What the setters take: Python's, NumPy's, torch CPU's and the CUDA states.

    Raises:
        CheckpointError: As :func:`restore_rng_state`.

    Example:
        >>> _ = validate_rng_state(capture_rng_state())
    """
    if not isinstance(state, dict):
        raise CheckpointError(
            f"RNG state must be a dict with keys {RNG_SOURCES}, got {type(state).__name__}; "
            "pass the value returned by capture_rng_state()."
        )
    missing = [k for k in RNG_SOURCES if k not in state]
    if missing:
        raise CheckpointError(
            f"RNG state lacks {missing}; it was not written by capture_rng_state(). "
            "Re-save the checkpoint with the current package to capture every generator."
        )
    if not isinstance(state["torch_cuda"], (list, tuple)):
        raise CheckpointError(
            f"RNG state's 'torch_cuda' must be a list of tensors, got {type(state['torch_cuda']).__name__}; "
            "it must come from capture_rng_state()."
        )
    cuda_saved = list(state["torch_cuda"])
    here = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if len(cuda_saved) != here and not allow_device_change:
        raise CheckpointError(
            f"RNG state was saved with {len(cuda_saved)} CUDA device(s) but this process sees {here}. "
            "Resume on the same devices for a bit-identical run, or pass "
            "allow_device_change=True to skip the CUDA generators."
        )
    try:
        py = state["python"]
        gauss = py["gauss_next"]
        gauss = None if gauss is None else float(gauss)
        python = (int(py["version"]), tuple(int(x) for x in py["state"]), gauss)
        random.Random().setstate(python)
        npst = state["numpy"]
        legacy_numpy = (
            str(npst["bit_generator"]),
            np.asarray(npst["keys"], dtype=np.uint32),
            int(npst["pos"]),
            int(npst["has_gauss"]),
            float(npst["cached_gaussian"]),
        )
        np.random.RandomState().set_state(legacy_numpy)
        cpu = _as_byte_tensor(state["torch_cpu"])
        torch.Generator().set_state(cpu)
        cuda: list[torch.Tensor] = []
        if len(cuda_saved) == here and here:
            cuda = [_as_byte_tensor(t) for t in cuda_saved]
            for index, t in enumerate(cuda):
                torch.Generator(device=f"cuda:{index}").set_state(t)
    except (KeyError, IndexError, TypeError, ValueError, RuntimeError, OverflowError) as exc:
        raise CheckpointError(
            f"RNG state is malformed ({type(exc).__name__}: {exc}); it must come from capture_rng_state()."
        ) from exc
    return python, legacy_numpy, cpu, cuda


def _as_byte_tensor(value: Any) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        if value.dtype != torch.uint8:
            raise TypeError(f"a generator state is a uint8 tensor, got dtype {value.dtype}")
        return value.detach().to("cpu")
    return torch.tensor(list(value), dtype=torch.uint8)
