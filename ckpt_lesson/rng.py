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

from .errors import CheckpointError

__all__ = ["RNG_SOURCES", "capture_rng_state", "restore_rng_state"]

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

    Args:
        state: A dict produced by :func:`capture_rng_state` (possibly after a
            save and a weights-only load).
        allow_device_change: Skip the CUDA generators when the saved number of
            CUDA devices differs from this process's. The run is then *not*
            bit-identical; the default refuses instead.

    Raises:
        CheckpointError: A source is missing or malformed, or the CUDA device
            count differs and ``allow_device_change`` is false.
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
    cuda = list(state["torch_cuda"])
    here = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if len(cuda) != here and not allow_device_change:
        raise CheckpointError(
            f"RNG state was saved with {len(cuda)} CUDA device(s) but this process sees {here}. "
            "Resume on the same devices for a bit-identical run, or pass "
            "allow_device_change=True to skip the CUDA generators."
        )
    try:
        py = state["python"]
        random.setstate((int(py["version"]), tuple(int(x) for x in py["state"]), py["gauss_next"]))
        npst = state["numpy"]
        np.random.set_state(
            (
                npst["bit_generator"],
                np.asarray(npst["keys"], dtype=np.uint32),
                int(npst["pos"]),
                int(npst["has_gauss"]),
                float(npst["cached_gaussian"]),
            )
        )
        torch.set_rng_state(_as_byte_tensor(state["torch_cpu"]))
    except (KeyError, TypeError, ValueError, RuntimeError) as exc:
        raise CheckpointError(
            f"RNG state is malformed ({type(exc).__name__}: {exc}); "
            "it must come from capture_rng_state()."
        ) from exc
    if len(cuda) == here and here:
        torch.cuda.set_rng_state_all([_as_byte_tensor(t) for t in cuda])


def _as_byte_tensor(value: Any) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", torch.uint8)
    return torch.tensor(list(value), dtype=torch.uint8)
