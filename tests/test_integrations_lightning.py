"""The Lightning plugin, with the real ``lightning.Trainer``: CPU, a tiny model, nothing downloaded."""

from __future__ import annotations

import os
import pathlib
import pickle
import subprocess
import sys
import threading
import tracemalloc
import warnings
from pathlib import Path

import pytest
import torch
from _kill_patch import KILL_PATCH

pytest.importorskip("lightning", reason="lightning is not installed: pip install -r requirements.txt")

from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO  # noqa: E402

from ckpt_lesson.cli import main as cli_main  # noqa: E402
from ckpt_lesson.errors import CheckpointError, CorruptCheckpointError, UnsafeCheckpointError  # noqa: E402
from ckpt_lesson.integrations.lightning import (  # noqa: E402
    OrderedAsyncCheckpointIO,
    VerifiedCheckpointIO,
    latest_verified_checkpoint,
)
from ckpt_lesson.runs.scan import scan_checkpoints  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent

# A tiny seeded Lightning run: an MLP, 2 batches per epoch, a checkpoint every 2 steps (so every
# save falls on an epoch boundary and a resume is exact) plus last.ckpt. Run in-process, or in a
# child process behind KILL_PATCH, which makes the n-th torch.save write 4 KiB and then SIGKILL its
# own process: a kill in the middle of a save, at a chosen save.
TRAIN = r"""
import logging, warnings
import torch, lightning as L
from torch.utils.data import DataLoader, TensorDataset
from ckpt_lesson.integrations.lightning import OrderedAsyncCheckpointIO, VerifiedCheckpointIO

class Tiny(L.LightningModule):
    def __init__(self, width=8):
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Sequential(torch.nn.Linear(4, width), torch.nn.Tanh(), torch.nn.Linear(width, 1))
    def training_step(self, batch, i):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)
    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)

def train(ckdir, plugin="ours", resume="", max_steps=8):
    warnings.filterwarnings("ignore")
    logging.getLogger("lightning").setLevel(logging.ERROR)
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(16, 4, generator=g), torch.randn(16, 1, generator=g))
    torch.manual_seed(0)
    model = Tiny()
    plugins = {"ours": [VerifiedCheckpointIO()], "async": [OrderedAsyncCheckpointIO()], "stock": []}[plugin]
    every = L.pytorch.callbacks.ModelCheckpoint(
        dirpath=ckdir, filename="{step}", every_n_train_steps=2, save_top_k=-1, save_last=True
    )
    trainer = L.Trainer(
        max_steps=max_steps, accelerator="cpu", plugins=plugins, callbacks=[every], logger=False,
        enable_progress_bar=False, enable_model_summary=False,
    )
    trainer.fit(model, DataLoader(data, batch_size=8), ckpt_path=resume or None)
    weights = [p.detach().flatten().tolist() for p in model.parameters()]
    return {"global_step": trainer.global_step, "weights": weights}
"""


def train(ckdir: Path, **kwargs) -> dict:
    """The run above, in this process."""
    namespace: dict = {}
    exec(TRAIN, namespace)
    return namespace["train"](str(ckdir), **kwargs)


