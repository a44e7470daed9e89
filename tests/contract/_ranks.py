"""The 2-rank paths of the contract suite: each guarantee's test body runs on every rank of a gloo group.

A test of ``test_guarantees.py`` is decorated with :func:`on_each_rank`. On a
one-process path it simply runs. On a path with ``ranks=2`` the pytest process
launches one 2-rank job (:func:`ckpt_lesson.faults.rank_launch.launch`: a fork
from a warm forkserver and a gloo handshake) in which *both* ranks run the very
same test body against their own :class:`~_paths.Harness` (``rank`` set): every
manager call is collective, as a training job makes it. Each rank reports
passed, skipped (and why) or failed (with its traceback) as JSON; the test
takes the ranks' verdict. So the guarantee is written once, not copied for ranks.

What differs on ranks is kept in :class:`RankManager` (the few methods the
contract asks of a manager that ``DistributedCheckpointManager`` spells otherwise)
and in the harness (who flips a byte, how the killed job is started).
"""

from __future__ import annotations

import functools
import importlib
import json
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist

from ckpt_lesson.distributed import DistributedCheckpointManager
from ckpt_lesson.faults.rank_launch import launch


class RankManager:
    """A ``DistributedCheckpointManager`` as the contract tests call a manager; every call is collective."""

    def __init__(self, mgr: DistributedCheckpointManager) -> None:
        self.mgr = mgr

    def __getattr__(self, name: str) -> Any:  # save, save_async, wait, restore_latest, close
        return getattr(self.mgr, name)

    def all_steps(self) -> list[int]:
        """The committed steps, as rank 0 lists them (the same answer on every rank)."""
        dist.barrier()
        steps = [self.mgr.saves.published() if self.mgr.rank == 0 else None]
        dist.broadcast_object_list(steps, src=0)
        if isinstance(steps[0], Exception):
            raise steps[0]
        return sorted(steps[0])

    def wait_retention(self) -> None:
        """Rank 0 finishes the purge behind the last save; the other ranks wait for it."""
        self.mgr.saves.wait()
        dist.barrier()

    @property
    def last_restore(self) -> dict[str, Any] | None:
        restored = self.mgr.last_restore
        return None if restored is None else {"step": restored.step, "skipped": list(restored.skipped)}


def on_rank0(fn: Callable[[], Any]) -> Any:
    """Run ``fn`` on rank 0 only (a side effect outside the job: a flipped byte, a killed writer).

    Every rank gets rank 0's result, or its exception, once it is done.
    """
    out: list[Any] = [None]
    if dist.get_rank() == 0:
        try:
            out[0] = ("ok", fn())
        except Exception as exc:  # noqa: BLE001 - raised on every rank below
            out[0] = ("raised", exc)
    dist.broadcast_object_list(out, src=0)
    kind, value = out[0]
    if kind == "raised":
        raise value
    return value


def on_each_rank(test: Callable[..., None]) -> Callable[..., None]:
    """Decorate a contract test: on a multi-rank path its body runs on every rank of one launch."""

    @functools.wraps(test)
    def run(save_path: Any, **kwargs: Any) -> None:
        if save_path.rank is not None:
            return test(save_path, **kwargs)  # on a rank: the body itself
        if save_path.path.ranks > 1:
            return _launch(test, save_path, kwargs)
        try:
            test(save_path, **kwargs)
        except Exception:
            if save_path.known_failure:
                pytest.xfail(save_path.known_failure)
            raise
        _passes_now(save_path.known_failure)

    return run


def _passes_now(known_failure: str | None) -> None:
    if known_failure:
        pytest.fail(f"listed in _paths.FAILS but passes now (delete the entry): {known_failure}")


def _launch(test: Callable[..., None], h: Any, kwargs: dict[str, Any]) -> None:
    out = h.tmp_path / "ranks"
    out.mkdir()
    ranks = h.path.ranks
    args = (test.__module__, test.__name__, h.path, str(h.tmp_path), h.bucket, kwargs, str(out))
    codes = launch(body_on_rank, ranks, h.tmp_path, *args, limit=240.0)
    reports = [out / f"rank{r}.json" for r in range(ranks)]
    got = [json.loads(p.read_text()) if p.exists() else None for p in reports]
    failed = [(r, g) for r, g in enumerate(got) if g is None or g["outcome"] == "failed"]
    known = {g["known"] for g in got if g and g["known"]}
    if failed and known and all(g and g["known"] for _, g in failed):
        pytest.xfail(known.pop())
    if failed:
        lines = [f"rank {r}: " + (g["detail"] if g else "no report") for r, g in failed]
        pytest.fail(f"on {ranks} ranks (exit codes {codes}):\n" + "\n".join(lines), pytrace=False)
    skipped = {g["detail"] for g in got if g["outcome"] == "skipped"}
    if skipped:
        assert len(skipped) == 1 and all(g["outcome"] == "skipped" for g in got), got
        pytest.skip(skipped.pop())
    assert codes == [0] * ranks, codes
    _passes_now(known.pop() if known else None)


def body_on_rank(rank: int, world: int, module: str, name: str, path: Any, tmp: str, bucket: Any,
                 kwargs: dict[str, Any], out: str) -> None:  # fmt: skip
    """Rank ``rank``'s run of the test ``module.name``; writes ``out/rank<N>.json``."""
    from _paths import Harness

    test = getattr(importlib.import_module(module), name).__wrapped__
    h = Harness(path, Path(tmp), bucket, rank=rank)
    try:
        test(h, **kwargs)
        report = {"outcome": "passed", "detail": ""}
    except pytest.skip.Exception as exc:
        report = {"outcome": "skipped", "detail": str(exc.msg)}
    except BaseException:  # noqa: BLE001 - an assertion or an error: the test's verdict on this rank
        report = {"outcome": "failed", "detail": traceback.format_exc()}
    report["known"] = h.known_failure
    (Path(out) / f"rank{rank}.json").write_text(json.dumps(report))
    if report["outcome"] == "passed":
        for mgr in h.managers:  # collective, in the order they were made; a failed rank skips it
            mgr.close()
