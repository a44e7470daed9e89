"""The contract suite's one fixture: ``save_path``, parametrized over every path a save can take.

A path is a storage (a folder, or a bucket on moto's S3 server), a call form
(the state API, or the lesson's positional ``model, optimizer, scheduler,
train_state``) and a save mode (synchronous, or through ``AsyncCheckpointer``).
Each guarantee in ``test_guarantees.py`` is written once against the
:class:`Harness` below; a new path joins by adding one entry to :data:`PATHS`
(and teaching the harness its two or three differences), not by copying tests.
A path that cannot offer a guarantee skips it with the reason
(:meth:`Harness.skip_unless`), and ``docs/guarantees.md`` shows the skip.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from _ranks import RankManager, on_rank0
from conftest import TinyRun, build_tiny_run

from ckpt_lesson.distributed import DistributedCheckpointManager
from ckpt_lesson.files.storage import open_storage
from ckpt_lesson.files.train_state import TrainState
from ckpt_lesson.runs.async_save import AsyncCheckpointer
from ckpt_lesson.runs.manager import CheckpointManager
from ckpt_lesson.runs.store_commit import clean_uncommitted


@dataclass(frozen=True)
class SavePath:
    """One way a save can go: storage x call form x save mode x ranks."""

    storage: str  # "folder" | "bucket"
    form: str  # "state" | "positional"
    mode: str  # "sync" | "async"
    ranks: int = 1  # 1: CheckpointManager in this process; 2: DistributedCheckpointManager on 2 gloo ranks

    @property
    def id(self) -> str:
        return f"{self.storage}-{self.form}-{self.mode}" + (f"-{self.ranks}ranks" if self.ranks > 1 else "")

    @property
    def axes(self) -> tuple[str, ...]:
        """The path's value on each axis, as :data:`SKIPS` names them."""
        return (self.storage, self.form, self.mode, f"{self.ranks} rank" + "s" * (self.ranks > 1))


STORAGES, FORMS, MODES = ("folder", "bucket"), ("state", "positional"), ("sync", "async")
PATHS = [SavePath(s, f, m) for s in STORAGES for f in FORMS for m in MODES]
#: On 2 ranks each test is one launch of a 2-rank job (a few seconds on 2 cores), so two of the
#: eight combinations run there: each storage, through the state API, synchronously.
PATHS += [SavePath(s, "state", "sync", ranks=2) for s in STORAGES]

#: Why a path cannot offer a guarantee: ``{(guarantee, axis value): reason}``. The docs table reads it.
NO_NAMES = "no part names in the positional form"
SKIPS: dict[tuple[str, str], str] = {
    ("bad_input:missing_part", "positional"): NO_NAMES,
    ("bad_input:extra_part", "positional"): NO_NAMES,
    ("kill:upload", "folder"): "a folder save has no upload",
    ("zombie", "folder"): "a folder has no writer leases; its fence is the second-writer row",
    ("run_moves_on", "2 ranks"): "not yet: the trainer's collective save would have to run inside the "
    "reader's collective restore",
}
#: Guarantees a path should offer but does not (a bug, reported): ``{(guarantee, axis value): what
#: fails}``. The test still runs and must fail (a strict xfail): once fixed, delete the entry.
FAILS: dict[tuple[str, str], str] = {}