def run_killed_child(tmp_path: Path, ckdir: Path, kill_at: int) -> int:
    """The run above in a child process, killed in its ``kill_at``-th ``torch.save``; its exit code."""
    script = tmp_path / "child.py"
    script.write_text(KILL_PATCH + TRAIN + "\ntrain(sys.argv[1])\n")
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    env.update(OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    proc = subprocess.run(
        [sys.executable, str(script), str(ckdir), str(kill_at)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    if proc.returncode != -9:
        raise AssertionError(
            f"the child should have been killed, got {proc.returncode}:\n{proc.stderr[-3000:]}"
        )
    return proc.returncode


def flip_byte(path: Path, offset: int | None = None) -> None:
    data = bytearray(path.read_bytes())
    at = len(data) // 2 if offset is None else offset
    data[at] ^= 0xFF
    path.write_bytes(bytes(data))


def _tensor_byte(path: Path) -> int:
    """Offset of a byte in the middle of the file's largest tensor record (zip member ``*/data/N``)."""
    import zipfile

    with zipfile.ZipFile(path) as archive:
        info = max((i for i in archive.infolist() if "/data/" in i.filename), key=lambda i: i.file_size)
    with open(path, "rb") as f:  # local header: 30 fixed bytes, then name and extra field
        f.seek(info.header_offset + 26)
        name_len, extra_len = (int.from_bytes(f.read(2), "little") for _ in range(2))
    return info.header_offset + 30 + name_len + extra_len + info.file_size // 2


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """One uninterrupted 8-step run with the plugin: its checkpoints and final weights."""
    tmp = tmp_path_factory.mktemp("reference")
    result = train(tmp / "ck")
    assert result["global_step"] == 8
    return tmp / "ck", result


def test_a_run_killed_while_rewriting_last_ckpt_resumes_from_it_and_ends_where_an_unkilled_run_ends(
    tmp_path, reference
):
    ckdir = tmp_path / "ck"
    # Saves: step=2 (1), last (2), step=4 (3), last (4), step=6 (5), last (6) <- killed 4 KiB into it.
    assert run_killed_child(tmp_path, ckdir, kill_at=6) == -9
    assert any(".last.ckpt.tmp-" in p.name for p in ckdir.iterdir()), "the kill should leave only a temp file"
    survivor = VerifiedCheckpointIO().load_checkpoint(ckdir / "last.ckpt")
    assert survivor["global_step"] == 4  # the previous last.ckpt, whole and verified
    # scan lists the killed save's temp file as incomplete; the resume helper names a whole file.
    rows = {r.path.name: (r.status, r.step) for r in scan_checkpoints(ckdir)}
    (temp,) = [name for name in rows if name.startswith(".last.ckpt.tmp-")]
    assert rows.pop(temp)[0] == "incomplete"
    assert rows == {
        "step=2.ckpt": ("ok", 2),
        "step=4.ckpt": ("ok", 4),
        "last.ckpt": ("ok", 4),
        "step=6.ckpt": ("ok", 6),
    }
    assert latest_verified_checkpoint(ckdir) == str(ckdir / "step=6.ckpt")

    resumed = train(ckdir, resume=str(ckdir / "last.ckpt"))
    assert resumed["global_step"] == 8
    assert resumed["weights"] == reference[1]["weights"]


def test_a_byte_flipped_in_the_newest_checkpoint_is_refused_and_the_previous_one_loads(tmp_path, reference):
    ckdir = tmp_path / "ck"
    ckdir.mkdir()
    for name in ("step=6.ckpt", "step=8.ckpt"):
        (ckdir / name).write_bytes((reference[0] / name).read_bytes())
    flip_byte(
        ckdir / "step=8.ckpt", _tensor_byte(ckdir / "step=8.ckpt")
    )  # inside the weights, not the pickle
    plugin = VerifiedCheckpointIO()
    with pytest.raises(CorruptCheckpointError, match=r"step=8\.ckpt"):
        plugin.load_checkpoint(ckdir / "step=8.ckpt")
    assert plugin.load_checkpoint(ckdir / "step=6.ckpt")["global_step"] == 6
    # The stock loader takes the same damaged file without a word.
    assert TorchCheckpointIO().load_checkpoint(ckdir / "step=8.ckpt", weights_only=True)["global_step"] == 8


def test_the_plugin_carries_the_generators_lightning_does_not_save(tmp_path):
    import random

    plugin = VerifiedCheckpointIO()
    random.seed(5)
    torch.manual_seed(5)
    plugin.save_checkpoint({"global_step": 1, "state_dict": {}}, tmp_path / "a.ckpt")
    expected = (random.random(), torch.rand(3))
    torch.manual_seed(99)
    random.seed(99)
    loaded = plugin.load_checkpoint(tmp_path / "a.ckpt")
    assert "ckpt_lesson_rng" not in loaded  # handed to Lightning without our key
    assert random.random() == expected[0] and torch.equal(torch.rand(3), expected[1])


def test_a_missing_or_empty_folder_has_no_latest_checkpoint_and_a_file_is_refused(tmp_path):
    assert latest_verified_checkpoint(tmp_path / "never-made") is None
    assert latest_verified_checkpoint(tmp_path) is None
    (tmp_path / "f").write_text("x")
    with pytest.raises(CheckpointError, match="is a file"):
        latest_verified_checkpoint(tmp_path / "f")


def test_the_default_folder_finds_the_previous_runs_save_under_another_version(tmp_path, monkeypatch):
    # Lightning's default folder is lightning_logs/version_N/checkpoints, a new N on every start.
    plugin = VerifiedCheckpointIO()
    root = tmp_path / "lightning_logs"
    for version, step in ((0, 4), (1, 8), (2, 6)):  # version_2: a restart that resumed from step 4
        plugin.save_checkpoint({"epoch": 0, "global_step": step, "state_dict": {}},
                               root / f"version_{version}" / "checkpoints" / f"step={step}.ckpt")  # fmt: skip
    flip_byte(root / "version_1" / "checkpoints" / "step=8.ckpt")  # the newest is damaged: skipped
    newest = str(root / "version_2" / "checkpoints" / "step=6.ckpt")
    assert latest_verified_checkpoint(root) == newest
    assert latest_verified_checkpoint(tmp_path) == newest  # the trainer's default_root_dir works too
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("CKPT_LESSON_CKPT_DIR", raising=False)
    assert Path(latest_verified_checkpoint()).resolve() == Path(newest).resolve()  # the default
    monkeypatch.setenv("CKPT_LESSON_CKPT_DIR", str(root / "version_0" / "checkpoints"))
    assert latest_verified_checkpoint() == str(root / "version_0" / "checkpoints" / "step=4.ckpt")


def test_with_the_variable_set_the_plugin_saves_and_removes_there_and_the_helper_resumes_from_there(
    tmp_path, monkeypatch
):
    monkeypatch.chdir(tmp_path)
    under_test = tmp_path / "under-test"
    under_test.mkdir()
    monkeypatch.setenv("CKPT_LESSON_CKPT_DIR", str(under_test))
    train(tmp_path / "given", max_steps=4)
    assert not list((tmp_path / "given").glob("*.ckpt"))  # nothing where ModelCheckpoint pointed
    assert sorted(p.name for p in under_test.glob("*.ckpt")) == ["last.ckpt", "step=2.ckpt", "step=4.ckpt"]
    plugin = VerifiedCheckpointIO()
    plugin.remove_checkpoint(tmp_path / "given" / "step=2.ckpt")  # Lightning's path, removed there
    assert not (under_test / "step=2.ckpt").exists()
    newest = latest_verified_checkpoint()
    assert Path(newest).parent == under_test and plugin.load_checkpoint(newest)["global_step"] == 4
    result = train(tmp_path / "given", max_steps=6, resume=newest)  # a restart resumes from there
    assert result["global_step"] == 6 and (under_test / "step=6.ckpt").is_file()


def test_without_the_variable_the_helper_finds_a_logger_less_trainers_folder(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("CKPT_LESSON_CKPT_DIR", raising=False)
    VerifiedCheckpointIO().save_checkpoint({"epoch": 0, "global_step": 3, "state_dict": {}},
                                           tmp_path / "checkpoints" / "epoch=0-step=3.ckpt")  # fmt: skip
    assert Path(latest_verified_checkpoint()).resolve() == tmp_path / "checkpoints" / "epoch=0-step=3.ckpt"


def test_scan_lists_each_ckpt_of_a_lightning_run_with_epoch_and_step_and_names_the_newest(reference, capsys):
    ckdir = reference[0]
    results = scan_checkpoints(ckdir)
    rows = [(r.path.name, r.status, r.epoch, r.step) for r in results]
    # Two batches per epoch: step 2 ends epoch 0; last.ckpt is the step-8 save.
    assert rows == [
        ("step=2.ckpt", "ok", 0, 2),
        ("step=4.ckpt", "ok", 1, 4),
        ("step=6.ckpt", "ok", 2, 6),
        ("last.ckpt", "ok", 3, 8),
        ("step=8.ckpt", "ok", 3, 8),
    ]
    assert cli_main(["scan", str(ckdir)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert "       8  ok          step=8.ckpt (epoch 3)" in out
    assert out[-2:] == [
        "5 save(s): 5 ok, 0 corrupt, 0 incomplete",
        f"newest good file: {Path(latest_verified_checkpoint(ckdir)).name}",
    ]
    assert Path(latest_verified_checkpoint(ckdir)).name in ("last.ckpt", "step=8.ckpt")


def test_scan_reports_a_flipped_byte_as_corrupt_and_the_resume_helper_picks_the_previous_file(
    tmp_path, reference, capsys
):
    ckdir = tmp_path / "ck"
    ckdir.mkdir()
    for name in ("step=6.ckpt", "step=8.ckpt"):
        (ckdir / name).write_bytes((reference[0] / name).read_bytes())
    flip_byte(ckdir / "step=8.ckpt")
    statuses = {r.path.name: (r.status, r.step) for r in scan_checkpoints(ckdir)}
    assert statuses == {"step=6.ckpt": ("ok", 6), "step=8.ckpt": ("corrupt", 8)}
    assert latest_verified_checkpoint(ckdir) == str(ckdir / "step=6.ckpt")
    assert cli_main(["scan", str(ckdir)]) == 1
    out = capsys.readouterr().out
    assert "step=8.ckpt (epoch 3): contents do not match" in out
    assert out.splitlines()[-1] == "newest good file: step=6.ckpt"


def test_scan_reports_stock_files_as_unverified_and_a_torn_stock_file_as_corrupt_without_unpickling(
    tmp_path, monkeypatch
):
    stock = TorchCheckpointIO()
    # A hyper-parameter no weights-only load accepts: the scan still reads epoch and step.
    stock.save_checkpoint(
        {"epoch": 1, "global_step": 4, "hyper_parameters": {"p": Path("x")}}, tmp_path / "a.ckpt"
    )
    stock.save_checkpoint(
        {"epoch": 2, "global_step": 6, "state_dict": {"w": torch.ones(64)}}, tmp_path / "b.ckpt"
    )
    torn = (tmp_path / "b.ckpt").read_bytes()
    (tmp_path / "b.ckpt").write_bytes(torn[: len(torn) // 2])  # the stock writer, killed mid-save

    def refuse(*args, **kwargs):
        raise AssertionError("a scan must not unpickle")

    monkeypatch.setattr(torch, "load", refuse)
    monkeypatch.setattr(pickle, "load", refuse)
    monkeypatch.setattr(pickle, "loads", refuse)
    rows = {r.path.name: (r.status, r.epoch, r.step) for r in scan_checkpoints(tmp_path)}
    assert rows == {"a.ckpt": ("unverified", 1, 4), "b.ckpt": ("corrupt", None, None)}
    assert latest_verified_checkpoint(tmp_path) is None


def test_an_unsafe_hyper_parameter_type_is_named_and_the_allowlist_lets_it_load(tmp_path):
    path = tmp_path / "hp.ckpt"
    plugin = VerifiedCheckpointIO()
    plugin.save_checkpoint(
        {"state_dict": {"w": torch.ones(2)}, "hyper_parameters": {"data": Path("x")}}, path
    )
    with pytest.raises(UnsafeCheckpointError, match=r"pathlib\.PosixPath.*safe_globals"):
        plugin.load_checkpoint(path)
    loaded = VerifiedCheckpointIO(safe_globals=[pathlib.PosixPath]).load_checkpoint(path)
    assert loaded["hyper_parameters"]["data"] == Path("x")


def test_files_from_the_stock_writer_are_refused_unless_integrity_is_waived(tmp_path):
    path = tmp_path / "stock.ckpt"
    TorchCheckpointIO().save_checkpoint({"global_step": 3}, path)
    with pytest.raises(CheckpointError, match="no integrity footer"):
        VerifiedCheckpointIO().load_checkpoint(path)
    assert VerifiedCheckpointIO(require_integrity=False).load_checkpoint(path)["global_step"] == 3


def test_the_full_unpickler_and_urls_are_refused(tmp_path):
    plugin = VerifiedCheckpointIO()
    with pytest.raises(CheckpointError, match="safe_globals"):
        plugin.load_checkpoint(tmp_path / "x.ckpt", weights_only=False)
    with pytest.raises(CheckpointError, match="local"):
        plugin.save_checkpoint({}, "s3://bucket/x.ckpt")


def test_remove_checkpoint_deletes_the_file_and_tolerates_a_missing_one(tmp_path):
    plugin = VerifiedCheckpointIO()
    plugin.save_checkpoint({"a": 1}, tmp_path / "a.ckpt")
    plugin.remove_checkpoint(tmp_path / "a.ckpt")
    plugin.remove_checkpoint(tmp_path / "a.ckpt")
    assert list(tmp_path.iterdir()) == []


def lightning_like_checkpoint(layers: int = 24, width: int = 128) -> dict:
    """About 3 MB in many tensors, shaped like a Lightning checkpoint (weights plus AdamW moments)."""
    weights = {f"layer{i}.weight": torch.randn(width, width) for i in range(layers)}
    moments = {
        i: {"exp_avg": torch.randn(width, width), "exp_avg_sq": torch.rand(width, width)}
        for i in range(layers)
    }
    return {
        "global_step": 1,
        "state_dict": weights,
        "optimizer_states": [{"state": moments, "param_groups": []}],
    }


def peak_python_bytes(save) -> int:
    tracemalloc.start()
    try:
        save()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_a_save_streams_peak_memory_stays_under_a_tenth_of_the_file_while_the_stock_writer_copies_it_all(
    tmp_path,
):
    checkpoint = lightning_like_checkpoint()
    ours, stock = tmp_path / "ours.ckpt", tmp_path / "stock.ckpt"
    ours_peak = peak_python_bytes(lambda: VerifiedCheckpointIO().save_checkpoint(checkpoint, ours))
    stock_peak = peak_python_bytes(lambda: TorchCheckpointIO().save_checkpoint(checkpoint, stock))
    size = ours.stat().st_size
    assert ours_peak < 0.10 * size
    # The control: the same measurement does see a full in-memory copy when there is one.
    assert stock_peak > 0.90 * stock.stat().st_size


class RecordingIO(VerifiedCheckpointIO):
    """Blocks each save until released, and records the order in which jobs ran."""

    def __init__(self, fail: bool = False) -> None:
        super().__init__()
        self.release, self.order, self.fail = threading.Event(), [], fail

    def save_checkpoint(self, checkpoint, path, storage_options=None):
        self.release.wait(timeout=30)
        if self.fail:
            raise OSError("disk full (simulated)")
        super().save_checkpoint(checkpoint, path)
        self.order.append(("save", Path(path).name))

    def remove_checkpoint(self, path):
        super().remove_checkpoint(path)
        self.order.append(("remove", Path(path).name))


def test_the_async_plugin_removes_the_old_file_only_after_the_new_one_is_saved(tmp_path):
    old = tmp_path / "old.ckpt"
    VerifiedCheckpointIO().save_checkpoint({"global_step": 1}, old)
    inner = RecordingIO()
    plugin = OrderedAsyncCheckpointIO(inner)
    plugin.save_checkpoint({"global_step": 2, "w": torch.ones(3)}, tmp_path / "new.ckpt")
    plugin.remove_checkpoint(old)
    assert old.exists()  # the save ahead of it has not run yet, so neither has the removal
    inner.release.set()
    plugin.wait()
    plugin.teardown()
    assert inner.order == [("save", "new.ckpt"), ("remove", "old.ckpt")]
    assert not old.exists()
    assert VerifiedCheckpointIO().load_checkpoint(tmp_path / "new.ckpt")["global_step"] == 2


def test_the_async_plugin_keeps_the_old_file_when_the_new_save_fails_and_reports_the_error(tmp_path):
    old = tmp_path / "old.ckpt"
    VerifiedCheckpointIO().save_checkpoint({"global_step": 1}, old)
    inner = RecordingIO(fail=True)
    plugin = OrderedAsyncCheckpointIO(inner)
    plugin.save_checkpoint({"global_step": 2}, tmp_path / "new.ckpt")
    plugin.remove_checkpoint(old)
    inner.release.set()
    with pytest.raises(OSError, match="disk full"):
        plugin.wait()
    assert old.exists() and not (tmp_path / "new.ckpt").exists()


def test_an_async_lightning_run_writes_verified_checkpoints(tmp_path):
    result = train(tmp_path / "ck", plugin="async", max_steps=4)
    assert result["global_step"] == 4
    loaded = VerifiedCheckpointIO().load_checkpoint(tmp_path / "ck" / "last.ckpt")
    assert loaded["global_step"] == 4


MID_EPOCH = r"""
import warnings
import torch, lightning as L
from torch.utils.data import DataLoader, TensorDataset
from ckpt_lesson.integrations.lightning import VerifiedCheckpointIO

class Tiny(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    def training_step(self, batch, i):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)
    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)

def run(ckdir, resume=None):
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(16, 4, generator=g), torch.randn(16, 1, generator=g))
    torch.manual_seed(0)
    model = Tiny()
    every = L.pytorch.callbacks.ModelCheckpoint(
        dirpath=ckdir, filename="{step}", every_n_train_steps=2, save_top_k=-1
    )
    trainer = L.Trainer(max_steps=8, accelerator="cpu", plugins=[VerifiedCheckpointIO()], callbacks=[every],
                        logger=False, enable_progress_bar=False, enable_model_summary=False)
    # 4 batches of 4 per epoch and a save every 2 steps: step 2 is in the middle of epoch 0.
    loader = DataLoader(data, batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(1))
    trainer.fit(model, loader, ckpt_path=resume)
    return [p.detach().clone() for p in model.parameters()]
"""


def test_lightning_resumes_mid_epoch_only_with_a_resumable_loader_the_documented_limit(tmp_path):
    # The limit the docs state (Lightning 2.6, training_epoch_loop.py): resuming from a checkpoint
    # taken inside an epoch with a plain DataLoader warns that the loader is not resumable, and the
    # run then differs from an uninterrupted one; the RNG our plugin restores cannot fix the data order.
    namespace: dict = {}
    exec(MID_EPOCH, namespace)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        uninterrupted = namespace["run"](str(tmp_path / "a"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        resumed = namespace["run"](str(tmp_path / "b"), resume=str(tmp_path / "a" / "step=2.ckpt"))
    assert any("not resumable" in str(w.message) for w in caught)
    assert not all(torch.equal(a, b) for a, b in zip(uninterrupted, resumed, strict=True))
