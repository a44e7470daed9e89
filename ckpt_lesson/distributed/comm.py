"""The handful of collectives the manager needs, and a one-process fallback.

Every decision that changes what a rank does next (save now? which staging
folder? which save to restore?) must come out the same on every rank, or the
ranks walk into different collectives and hang. So such decisions are made
once, on rank 0 or by gathering every rank's view, and passed around with the
helpers here. Without an initialized process group (a single process, a
notebook) the same code runs with a world of one and no communication at all.

Checkpoint traffic gets process groups of its own (:func:`new_checkpoint_group`):
an asynchronous save runs DCP's collectives on a background thread, and two
threads issuing collectives on one group can interleave differently on
different ranks. Separate groups keep the training thread's collectives and
the writer's apart.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, NoReturn

import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from ckpt_lesson.errors import CheckpointError, CorruptCheckpointError

__all__ = [
    "Comm",
    "failure_summary",
    "new_checkpoint_group",
    "quiet_single_process",
    "raise_from_checkpoint_exception",
    "release_groups",
]


def new_checkpoint_group() -> dist.ProcessGroup | None:
    """A new gloo group over all ranks, or ``None`` when not running distributed.

    Collective: every rank must call it, in the same order as its other
    ``new_group`` calls.

    Example:
        >>> group = new_checkpoint_group()  # doctest: +SKIP
    """
    if not (dist.is_available() and dist.is_initialized()):
        return None
    return dist.new_group(backend="gloo")


def release_groups(*groups: dist.ProcessGroup | None) -> None:
    """Destroy groups made by :func:`new_checkpoint_group`; the caller drops its references too.

    ``destroy_process_group(group)`` only unregisters a group: its native threads
    (gloo's ``pt_gloo_runloop`` workers and ``gloo_tcp_loop``) live on for as long
    as any Python object refers to it, which for a manager kept in a global means
    until interpreter teardown. Destroying it there races the interpreter's own
    shutdown. Called with every reference gone, the threads are joined at once.

    Example:
        >>> release_groups(None)  # without torch.distributed, nothing to do
    """
    if not (dist.is_available() and dist.is_initialized()):
        return
    for group in groups:
        if group is not None:
            dist.destroy_process_group(group)


class Comm:
    """Rank, world size and object collectives over one group (or none).

    Args:
        group: The process group; ``None`` means the default group when one
            is initialized, or a world of one otherwise.

    Example:
        >>> comm = Comm()
        >>> (comm.rank, comm.world_size, comm.all_gather("x"))
        (0, 1, ['x'])
    """

    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        self.enabled = dist.is_available() and dist.is_initialized()
        self.group = group
        self.rank = dist.get_rank(group) if self.enabled else 0
        self.world_size = dist.get_world_size(group) if self.enabled else 1

    @classmethod
    def solo(cls) -> Comm:
        """A world of one, even inside a distributed run (for checks only rank 0 makes)."""
        comm = cls.__new__(cls)
        comm.enabled, comm.group, comm.rank, comm.world_size = False, None, 0, 1
        return comm

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every rank (other ranks' argument is ignored)."""
        if self.world_size == 1:
            return obj
        box = [obj if self.rank == 0 else None]
        dist.broadcast_object_list(box, group=self.group, group_src=0)
        return box[0]

    def all_gather(self, obj: Any) -> list[Any]:
        """Every rank's ``obj``, indexed by rank, on every rank."""
        if self.world_size == 1:
            return [obj]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def on_rank0(self, fn: Callable[[], Any]) -> Any:
        """``fn()`` run by rank 0 alone; its result, or the error it raised, on every rank.

        Every rank raises rank 0's error, its type too (a ``LoadEnvironmentError`` stays one; an
        ``OSError`` becomes a ``CheckpointError``): a rank 0 that raised alone would leave the
        others waiting in the broadcast.
        """
        result = problem = None
        if self.rank == 0:
            try:
                result = fn()
            except (CheckpointError, OSError) as exc:
                problem = exc if isinstance(exc, CheckpointError) else CheckpointError(str(exc))
        result, problem = self.broadcast((result, problem))
        if problem is not None:
            raise problem
        return result


@contextmanager
def quiet_single_process(no_dist: bool) -> Iterator[None]:
    """Silence DCP's "assuming the intent is to save/load in a single process" when that is the intent.

    DCP warns on every call without a process group, even when told ``no_dist=True``;
    in a notebook that buries the output that matters. Only that one message is
    filtered, and only around our own synchronous calls.
    """
    if not no_dist:
        yield
        return
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", message="torch.distributed is disabled, unavailable or uninitialized"
        )
        yield


def raise_from_checkpoint_exception(
    exc: CheckpointException, what: str, *, reading: bool = False
) -> NoReturn:
    """Turn DCP's ``CheckpointException`` into this package's errors.

    DCP gathers every rank's failure into one ``CheckpointException``, a ``BaseException``
    (``except Exception`` misses it). If one of the failures is a :class:`CheckpointError`
    (our own checks: an unsafe value, a missing item), that error is raised as it is, with
    its type, so callers can tell damage from tampering. Anything else becomes a
    ``CheckpointError`` naming the ranks and their errors (:func:`failure_summary`).

    With ``reading=True`` (a load), an ``OSError`` on any rank (EIO on a
    part) becomes a :class:`~ckpt_lesson.errors.CorruptCheckpointError`, so
    the restore falls back to an older save on every rank alike.

    Raises:
        CheckpointError: Always.
    """
    failures = exc.failures
    for rank in sorted(failures):
        inner = failures[rank][0]
        if isinstance(inner, CheckpointError):
            raise inner from exc
    summary = failure_summary(exc)
    if reading and any(isinstance(failures[rank][0], OSError) for rank in failures):
        # (While writing, an OSError such as a full disk is no verdict on any save.)
        raise CorruptCheckpointError(f"{what} failed ({summary}).") from exc
    raise CheckpointError(f"{what} failed ({summary}).") from exc


def failure_summary(exc: BaseException) -> str:
    """``rank N: Type: message`` for each rank of DCP's ``CheckpointException``; ``Type: message`` else.

    One line, without the tracebacks ``CheckpointException`` carries in its message.

    Example:
        >>> failure_summary(OSError(28, "No space left on device"))
        'OSError: [Errno 28] No space left on device'
    """
    failures = exc.failures if isinstance(exc, CheckpointException) else None
    if not failures:
        return f"{type(exc).__name__}: {exc}"
    return "; ".join(
        f"rank {rank}: {type(failures[rank][0]).__name__}: {failures[rank][0]}" for rank in sorted(failures)
    )