class Harness:
    """The differences between paths, in one place: where saves go, how a save and a restore are called."""

    def __init__(self, path: SavePath, tmp_path: Path, bucket: Any | None, rank: int | None = None) -> None:
        self.path, self.tmp_path, self.bucket = path, tmp_path, bucket
        self.rank = rank  # set inside a rank of a multi-rank path (see _ranks.py), else None
        self.managers: list[Any] = []  # a rank closes them (collectively) after the test
        self.known_failure: str | None = None  # set by skip_unless from FAILS
        self.location = bucket.url() if bucket is not None else str(tmp_path / "run")
        self.options = {"storage_options": bucket.options} if bucket is not None else {}

    def skip_unless(self, guarantee: str) -> None:
        """Skip (with the reason) where this path cannot offer ``guarantee``; note a known failure."""
        for axis in self.path.axes:
            reason = SKIPS.get((guarantee, axis))
            if reason:
                pytest.skip(f"{self.path.id}: {reason}")
            self.known_failure = self.known_failure or FAILS.get((guarantee, axis))

    def manager(self, **kwargs: Any) -> CheckpointManager:
        kwargs.setdefault("every_steps", 1)
        if self.path.ranks == 1:
            return CheckpointManager(self.location, **self.options, **kwargs)
        mgr = RankManager(DistributedCheckpointManager(self.location, **self.options, **kwargs))
        assert mgr.world_size == self.path.ranks  # the job's real group, not a world of one
        self.managers.append(mgr)
        return mgr  # type: ignore[return-value]

    def run(self, seed: int = 0) -> TinyRun:
        return build_tiny_run(seed=seed)

    def args(self, run: TinyRun, step: int, *, best: Any = 0.5) -> tuple[Any, ...]:
        """What this call form passes to ``save`` for ``run`` at ``step``."""
        if self.path.form == "state":
            parts = {"model": run.model, "optimizer": run.optimizer, "scheduler": run.scheduler}
            return step, {**parts, "best": best}
        run.state.step = step
        return run.model, run.optimizer, run.scheduler, run.state

    def save_args(self, mgr: CheckpointManager, *args: Any, **kwargs: Any) -> Any:
        """Save ``args`` as this path does (a background save is waited for, so its error surfaces)."""
        if self.path.mode == "sync":
            return mgr.save(*args, **kwargs)
        if self.path.ranks > 1:
            mgr.save_async(*args, **kwargs)
            return mgr.wait()
        with AsyncCheckpointer(mgr) as ckpt:
            ckpt.save_async(*args, **kwargs)
            return ckpt.wait()

    def save(self, mgr: CheckpointManager, run: TinyRun, step: int) -> Any:
        run.train(until_step=step)
        return self.save_args(mgr, *self.args(run, step))

    def restore(self, mgr: CheckpointManager, run: TinyRun, *, strict: bool = True) -> tuple[int, Any]:
        """Restore into ``run``'s objects; returns ``(step, best)`` (``best``: None when positional)."""
        if self.path.form == "state":
            parts = {"model": run.model, "optimizer": run.optimizer, "scheduler": run.scheduler}
            restored = mgr.restore_latest({**parts, "best": None}, strict=strict)
            return restored.step, restored.values["best"]
        state = mgr.restore_latest(run.model, run.optimizer, run.scheduler)
        if self.path.ranks > 1:
            state = state.state  # a DistributedRestore: this rank's counters
        assert isinstance(state, TrainState)
        return state.step, None

    def flip_a_byte(self, step: int) -> str:
        """Flip one byte in the middle of the largest part of ``step``'s save; returns its key."""
        if self.rank is not None:
            return on_rank0(lambda: Harness(self.path, self.tmp_path, self.bucket)._flip(step))
        return self._flip(step)

    def _flip(self, step: int) -> str:
        storage = open_storage(self.location, self.options.get("storage_options"))
        prefix = f"step-{step:08d}"
        keys = [k for k in storage.list_keys(prefix) if k.endswith((".pt", ".distcp"))]
        sizes = {k: len(storage.read_bytes(k, limit=1 << 30)) for k in keys}
        key = max(sizes, key=sizes.__getitem__)
        data = bytearray(storage.read_bytes(key, limit=1 << 30))
        data[len(data) // 2] ^= 0xFF
        if self.bucket is None:
            (Path(self.location) / key).write_bytes(bytes(data))
        else:
            storage.put_bytes(key, bytes(data))
        return key

    def _child(self, point: str) -> subprocess.Popen:
        child = [sys.executable, str(Path(__file__).with_name("_kill_child.py")), self.path.storage]
        child += [self.path.form, self.path.mode, str(self.path.ranks), str(self.tmp_path), point]
        if self.bucket is not None:
            child += [self.bucket.name, self.bucket.endpoint]
        paths = [os.getcwd(), os.environ.get("PYTHONPATH", "")]
        return subprocess.Popen(child, env={**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, paths))})

    def kill_mid_save(self, point: str) -> int:
        """Run ``_kill_child.py``: it saves step 2, then SIGKILLs itself at ``point`` while saving step 4.

        On ranks, rank 0 starts the child job (every one of its ranks is killed) and the others wait.
        """
        if self.rank is not None:
            return on_rank0(lambda: self._child_job(self._child(point).wait(timeout=300)))
        return self._child(point).wait(timeout=300)

    def _child_job(self, code: int) -> int:
        """A child job's outcome, as one process's exit code: -9 when every rank was killed, 4 when
        every rank's save was refused because the lease had expired (rank 0's message says so)."""
        assert code == 0, f"the child job's launcher failed ({code})"
        codes, outcomes = json.loads((self.tmp_path / "child-job.json").read_text())
        if codes == [-9] * len(codes):
            return -9
        return 4 if outcomes[0] == 4 and all(o in (4, 5) for o in outcomes) else 3

    def stall_past_lease(self) -> int:
        """A bucket writer frozen mid-save past its lease while another manager cleaned; its exit code."""
        if self.rank is not None:
            return on_rank0(lambda: self._child_job(self._stall()))
        return self._stall()

    def _stall(self) -> int:
        child, marker = self._child("stall"), self.tmp_path / "stalled"
        stopped = child.pid
        try:
            deadline = time.monotonic() + 300
            while not (marker.exists() and _stopped(stopped := int(marker.read_text() or child.pid))):
                assert time.monotonic() < deadline and child.poll() is None, "the writer never stalled"
                time.sleep(0.05)
            storage = open_storage(self.location, self.options.get("storage_options"))
            [lease] = [k for k in storage.list_keys("step-00000004") if k.endswith("/LEASE")]
            expires = json.loads(storage.read_bytes(lease, limit=1 << 16))["expires_at"]
            while time.time() <= expires + 0.2:
                time.sleep(0.05)
            # Another job starts writing to the run: before its first save it cleans uploads whose
            # lease ran out (a reader writes nothing), so the frozen upload looks abandoned.
            clean_uncommitted(storage)
            assert storage.list_keys("step-00000004") == []
        finally:
            os.kill(stopped, signal.SIGCONT)
        return child.wait(timeout=300)

    def restore_while_the_run_moves_on(self, trainer: CheckpointManager, run: TinyRun, fresh: TinyRun) -> Any:
        """Restore into ``fresh`` while ``trainer`` (``keep_last=1``) saves step 6 and deletes step 4.

        Folder: the reader's own ``resume_contract`` event (its manifest read, no part yet).
        Bucket: botocore's ``before-send`` holds the reader's GET of a step-4 part (the
        event loop runs on, so the trainer's requests go through meanwhile).
        Returns the reader (its ``last_restore`` says what happened) and the restored step.
        """
        if self.bucket is None:

            def trainer_moves_on(name: str, info: dict[str, Any]) -> None:
                if name == "resume_contract" and info["step"] == 4 and 6 not in trainer.all_steps():
                    self.save(trainer, run, 6)
                    trainer.wait_retention()

            reader = self.manager(on_event=trainer_moves_on)
            return reader, self.restore(reader, fresh)[0]
        go, done = threading.Event(), threading.Event()

        async def hold(request: Any, **_: Any) -> None:
            if "/step-00000004/" in request.url and request.url.endswith(".pt") and not go.is_set():
                go.set()
                while not done.is_set():
                    await asyncio.sleep(0.05)

        def trainer_loop() -> None:
            go.wait(timeout=120)
            try:
                self.save(trainer, run, 6)
            finally:
                done.set()

        thread = threading.Thread(target=trainer_loop)
        thread.start()
        reader = self.manager()
        events = reader.storage.fs.s3.meta.events
        events.register("before-send.s3.GetObject", hold)
        try:
            return reader, self.restore(reader, fresh)[0]
        finally:
            events.unregister("before-send.s3.GetObject", hold)
            go.set()
            thread.join(timeout=120)


def _stopped(pid: int) -> bool:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "T"


def snapshot(run: TinyRun) -> dict[str, torch.Tensor]:
    """Every tensor of the run's model and optimizer, cloned (to compare after a restore)."""
    out = {f"model.{k}": v.clone() for k, v in run.model.state_dict().items()}
    for pid, entry in run.optimizer.state_dict()["state"].items():
        out.update(
            {f"optimizer.{pid}.{k}": v.clone() for k, v in entry.items() if isinstance(v, torch.Tensor)}
        )
    return out


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return list(a) == list(b) and all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture(params=PATHS, ids=[p.id for p in PATHS])
def save_path(request: pytest.FixtureRequest, tmp_path: Path) -> Harness:
    """A :class:`Harness` for one path; a bucket path gets a fresh bucket on the session's moto server."""
    path: SavePath = request.param
    bucket = request.getfixturevalue("s3_bucket") if path.storage == "bucket" else None
    return Harness(path, tmp_path, bucket)
