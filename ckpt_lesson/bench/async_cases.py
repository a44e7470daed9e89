"""Async-save cases of ``python -m ckpt_lesson bench``: ours against DCP's ``async_save``.

Two costs matter to a training loop that saves in the background:

* the **stall**: how long ``save_async`` keeps the training thread before it
  returns (the snapshot copy);
* the **slowdown**: how much slower the next training steps run while the
  writer serializes, hashes and fsyncs on other threads, competing for cores.

Each is measured for our :class:`~ckpt_lesson.runs.async_save.AsyncCheckpointer`
and for ``torch.distributed.checkpoint.async_save`` in one process (no process
group), with its default stager and with a persistent ``DefaultStager`` that
keeps its staging buffers between saves, as ours does. Every case saves once
untimed first, so reused buffers exist, as in a long run.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ckpt_lesson.files.train_state import TrainState
from ckpt_lesson.runs.async_save import AsyncCheckpointer
from ckpt_lesson.runs.manager import CheckpointManager

__all__ = ["STEPS_DURING_SAVE", "async_cases"]

#: Training steps timed right after a background save starts (and with no save, for the baseline).
STEPS_DURING_SAVE = 3


def _steps(workload: Any) -> float:
    start = time.perf_counter()
    for _ in range(STEPS_DURING_SAVE):
        workload.step()
    return time.perf_counter() - start


def _dcp_save(workload: Any, folder: Path, stager: Any) -> Any:
    import torch.distributed.checkpoint as dcp

    state = {"model": workload.model.state_dict(), "optim": workload.optimizer.state_dict()}
    with warnings.catch_warnings():  # DCP warns that no process group exists: intended here
        warnings.simplefilter("ignore")
        kwargs = {"async_stager": stager} if stager is not None else {}
        return dcp.async_save(state, checkpoint_id=str(folder), **kwargs)


def _dcp_case(workload: Any, persistent: bool, measure: str) -> Callable[[Path], float]:
    def case(d: Path) -> float:
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        # CPU only: no pinned or shared memory; synchronous staging, so the stall is the copy.
        stager = DefaultStager(StagingOptions(False, False, False, False)) if persistent else None
        try:
            _dcp_save(workload, d / "warm", stager).result()
            start = time.perf_counter()
            future = _dcp_save(workload, d / "timed", stager)
            stall = time.perf_counter() - start
            during = _steps(workload) if measure == "steps" else 0.0
            future.result()
        finally:
            if stager is not None:
                stager.close()
        return stall if measure == "stall" else during

    return case


def _ours(workload: Any, measure: str, nice: int = 0) -> Callable[[Path], float]:
    def case(d: Path) -> float:
        mgr = CheckpointManager(d / "run", every_steps=1)
        with AsyncCheckpointer(mgr, writer_nice=nice) as ckpt:
            ckpt.save_async(workload.model, workload.optimizer, workload.scheduler, TrainState(step=1))
            ckpt.wait()  # a first save fills the buffers, as in a long run
            start = time.perf_counter()
            ckpt.save_async(workload.model, workload.optimizer, workload.scheduler, TrainState(step=2))
            stall = time.perf_counter() - start
            during = _steps(workload) if measure == "steps" else 0.0
            ckpt.wait()
        return stall if measure == "stall" else during

    return case


def async_cases(workload: Any) -> dict[str, Callable[[Path], float]]:
    """The async cases by name; each takes a fresh, empty folder and returns seconds."""
    return {
        "async_stall": _ours(workload, "stall"),
        "async_steps": _ours(workload, "steps"),
        "async_steps_nice": _ours(workload, "steps", nice=10),
        "dcp_async_stall": _dcp_case(workload, False, "stall"),
        "dcp_async_persistent_stall": _dcp_case(workload, True, "stall"),
        "dcp_async_steps": _dcp_case(workload, False, "steps"),
        "dcp_async_persistent_steps": _dcp_case(workload, True, "steps"),
        "steps_alone": lambda d: _steps(workload),
    }
