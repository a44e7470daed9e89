"""Collectives with a one-process fallback, and DCP's gathered failures turned into our errors."""

from __future__ import annotations

import warnings

import pytest
from torch.distributed.checkpoint.api import CheckpointException

from ckpt_lesson import CheckpointError, UnsafeCheckpointError
from ckpt_lesson.distributed import Comm
from ckpt_lesson.distributed.comm import (
    new_checkpoint_group,
    quiet_single_process,
    raise_from_checkpoint_exception,
)
from ckpt_lesson.errors import CorruptCheckpointError


def test_without_a_process_group_the_world_is_one_rank_and_collectives_are_identities() -> None:
    for comm in (Comm(), Comm.solo()):
        assert (comm.rank, comm.world_size) == (0, 1)
        assert comm.broadcast({"a": 1}) == {"a": 1}
        assert comm.all_gather("x") == ["x"]
    assert new_checkpoint_group() is None


def test_on_rank0_returns_the_result_and_raises_an_os_error_as_a_checkpoint_error_with_its_text() -> None:
    comm = Comm()
    assert comm.on_rank0(lambda: [2, 4]) == [2, 4]

    def unreachable() -> None:
        raise OSError("no route to host")

    with pytest.raises(CheckpointError, match="no route to host"):
        comm.on_rank0(unreachable)


def test_our_own_error_inside_dcps_exception_is_raised_with_its_type() -> None:
    ours = UnsafeCheckpointError("value 'x' is not plain data")
    wrapped = CheckpointException("read", {1: (ours, None), 0: (RuntimeError("peer gone"), None)})
    with pytest.raises(UnsafeCheckpointError) as info:
        raise_from_checkpoint_exception(wrapped, "loading step-00000004")
    assert info.value is ours


def test_other_failures_become_one_checkpoint_error_naming_ranks_and_types() -> None:
    wrapped = CheckpointException("write", {1: (OSError("disk full"), None)})
    with pytest.raises(CheckpointError, match=r"save of step 4 failed \(rank 1: OSError: disk full\)"):
        raise_from_checkpoint_exception(wrapped, "save of step 4")


def test_only_dcps_single_process_warning_is_silenced_and_only_when_asked() -> None:
    message = "torch.distributed is disabled, unavailable or uninitialized, assuming the intent is to save"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with quiet_single_process(True):
            warnings.warn(message, UserWarning, stacklevel=1)
            warnings.warn("something else", UserWarning, stacklevel=1)
        with quiet_single_process(False):
            warnings.warn(message, UserWarning, stacklevel=1)
    assert [str(w.message)[:20] for w in caught] == ["something else", message[:20]]


def test_an_io_error_while_loading_is_damage_so_the_restore_falls_back() -> None:
    wrapped = CheckpointException("read", {0: (OSError(5, "Input/output error"), None)})
    with pytest.raises(CorruptCheckpointError, match=r"loading step-00000004 failed \(rank 0: OSError"):
        raise_from_checkpoint_exception(wrapped, "loading step-00000004", reading=True)
