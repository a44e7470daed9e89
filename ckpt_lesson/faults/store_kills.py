"""Kills against a bucket: the chaos campaign's runs when the checkpoints live in an object store.

:mod:`ckpt_lesson.faults.harness` forks one training process per kill and
checks what the next process restores. With ``chaos --store URL`` each of
those processes trains with ``CheckpointManager(URL/...)``: the local folder is
only this machine's scratch (staging, the verified download), and the bucket
is the run. A :class:`StoreTarget` is the part of the harness that knows this:

* in the child, :meth:`StoreTarget.arm` installs the kill trigger for one of
  :data:`~ckpt_lesson.faults.kill_plan.STORE_POINTS`: mid-way through a part
  (locally), once the local save is published but nothing is uploaded, after
  every block of a part went up but before its multipart upload completed,
  after the manifest (before the conditional marker), right after the marker,
  after the upload, and between retention's deletion of an old marker and of
  its parts. The triggers wrap the real calls; every request still goes to
  the store;
* in the harness, :meth:`StoreTarget.damage` flips a byte of a committed
  object in the bucket (a part, or the manifest), and
  :meth:`StoreTarget.restored_losses` reads the chosen save back from the
  bucket, verified, to check it independently of the manager.

Credentials and endpoint come from the environment (``AWS_ENDPOINT_URL``, ...),
which the forked children inherit, as a replacement machine would be given them.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ckpt_lesson.faults.harness import _arm, _suicide
from ckpt_lesson.faults.kill_plan import KillPlan
from ckpt_lesson.files.checkpoint import load_verified_file
from ckpt_lesson.files.storage import open_storage
from ckpt_lesson.runs.layout import MANIFEST_NAME, step_dir_name
from ckpt_lesson.runs.report import read_recovery_log
from ckpt_lesson.runs.scan import scan_checkpoints
from ckpt_lesson.runs.store_commit import COMMIT_NAME, read_commit
from ckpt_lesson.runs.store_lease import LEASE_NAME
from ckpt_lesson.runs.store_restore import fetch_verified

__all__ = ["StoreTarget"]

#: Largest object the harness reads whole to flip a byte in it (the teaching model's parts are KBs).
_MAX_DAMAGE_BYTES = 256 << 20


def _die() -> None:
    _suicide()  # the machine is gone, mid-request or between two (announced to the harness first)


def _is_marker(key: str) -> bool:
    return key.rsplit("/", 1)[-1] == COMMIT_NAME


@dataclass
class StoreTarget:
    """One run's prefix in the bucket (``url``), as the harness's processes see it."""

    url: str

    def storage(self) -> Any:
        return open_storage(self.url)

    # ------------------------------------------------------------------ in the killed process

    def arm(self, plan: KillPlan | None, scratch: Path) -> Any:
        """Point this process's temporary files into ``scratch`` and install ``plan``'s trigger.

        Returns:
            The manager event hook (``None`` without a plan).
        """
        scratch.mkdir(parents=True, exist_ok=True)
        tempfile.tempdir = str(scratch)  # the manager's cache and the recovery log's folder
        if plan is None:
            return None
        if plan.point in ("mid_part", "between_saves"):
            return _arm(plan)  # local events: the harness's own triggers
        if plan.point == "staged":
            return _arm(KillPlan(plan.step, "published"))  # published in the local cache, not uploaded
        from ckpt_lesson.files import storage_transfer
        from ckpt_lesson.files.storage_fsspec import FsspecStorage

        armed = {"on": False, "retention": False, "completes": 0}
        if plan.point == "mid_upload":
            from ckpt_lesson.files import storage_fsspec

            storage_fsspec.SINGLE_PUT_BYTES = 0  # every part goes up as a multipart upload
            real_complete = storage_transfer._complete

            def complete(*args: Any, **kwargs: Any) -> Any:
                if armed["on"]:
                    armed["completes"] += 1
                    if armed["completes"] >= plan.arg:
                        _die()  # every block of the part is up; the upload never completes
                return real_complete(*args, **kwargs)

            storage_transfer._complete = complete  # type: ignore[assignment]
        real_create, real_delete = FsspecStorage.create_if_absent, FsspecStorage.delete

        def create_if_absent(self: Any, key: str, data: bytes) -> bool:
            if armed["on"] and _is_marker(key) and plan.point == "manifest_uploaded":
                _die()
            created = real_create(self, key, data)
            if armed["on"] and _is_marker(key) and plan.point == "committed":
                _die()
            return created

        def delete(self: Any, keys: list[str]) -> None:
            real_delete(self, keys)
            if armed["retention"] and any(_is_marker(k) for k in keys):
                _die()  # retention deleted an old save's marker, not yet its parts

        FsspecStorage.create_if_absent = create_if_absent  # type: ignore[method-assign]
        FsspecStorage.delete = delete  # type: ignore[method-assign]

        def hook(name: str, info: dict[str, Any]) -> None:
            if info.get("step") != plan.step:
                return
            if name == "save_begin":
                armed["on"] = True
            if name == "uploaded" and plan.point in ("uploaded", "bitrot", "manifest_rot"):
                _die()
            if name == "uploaded" and plan.point == "store_retention":
                armed["retention"] = True

        return hook

    def restored_losses(self, info: dict[str, Any]) -> list[float]:
        """The loss history of the save the restore chose, read back from the bucket (verified)."""
        step = info.get("step")
        if step is None:
            return []
        with tempfile.TemporaryDirectory(prefix="ckpt-chaos-check-") as folder:
            fetch_verified(self.storage(), step, Path(folder))
            saved = Path(folder) / step_dir_name(step)
            file = saved / "checkpoint.pt" if (saved / "checkpoint.pt").exists() else saved / "meta.pt"
            payload, _ = load_verified_file(file)
        return list(payload["state"]["losses"])

    # ------------------------------------------------------------------ in the harness

    def damage(self, plan: KillPlan) -> None:
        """After a ``bitrot`` / ``manifest_rot`` kill: flip one byte of a committed object in the bucket."""
        if plan.point not in ("bitrot", "manifest_rot"):
            return
        storage = self.storage()
        marker, _ = read_commit(storage, plan.step)
        attempt = f"{step_dir_name(plan.step)}/{marker['save_id']}"
        if plan.point == "manifest_rot":
            key = f"{attempt}/{MANIFEST_NAME}"
        else:
            skip = (MANIFEST_NAME, LEASE_NAME)
            names = [k for k in storage.list_keys(attempt) if k.rsplit("/", 1)[-1] not in skip]
            key = max(names, key=lambda k: storage.stat(k)[0])
        raw = bytearray(storage.read_bytes(key, limit=_MAX_DAMAGE_BYTES))
        at = raw.find(b'"rng"') if plan.point == "manifest_rot" else -1
        raw[at + 3 if at >= 0 else len(raw) // 2] ^= 0x01
        storage.put_bytes(key, bytes(raw))

    def incomplete_found(self) -> int:
        """Rows ``scan`` calls incomplete now (uploads no marker names, saves with a part missing)."""
        return sum(1 for r in scan_checkpoints(self.url) if r.status == "incomplete")

    def recoveries(self) -> list[dict[str, Any]]:
        """The run's recovery log, kept in the bucket (``recovery.jsonl``)."""
        return read_recovery_log(self.url)

    def remove(self) -> None:
        """Delete every object of the run's prefix and abort its unfinished uploads."""
        storage = self.storage()
        storage.delete(storage.list_keys())
        storage.abort_uploads("")
