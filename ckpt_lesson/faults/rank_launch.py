"""Start a small multi-rank job from Python, cheaply, and behave like torchrun when a rank dies.

Ranks are processes forked from a *forkserver* that imported torch (and the
rank programs) once, so a launch costs a fork and a gloo handshake (about a
second), not a fresh interpreter importing torch per rank. The forkserver
itself never runs a torch op, so no thread pool exists yet when it forks.
Ranks meet through a ``FileStore`` (no ports) and report through files.

The fault-injection campaign (:mod:`ckpt_lesson.faults.rank_chaos`) and the
multi-rank tests launch their rank programs through :func:`launch`.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time
import traceback
import uuid
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

__all__ = ["PRELOAD", "launch"]

#: Imported by the forkserver before it forks any rank: torch, DCP and the rank programs.
PRELOAD = "ckpt_lesson.faults.rank_programs"

_CTX: Any = None


def _context() -> Any:
    global _CTX
    if _CTX is None:
        from multiprocessing import forkserver

        _CTX = mp.get_context("forkserver")
        _CTX.set_forkserver_preload([PRELOAD])
        # Python 3.11's forkserver imports the preload modules before it applies the parent's
        # sys.path, so this copy of the package must reach it via PYTHONPATH; otherwise the
        # preload fails silently (or finds another install) and every rank imports torch anew.
        root = str(Path(__file__).resolve().parents[2])  # the folder that holds ckpt_lesson/
        saved = os.environ.get("PYTHONPATH")
        os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (root, saved) if p)
        try:
            forkserver.ensure_running()
        finally:
            if saved is None:
                del os.environ["PYTHONPATH"]
            else:
                os.environ["PYTHONPATH"] = saved
    return _CTX


def launch(
    target: Callable[..., None],
    world: int,
    workdir: str | os.PathLike[str],
    *args: Any,
    grace: float = 20.0,
    limit: float = 120.0,
) -> list[int]:
    """Run ``target(rank, world, *args)`` on ``world`` ranks (gloo, CPU) and wait for all of them.

    Like torchrun, when one rank dies the others get ``grace`` seconds to notice
    and exit on their own; then they are killed (by pid: only our own children).

    Args:
        target: A module-level function (it is pickled by name into each rank).
        world: Number of ranks.
        workdir: Where the ranks' rendezvous file goes.
        args: Passed to ``target`` after ``rank`` and ``world`` (picklable).
        grace: Seconds the survivors get after the first rank failed.
        limit: Seconds the whole job may take.

    Returns:
        Exit codes by rank: 0 ok, 1 raised, negative: killed by that signal.

    Example:
        >>> launch(w_fault, 2, tmp, str(tmp / "run"), kill)  # doctest: +SKIP
        [-9, -9]
    """
    store = Path(workdir) / f"store-{uuid.uuid4().hex[:8]}"
    ctx = _context()
    procs = [ctx.Process(target=_entry, args=(target, r, world, str(store), args)) for r in range(world)]
    for p in procs:
        p.start()
    started, first_exit = time.monotonic(), None
    while any(p.exitcode is None for p in procs):
        now = time.monotonic()
        if first_exit is None and any(p.exitcode not in (None, 0) for p in procs):
            first_exit = now
        late = first_exit is not None and now - first_exit > grace
        if late or now - started > limit:
            for p in procs:
                if p.exitcode is None:
                    os.kill(p.pid, signal.SIGKILL)  # our own child, by pid
        time.sleep(0.02)
    for p in procs:
        p.join()
    return [p.exitcode for p in procs]


def _entry(target: Callable[..., None], rank: int, world: int, store: str, args: tuple[Any, ...]) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)  # a few cores shared by up to 4 ranks; also keeps losses reproducible
    dist.init_process_group(
        "gloo", init_method=f"file://{store}", rank=rank, world_size=world, timeout=timedelta(seconds=60)
    )
    try:
        target(rank, world, *args)
    except BaseException:
        traceback.print_exc()
        os._exit(1)  # skip interpreter teardown: a peer may be dead and gloo's destructors can block
    dist.destroy_process_group()
