"""Rank programs of the lease tests of the multi-rank store manager (launched with 2 gloo ranks).

The network is slowed the way a long upload is slow: after a multipart upload's
first part, rank 0's s3fs file waits until the test drops a ``go`` file (or
until the test SIGKILLs the job). Everything else is the real stack: DCP's
fsspec writer, s3fs over HTTP, moto's S3 server. Each state carries a 6 MiB
per-rank tensor, and the tests open the store with a 5 MiB write block, so
every rank's object goes up as a real multipart upload.
"""

from __future__ import annotations

import hashlib
import os
import time
from pathlib import Path
from typing import Any

import torch
from _distributed_workers import make_run, train_step

from ckpt_lesson import CheckpointError
from ckpt_lesson.distributed import DistributedCheckpointManager
from ckpt_lesson.faults.rank_programs import full_state, write_json

KIND = "fsdp"
#: Larger than the 5 MiB write block the tests set, so the rank's object is a multipart upload.
BLOB_ELEMENTS = (6 << 20) // 4


def hold_uploads(out: Path, rank: int) -> None:
    """Stall this process's multipart uploads after their first part until ``out/go`` exists.

    The part is really uploaded first, so the store holds an unfinished multipart
    upload while the rank waits, as it would behind a slow link.
    """
    import s3fs.core

    upload = s3fs.core.S3File._upload_chunk

    def held(self: Any, final: bool = False) -> Any:
        done = upload(self, final)
        if not final:
            (out / f"holding-rank{rank}").touch()
            deadline = time.monotonic() + 120
            while not (out / "go").exists():
                if time.monotonic() > deadline:
                    raise TimeoutError("the test never let the held upload go")
                time.sleep(0.05)
        return done

    s3fs.core.S3File._upload_chunk = held


def parts(model: Any, opt: Any, rank: int) -> dict[str, Any]:
    """The state API's parts: model, optimizer, and this rank's own 6 MiB tensor."""
    blob = torch.randn(BLOB_ELEMENTS, generator=torch.Generator().manual_seed(500 + rank))
    return {"model": model, "optimizer": opt, "blob": blob}


def digests(state: Any, path: str = "") -> dict[str, str]:
    """``{path: sha256 of dtype, shape and bytes}`` of every tensor in a nested state (bit for bit)."""
    if isinstance(state, dict):
        return {k: v for key, value in state.items() for k, v in digests(value, f"{path}.{key}").items()}
    if isinstance(state, (list, tuple)):
        return {k: v for i, value in enumerate(state) for k, v in digests(value, f"{path}[{i}]").items()}
    if isinstance(state, torch.Tensor):
        raw = state.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        return {path: hashlib.sha256(f"{state.dtype}{tuple(state.shape)}".encode() + raw).hexdigest()}
    return {path: repr(state)}


def _manager(url: str, options: dict[str, Any], lease_seconds: float) -> Any:
    return DistributedCheckpointManager(
        url, storage_options=options, lease_seconds=lease_seconds, keep_last=3, every_steps=2
    )


def _restore(url: str, options: dict[str, Any], lease_seconds: float, rank: int) -> dict[str, Any]:
    """Restore the newest save into fresh objects; its step and the digests of what came back."""
    model, opt, _, _ = make_run(KIND, 2, rank)
    with _manager(url, options, lease_seconds) as mgr:
        back = mgr.restore_latest({"model": model, "optimizer": opt, "blob": None})
    full = full_state(model, opt)  # collective
    return {"step": back.step, "state": digests(full), "blob": digests(back.values["blob"])}


def w_slow_save(rank: int, world: int, url: str, options: dict[str, Any], out: str, lease: float) -> None:
    """Save step 2 while rank 0's upload is held (longer than the lease); then restore it."""
    model, opt, sched, sampler = make_run(KIND, world, rank)
    train_step(model, opt, sched, sampler)
    report: dict[str, Any] = {"error": None}
    saving = parts(model, opt, rank)
    report["want"] = {"state": digests(full_state(model, opt)), "blob": digests(saving["blob"])}
    if rank == 0:
        hold_uploads(Path(out), rank)
    try:
        with _manager(url, options, lease) as mgr:
            report["saved"] = mgr.save(2, saving)
    except CheckpointError as exc:
        report["error"] = {"type": type(exc).__name__, "message": str(exc)}
    if report["error"] is None:
        report["restored"] = _restore(url, options, lease, rank)
    write_json(Path(out) / f"slow-rank{rank}.json", report)


def w_victim(rank: int, world: int, url: str, options: dict[str, Any], out: str, lease: float) -> None:
    """Commit step 2, record what it holds, then save step 4 with rank 0's upload held until SIGKILL."""
    (Path(out) / f"pid-rank{rank}").write_text(str(os.getpid()))
    model, opt, sched, sampler = make_run(KIND, world, rank)
    train_step(model, opt, sched, sampler)
    saving = parts(model, opt, rank)
    with _manager(url, options, lease) as mgr:
        mgr.save(2, saving)
        want = {"state": digests(full_state(model, opt)), "blob": digests(saving["blob"])}
        write_json(Path(out) / f"victim-rank{rank}.json", want)
        train_step(model, opt, sched, sampler)
        if rank == 0:
            hold_uploads(Path(out), rank)
        mgr.save(4, parts(model, opt, rank))  # the test kills the job before this returns
    write_json(Path(out) / f"victim-survived-rank{rank}.json", {})


def w_replacement(rank: int, world: int, url: str, options: dict[str, Any], out: str, lease: float) -> None:
    """The job after the kill: restore the newest committed save into fresh objects, then commit step 4."""
    report: dict[str, Any] = {"error": None}
    model, opt, sched, sampler = make_run(KIND, world, rank)
    try:
        with _manager(url, options, lease) as mgr:  # opening it cleans what dead writers left
            back = mgr.restore_latest({"model": model, "optimizer": opt, "blob": None})
            report["restored"] = {
                "step": back.step,
                "state": digests(full_state(model, opt)),  # collective
                "blob": digests(back.values["blob"]),
            }
            train_step(model, opt, sched, sampler)
            report["saved"] = mgr.save(4, parts(model, opt, rank))
    except CheckpointError as exc:
        report["error"] = {"type": type(exc).__name__, "message": str(exc)}
    write_json(Path(out) / f"replacement-rank{rank}.json", report)
