"""The restricted unpickler for DCP's .metadata: DCP's own classes load, nothing else is even looked up."""

from __future__ import annotations

import dataclasses
import io
import os
import pickle
from pathlib import Path

import pytest
import torch
from _distributed_local import save_locally

from ckpt_lesson import CorruptCheckpointError, UnsafeCheckpointError
from ckpt_lesson.distributed import RestrictedUnpickler, load_metadata_bytes
from ckpt_lesson.distributed.safe_metadata import ALLOWED_GLOBALS
from ckpt_lesson.runs.dcp_manifest import read_dcp_manifest


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[bytes, dict[str, int]]:
    run = tmp_path_factory.mktemp("safe_metadata") / "run"
    save_locally(run, steps=(2,))
    folder = run / "step-00000002"
    manifest, _ = read_dcp_manifest(folder)
    sizes = {p["file"]: p["bytes"] for p in manifest["parts"] if p["file"] != ".metadata"}
    return (folder / ".metadata").read_bytes(), sizes


def test_real_dcp_metadata_loads_and_matches_what_plain_pickle_reads(
    saved: tuple[bytes, dict[str, int]],
) -> None:
    data, sizes = saved
    ours = load_metadata_bytes(data, data_files=sizes, where="step 2")
    theirs = pickle.loads(data)  # our own fresh save: trusted, for comparison only
    assert ours.state_dict_metadata == theirs.state_dict_metadata
    assert ours.storage_data == theirs.storage_data
    assert any(key.startswith("optim.state.") for key in ours.state_dict_metadata)


def test_the_allowlist_covers_every_global_a_real_metadata_names(saved: tuple[bytes, dict[str, int]]) -> None:
    named: set[tuple[str, str]] = set()

    class Recording(pickle.Unpickler):  # our own fresh save: trusted, so resolving for real is fine
        def find_class(self, module: str, name: str) -> object:
            named.add((module, name))
            return super().find_class(module, name)

    Recording(io.BytesIO(saved[0])).load()
    dtypes = {(m, n) for m, n in named if m == "torch" and isinstance(getattr(torch, n, None), torch.dtype)}
    assert named and named - dtypes <= set(ALLOWED_GLOBALS)


class _Call:
    def __init__(self, func: object, *args: object) -> None:
        self.func, self.args = func, args

    def __reduce__(self) -> tuple[object, ...]:
        return (self.func, self.args)


@pytest.mark.parametrize(
    ("payload", "named"),
    [
        (_Call(os.system, "true"), "posix.system"),
        (_Call(eval, "1 + 1"), "builtins.eval"),
        (_Call(torch.load, "x"), "torch.serialization.load"),  # a torch function, not a dtype
        (_Call(getattr, 1, "real"), "builtins.getattr"),
    ],
)
def test_any_other_global_is_refused_by_name_before_it_is_resolved(payload: object, named: str) -> None:
    with pytest.raises(UnsafeCheckpointError, match=named.replace(".", r"\.")):
        load_metadata_bytes(pickle.dumps(payload), data_files={}, where="step 4")


def test_persistent_ids_are_refused() -> None:
    buf = io.BytesIO()

    class WithPid(pickle.Pickler):
        def persistent_id(self, obj: object) -> str | None:
            return "storage" if obj == "x" else None

    WithPid(buf).dump(["x"])
    with pytest.raises(UnsafeCheckpointError, match="persistent ids"):
        RestrictedUnpickler(io.BytesIO(buf.getvalue())).load()


@pytest.mark.parametrize("data", [b"not a pickle", pickle.dumps(torch.Size([2])), b""])
def test_bytes_that_are_not_dcp_metadata_are_corrupt(data: bytes) -> None:
    with pytest.raises(CorruptCheckpointError):
        load_metadata_bytes(data, data_files={}, where="step 4")


def test_metadata_pointing_at_a_file_the_manifest_does_not_list_is_corrupt(
    saved: tuple[bytes, dict[str, int]],
) -> None:
    data, sizes = saved
    metadata = pickle.loads(data)
    index, info = next(iter(metadata.storage_data.items()))
    metadata.storage_data[index] = dataclasses.replace(info, relative_path="../elsewhere.distcp")
    with pytest.raises(CorruptCheckpointError, match="does not list"):
        load_metadata_bytes(pickle.dumps(metadata), data_files=sizes, where="step 2")


def test_metadata_pointing_past_the_end_of_a_file_is_corrupt(saved: tuple[bytes, dict[str, int]]) -> None:
    data, sizes = saved
    metadata = pickle.loads(data)
    index, info = next(iter(metadata.storage_data.items()))
    metadata.storage_data[index] = dataclasses.replace(info, offset=sizes[info.relative_path])
    with pytest.raises(CorruptCheckpointError, match="lies outside"):
        load_metadata_bytes(pickle.dumps(metadata), data_files=sizes, where="step 2")


def test_the_metadata_records_the_published_folder_not_the_staging_one(
    saved: tuple[bytes, dict[str, int]],
) -> None:
    metadata = load_metadata_bytes(saved[0], data_files=saved[1], where="step 2")
    assert Path(metadata.storage_meta.checkpoint_id).name == "step-00000002"


def test_a_weights_only_refusal_is_reduced_to_the_line_that_names_the_global() -> None:
    import io
    import pickle

    import torch

    from ckpt_lesson.distributed.safe_metadata import weights_only_refusal

    class CallsExec:
        def __reduce__(self):
            return (exec, ("pass",))

    buffer = io.BytesIO()
    torch.save({"x": CallsExec()}, buffer)
    buffer.seek(0)
    with pytest.raises(pickle.UnpicklingError) as caught:
        torch.load(buffer, weights_only=True)
    line = weights_only_refusal(caught.value)
    assert "exec" in line
    assert "\n" not in line and "\x1b" not in line and "weights_only" not in line
