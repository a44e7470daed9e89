"""Single-process helpers for the distributed tests: the same manager with no process group.

Without ``torch.distributed`` initialized the manager runs as a world of one,
which is enough to test everything that does not need several ranks (integrity,
unsafe files, retention, async) in milliseconds, inside the pytest process.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from _distributed_workers import make_run, train_step

from ckpt_lesson import TrainState
from ckpt_lesson.distributed import DistributedCheckpointManager, hash_file
from ckpt_lesson.files.record_seal import seal_record


def save_locally(run: Path, steps: tuple[int, ...] = (2, 4), **manager_options: Any) -> list[float]:
    """Train a plain model in this process, saving at ``steps``; returns the losses."""
    model, opt, sched, sampler = make_run("plain", 1, 0)
    mgr = DistributedCheckpointManager(run, **{"keep_last": 5, "every_steps": 2, **manager_options})
    state = TrainState()
    for step in range(1, max(steps) + 1):
        state.losses.append(train_step(model, opt, sched, sampler))
        state.step = step
        if step in steps:
            mgr.save(model, opt, sched, state, data_state={"sampler": sampler.get_state(), "batches": step})
    mgr.close()
    return state.losses


def restore_locally(run: Path, **restore_options: Any) -> Any:
    """A fresh plain model, optimizer and scheduler restored from ``run``; returns (restore, objects)."""
    model, opt, sched, sampler = make_run("plain", 1, 0)
    mgr = DistributedCheckpointManager(run, keep_last=5, every_steps=2)
    return mgr.restore_latest(model, opt, sched, **restore_options), (model, opt, sched, sampler)


class RunsCode:
    """Pickles as a call to ``exec`` that creates ``marker``: the side effect a crafted file aims for."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (exec, (f"open({str(self.marker)!r}, 'w').close()",))


def rewrite_manifest_entry(folder: Path, name: str) -> None:
    """Make the manifest agree with what ``folder/name`` now holds, resealed (as a careful attacker would)."""
    manifest_path = folder / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    for part in manifest["parts"]:
        if part["file"] == name:
            size, record = hash_file(folder / name, part["algo"])
            part.update(bytes=size, **record)
    manifest_path.write_text(json.dumps(seal_record(manifest)))


def flip_byte(path: Path, at: float = 0.5) -> None:
    data = bytearray(path.read_bytes())
    data[int(len(data) * at)] ^= 0x01
    path.write_bytes(bytes(data))
