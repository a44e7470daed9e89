"""A run makes hundreds of saves with retention on: what each costs, against hand-rolled PyTorch.

Run from the repository root (it re-executes itself with ``MALLOC_MMAP_THRESHOLD_``
set, see ``shared/notes/facts.md``)::

    python benchmarks/bench_steady_state.py --mb 64 --rounds 3          # a smoke run
    python benchmarks/bench_steady_state.py --mb 384 1024 4096 --rounds 5 --dir /mnt/disk
    python benchmarks/bench_steady_state.py --only save --mb 64 384 --rounds 15  # keep_last=1 only

For each size, the state is weights plus AdamW moments (12 bytes per parameter),
and every row pairs ours with its baseline in the same run, interleaved round
by round (ours, baseline, ours, ...), each writing fresh files:

* ``steady keep-3``: ``CheckpointManager(keep_last=3)`` with default options,
  after enough saves that retention deletes one save every time, against a
  hand-rolled keep-3 loop (``torch.save`` of model and optimizer state, fsync
  of the file and the folder, ``os.remove`` of the oldest file). The time is
  what the training thread waits for.
* ``keep_last=1``: the managed save against ``torch.save`` + fsync of file and
  folder (and ``os.remove`` of the previous file, so both keep one on disk).
  ``--only save`` runs this row alone and lists every round's time, sorted, for
  both sides: a disk with two speeds shows both in the baseline too.
* ``async stall``: ``AsyncCheckpointer.save_async`` (the training thread's
  share) against the synchronous managed save. With ``overlap_copy=False``
  (everything copied at once): once with the background deletion of the
  previous save finished before each save (as the training steps between two
  saves allow), once back to back. With the default (``"optimizer"``: the
  moments are copied while the next step's forward and backward run) and with
  ``overlap_copy=True`` (parameters too), the row charges ``save_async`` plus
  the time the next real training step's optimizer step waited for the copies.
* ``restore + first step``, warm and cold: ``restore_latest`` then one AdamW
  step, against ``torch.load(weights_only=True)`` + ``load_state_dict`` + one
  step. Cold drops the files' cached pages first (``posix_fadvise(DONTNEED)``).
* ``verify_on_save``: a managed save with ``"writer"`` (default), ``"device"``
  and ``False``, to price the two checks.
* ``peak extra memory``: the highest resident size during one managed save and
  one ``torch.save`` + fsync, above the size before (Linux ``VmHWM``, reset
  through ``/proc/self/clear_refs``); the same for one restore, warm and cold, against its
  baseline (resident pages: the file pages a mapped restore touches count).
* ``disk``: the disk's own write+fsync and cold read speed, measured beside the
  rows, so a disk-bound figure can be told apart.

``--folders N`` (default 10,000) adds the scale rows: a run directory holding N
step folders (small saves, hard links of one file with their own sealed
manifests): ``restore_latest`` when the newest save is good, a save's cost
there (retention runs in the background), the background pass itself, and
``restore_latest`` past damaged newer saves (truncated parts: size checks,
no hashing).

It prints a markdown table and writes it to ``benchmarks/results/``. Not a test;
CI does not run it.
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

if os.environ.get("MALLOC_MMAP_THRESHOLD_") is None:  # fresh pages for every load, as in a new process
    os.environ["MALLOC_MMAP_THRESHOLD_"] = "131072"
    os.execv(sys.executable, [sys.executable, *sys.argv])

import torch  # noqa: E402

from ckpt_lesson.files.checkpoint import TrainState  # noqa: E402
from ckpt_lesson.files.record_seal import seal_record  # noqa: E402
from ckpt_lesson.files.verify import drop_cached_pages  # noqa: E402
from ckpt_lesson.runs.async_save import AsyncCheckpointer  # noqa: E402
from ckpt_lesson.runs.manager import CheckpointManager  # noqa: E402
from ckpt_lesson.runs.retention import KeepLastK  # noqa: E402
from ckpt_lesson.runs.reverify import KnownGood, retention_pass  # noqa: E402
from ckpt_lesson.runs.scan import scan_checkpoints  # noqa: E402

WIDTH = 2048  # one Linear(2048, 2048) holds 4.2M parameters
BATCH = 16  # rows per training step in the overlap_copy row (forward and backward of the stack)


def build(mb: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A model whose weights + AdamW moments take about ``mb`` MB, after one step."""
    params = mb * 1_000_000 // 12
    layers = max(1, round(params / (WIDTH * WIDTH)))
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(layers)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    step(model, opt)
    return model, opt


def tiny() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A 50 KB state for the many-folder rows: they measure the folders, not the bytes."""
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 64)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    step(model, opt)
    return model, opt


def step(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    opt.zero_grad(set_to_none=False)
    for p in model.parameters():
        p.grad = torch.full_like(p, 1e-3) if p.grad is None else p.grad.fill_(1e-3)
    opt.step()


def train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, batch: torch.Tensor) -> None:
    """One real step: forward and backward of ``batch``, then AdamW."""
    opt.zero_grad(set_to_none=False)
    model(batch).square().mean().backward()
    opt.step()


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def torch_save_fsync(obj: object, path: Path) -> None:
    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
    fsync_dir(path.parent)


class HandRolled:
    """The loop people write: torch.save, fsync file and folder, remove the oldest beyond ``keep``."""

    def __init__(self, folder: Path, keep: int) -> None:
        self.folder, self.keep, self.files = folder, keep, []
        folder.mkdir(parents=True)

    def save(self, model: torch.nn.Module, opt: torch.optim.Optimizer, n: int) -> None:
        path = self.folder / f"ckpt-{n:08d}.pt"
        torch_save_fsync({"model": model.state_dict(), "optimizer": opt.state_dict(), "step": n}, path)
        self.files.append(path)
        while len(self.files) > self.keep:
            os.remove(self.files.pop(0))


def timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def paired(rounds: int, ours: Callable[[int], float], base: Callable[[int], float]) -> tuple[float, float]:
    """Medians of ``ours(i)`` and ``base(i)``, alternated (who goes first alternates too)."""
    a, b = [], []
    for i in range(rounds):
        if i % 2:
            b.append(base(i))
            a.append(ours(i))
        else:
            a.append(ours(i))
            b.append(base(i))
    return statistics.median(a), statistics.median(b)


def peak_extra_mb(fn: Callable[[], object]) -> float:
    """Highest RSS during ``fn`` above the RSS before it, in MB (Linux only; NaN elsewhere)."""

    def status(key: str) -> int:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(key):
                return int(line.split()[1]) * 1024
        raise KeyError(key)

    try:
        Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS
        before = status("VmRSS:")
    except OSError:
        return float("nan")
    fn()
    return (status("VmHWM:") - before) / 1e6


def drop_tree(folder: Path) -> None:
    for path in folder.rglob("*"):
        if path.is_file():
            drop_cached_pages(path)


def disk_speed(work: Path, mb: int) -> tuple[float, float]:
    """Write+fsync and cold-read speed of a fresh file of ``mb`` MB, in GB/s."""
    blob = os.urandom(1 << 20) * mb
    path = work / "disk-probe.bin"
    start = time.perf_counter()
    with open(path, "wb") as f:
        f.write(blob)
        f.flush()
        os.fsync(f.fileno())
    write = len(blob) / (time.perf_counter() - start) / 1e9
    drop_cached_pages(path)
    start = time.perf_counter()
    with open(path, "rb") as f:
        while f.read(1 << 24):
            pass
    read = len(blob) / (time.perf_counter() - start) / 1e9
    path.unlink()
    return write, read


def rows_for_size(mb: int, rounds: int, work: Path) -> list[tuple[str, str, float, float, str]]:
    """Every paired row at one size: (row, baseline, ours s, baseline s, note)."""
    model, opt = build(mb)
    real_mb = sum(p.numel() for p in model.parameters()) * 12 / 1e6
    label = f"{real_mb:,.0f} MB"
    rows = []
    ids = iter(range(1, 1_000_000))

    # Steady state keep-3: warm both up past K saves, then alternate.
    mgr = CheckpointManager(work / f"m3-{mb}", keep_last=3, every_steps=1)
    hand = HandRolled(work / f"h3-{mb}", keep=3)
    for _ in range(4):
        n = next(ids)
        mgr.save(model, opt, None, TrainState(step=n))
        hand.save(model, opt, n)
    ours, base = paired(
        rounds,
        lambda i: timed(lambda: mgr.save(model, opt, None, TrainState(step=next(ids)))),
        lambda i: timed(lambda: hand.save(model, opt, next(ids))),
    )
    rows.append((f"steady keep-3, {label}", "hand-rolled keep-3 loop", ours, base, "training thread"))
    mgr.close()
    shutil.rmtree(work / f"m3-{mb}")
    shutil.rmtree(work / f"h3-{mb}")

    mgr, hand, row = keep_last_1_row(model, opt, mb, rounds, work, ids, label)
    rows.append(row)

    # verify_on_save: price the checks, each against the default in the same rounds.
    for mode in ("device", False):
        other = CheckpointManager(work / f"v{mode}-{mb}", keep_last=1, every_steps=1, verify_on_save=mode)
        ours, base = paired(
            rounds,
            lambda i, o=other: timed(lambda: o.save(model, opt, None, TrainState(step=next(ids)))),
            lambda i: timed(lambda: mgr.save(model, opt, None, TrainState(step=next(ids)))),
        )
        rows.append((f"verify_on_save={mode!r}, {label}", "verify_on_save='writer'", ours, base, ""))
        other.close()
        shutil.rmtree(other.run_dir)

    # Async stall with everything copied on the training thread (overlap_copy=False): the training
    # thread's share of save_async, against a synchronous managed save. In training, steps run
    # between two saves and the background deletion of the previous save finishes there; back to
    # back, that deletion (unlinking a file of this size frees its cached pages, kernel work on one
    # of the two cores) competes with the snapshot copy. Both are rows.
    ckpt = AsyncCheckpointer(mgr, overlap_copy=False)

    def stall(i: int, settle: bool) -> float:
        ckpt.wait()
        if settle:
            mgr.wait_retention()
        return timed(lambda: ckpt.save_async(model, opt, None, TrainState(step=next(ids))))

    def sync(i: int, settle: bool) -> float:
        ckpt.wait()
        if settle:
            mgr.wait_retention()
        return timed(lambda: mgr.save(model, opt, None, TrainState(step=next(ids))))

    for settle, what in ((True, "deletion done between saves"), (False, "back to back")):
        ours, base = paired(rounds, lambda i, s=settle: stall(i, s), lambda i, s=settle: sync(i, s))
        rows.append(
            (f"async stall, overlap_copy=False ({what}), {label}", "synchronous managed save", ours, base, "")
        )
    ckpt.close()

    # The default (overlap_copy="optimizer": moments copied by the writer) and overlap_copy=True
    # (parameters too): the deferred tensors are copied on the writer thread while the next forward
    # and backward run, and the next optimizer step waits at a gate until they are copied. The
    # training thread's stall is then save_async's own time plus that wait (step_wait_s), measured
    # around one real training step (forward and backward of a batch, then AdamW).
    batch = torch.randn(BATCH, WIDTH)
    for mode, what in (("optimizer", "default, overlap_copy='optimizer'"), (True, "overlap_copy=True")):
        overlapped = AsyncCheckpointer(mgr, overlap_copy=mode)

        def overlap_stall(i: int, o: AsyncCheckpointer = overlapped) -> float:
            o.wait()
            mgr.wait_retention()
            waited = o.step_wait_s
            seconds = timed(lambda: o.save_async(model, opt, None, TrainState(step=next(ids))))
            train_step(model, opt, batch)
            return seconds + o.step_wait_s - waited

        def sync_settled(i: int, o: AsyncCheckpointer = overlapped) -> float:
            o.wait()
            mgr.wait_retention()
            return timed(lambda: mgr.save(model, opt, None, TrainState(step=next(ids))))

        ours, base = paired(rounds, overlap_stall, sync_settled)
        overlapped.close()
        rows.append(
            (
                f"async stall, {what} (+ the next step's wait), {label}",
                "synchronous managed save",
                ours,
                base,
                "",
            )
        )

    rows += restore_rows(mb, rounds, work, mgr, label)

    # Peak extra memory of one save.
    ours = peak_extra_mb(lambda: mgr.save(model, opt, None, TrainState(step=next(ids))))
    mgr.wait_retention()
    base = peak_extra_mb(lambda: hand.save(model, opt, next(ids)))
    rows.append((f"peak extra memory (MB), {label}", "torch.save + fsync", ours, base, "MB, not seconds"))
    mgr.close()
    shutil.rmtree(mgr.run_dir)
    shutil.rmtree(hand.folder)
    return rows


def keep_last_1_row(model, opt, mb: int, rounds: int, work: Path, ids, label: str, *, modes: bool = False):
    """The managed ``keep_last=1`` save against ``torch.save`` + fsync; returns both savers and the row.

    With ``modes`` the note lists every round's seconds, sorted, for both sides: a bimodal disk
    shows its modes in the baseline too, and a mode of our own shows only on our side.
    """
    mgr = CheckpointManager(work / f"m1-{mb}", keep_last=1, every_steps=1)
    hand = HandRolled(work / f"h1-{mb}", keep=1)
    for _ in range(2):
        n = next(ids)
        mgr.save(model, opt, None, TrainState(step=n))
        hand.save(model, opt, n)
    ours_s: list[float] = []
    base_s: list[float] = []

    def ours(i: int) -> float:
        ours_s.append(timed(lambda: mgr.save(model, opt, None, TrainState(step=next(ids)))))
        return ours_s[-1]

    def base(i: int) -> float:
        base_s.append(timed(lambda: hand.save(model, opt, next(ids))))
        return base_s[-1]

    ours_med, base_med = paired(rounds, ours, base)
    note = ""
    if modes:
        note = "ours " + " ".join(f"{x:.3f}" for x in sorted(ours_s))
        note += "; baseline " + " ".join(f"{x:.3f}" for x in sorted(base_s))
    return mgr, hand, (f"keep_last=1, {label}", "torch.save + fsync", ours_med, base_med, note)


def only_save_rows(mb: int, rounds: int, work: Path) -> list[tuple[str, str, float, float, str]]:
    """``--only save``: the managed ``keep_last=1`` save, every round's time in the note."""
    model, opt = build(mb)
    label = f"{sum(p.numel() for p in model.parameters()) * 12 / 1e6:,.0f} MB"
    ids = iter(range(1, 1_000_000))
    mgr, hand, row = keep_last_1_row(model, opt, mb, rounds, work, ids, label, modes=True)
    mgr.close()
    shutil.rmtree(mgr.run_dir)
    shutil.rmtree(hand.folder)
    return [row]


def only_restore_rows(mb: int, rounds: int, work: Path) -> list[tuple[str, str, float, float, str]]:
    """``--only restore``: one managed save and one hand-rolled file of the state, then the restore rows."""
    model, opt = build(mb)
    label = f"{sum(p.numel() for p in model.parameters()) * 12 / 1e6:,.0f} MB"
    mgr = CheckpointManager(work / f"m1-{mb}", keep_last=1, every_steps=1)
    mgr.save(model, opt, None, TrainState(step=1))
    HandRolled(work / f"h1-{mb}", keep=1).save(model, opt, 1)
    del model, opt
    return restore_rows(mb, rounds, work, mgr, label)


def restore_rows(
    mb: int, rounds: int, work: Path, mgr: CheckpointManager, label: str
) -> list[tuple[str, str, float, float, str]]:
    """Restore + first step, warm and cold, and the peak memory of one restore (``mgr``'s newest save
    against the hand-rolled loop's newest file in ``work/h1-MB``)."""
    rows = []
    # Restore + first optimizer step, warm and cold.
    mgr.wait_retention()
    plain = sorted((work / f"h1-{mb}").glob("*.pt"))[-1]
    fresh_model, fresh_opt = build(mb)

    def ours_restore(cold: bool) -> float:
        if cold:
            drop_tree(mgr.run_dir)

        def go() -> None:
            CheckpointManager(mgr.run_dir, keep_last=1, every_steps=1).restore_latest(
                fresh_model, fresh_opt, None
            )
            step(fresh_model, fresh_opt)

        return timed(go)

    def base_restore(cold: bool) -> float:
        if cold:
            drop_cached_pages(plain)

        def go() -> None:
            blob = torch.load(plain, weights_only=True, map_location="cpu")
            fresh_model.load_state_dict(blob["model"])
            fresh_opt.load_state_dict(blob["optimizer"])
            step(fresh_model, fresh_opt)

        return timed(go)

    for cold in (False, True):
        ours, base = paired(rounds, lambda i, c=cold: ours_restore(c), lambda i, c=cold: base_restore(c))
        what = "cold" if cold else "warm"
        rows.append(
            (f"restore + first step ({what}), {label}", "torch.load + load_state_dict + step", ours, base, "")
        )
    # Peak extra memory of one restore: resident pages, so the file pages ours maps count too.
    for cold in (False, True):
        ours = peak_extra_mb(lambda c=cold: ours_restore(c))
        base = peak_extra_mb(lambda c=cold: base_restore(c))
        what = "cold" if cold else "warm"
        rows.append(
            (f"peak extra memory of a restore ({what}, MB), {label}", "torch.load + load_state_dict + step",
             ours, base, "MB, resident (mapped file pages count)")
        )  # fmt: skip

    return rows


def make_folders(run: Path, count: int, real: tuple[int, ...] = ()) -> None:
    """``count`` step folders: real small saves at ``real`` (and step 1), the others hard links of
    step 1's file with their own sealed manifests (they scan as good; a restore would refuse them,
    as their payload says step 1)."""
    model, opt = tiny()
    with CheckpointManager(run, keep_last=count + 10, every_steps=1) as mgr:
        mgr.save(model, opt, None, TrainState(step=1))
        first = run / "step-00000001"
        manifest = json.loads((first / "manifest.json").read_text())
        for n in range(2, count + 1):
            folder = run / f"step-{n:08d}"
            if n in real:
                mgr.save(model, opt, None, TrainState(step=n))
                continue
            folder.mkdir()
            os.link(first / "checkpoint.pt", folder / "checkpoint.pt")
            record = {k: v for k, v in manifest.items() if k != "seal"}
            record.update(step=n, state={**manifest["state"], "step": n})
            (folder / "manifest.json").write_text(json.dumps(seal_record(record)))


def folder_rows(count: int, rounds: int, work: Path) -> list[tuple[str, str, float, float, str]]:
    rows = []
    model, opt = tiny()
    big, small = work / "many", work / "one"
    damaged = count // 10
    make_folders(big, count, real=(count - damaged, count))
    make_folders(small, 1)
    os.sync()  # the 10,000 unsynced manifests must not land in the first timed save's fsync
    last = count

    def restore(run: Path) -> float:
        return timed(
            lambda: CheckpointManager(run, keep_last=count + 10, every_steps=1).restore_latest(
                model, opt, None
            )
        )

    ours, base = paired(rounds, lambda i: restore(big), lambda i: restore(small))
    rows.append((f"restore_latest, {count:,} folders, newest good", "1 folder", ours, base, ""))

    per = timed(lambda: scan_checkpoints(small))
    whole = timed(lambda: scan_checkpoints(big))
    rows.append((f"scan, {count:,} folders", f"scan of 1 folder x {count:,}", whole, per * count, ""))

    keep_all = CheckpointManager(big, keep_last=count * 10, every_steps=1)
    lone = CheckpointManager(small, keep_last=count * 10, every_steps=1)
    nums = iter(range(last + 1, last + 1000))

    def settled_save(mgr: CheckpointManager, settle: bool) -> float:
        if settle:  # as in training: the steps between two saves give the background pass its time
            mgr.wait_retention()
        return timed(lambda: mgr.save(model, opt, None, TrainState(step=next(nums))))

    for settle, what in ((True, "pass done between saves"), (False, "back to back")):
        ours, base = paired(
            rounds, lambda i, s=settle: settled_save(keep_all, s), lambda i, s=settle: settled_save(lone, s)
        )
        rows.append(
            (
                f"save with {count:,} folders, keep all ({what})",
                "save with 1 folder",
                ours,
                base,
                "training thread",
            )
        )
    keep_all.close()
    lone.close()

    known = KnownGood(verified=set(range(1, count + 1)))
    for n in known.verified:
        known.hashed_at[n] = 0
    one_pass = timed(lambda: retention_pass(big, KeepLastK(count * 10), known, emit=lambda *a, **k: None))
    rows.append((f"background pass, {count:,} folders, nothing to delete", "-", one_pass, float("nan"), ""))

    # Damaged newer saves: truncate the newest tenth's parts; restore must fall back past them to
    # the real save at count - damaged (size checks, no hashing, no unpickling).
    for n in range(count - damaged + 1, count + 1):
        link = big / f"step-{n:08d}" / "checkpoint.pt"
        data = link.read_bytes()[:100]
        link.unlink()
        link.write_bytes(data)
    for folder in sorted(big.glob("step-*"))[-rounds * 2 :]:
        if int(folder.name[5:]) > count:
            shutil.rmtree(folder)  # the saves made above: the newest must be a damaged one
    os.sync()
    logging.getLogger("ckpt_lesson").setLevel(logging.ERROR)  # one skip line per damaged save
    seconds = restore(big)
    rows.append(
        (
            f"restore_latest past {damaged:,} truncated newer saves",
            "per damaged save",
            seconds,
            seconds / damaged,
            "",
        )
    )

    passer = CheckpointManager(big, keep_last=3, every_steps=1)
    passer._retention.known.verified.update(range(1, count - damaged + 1))
    stall = timed(lambda: passer.save(model, opt, None, TrainState(step=count + 5000)))
    pass_s = timed(passer.wait_retention)
    rows.append(
        (f"save, then a pass deleting ~{count:,} folders", "the pass (background)", stall, pass_s, "")
    )
    passer.close()
    shutil.rmtree(big)
    shutil.rmtree(small)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=int, nargs="*", default=[64], help="state sizes; none: folder rows only")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--folders", type=int, default=10_000)
    parser.add_argument("--dir", default=None, help="where to write (default: the system temp dir)")
    parser.add_argument("--out", default="benchmarks/results", help="folder for the markdown result")
    parser.add_argument(
        "--only", choices=["restore", "save"], default=None, help="only these rows (no folder rows)"
    )
    args = parser.parse_args()
    torch.set_num_threads(1)
    load_before = os.getloadavg()
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-steady-", dir=args.dir) as tmp:
        work = Path(tmp)
        write, read = disk_speed(work, min(max(args.mb, default=64), 1024))
        for mb in args.mb:
            only = {"restore": only_restore_rows, "save": only_save_rows}.get(args.only, rows_for_size)
            rows += only(mb, args.rounds, work)
        if args.folders and not args.only:
            rows += folder_rows(args.folders, args.rounds, work)
    load_after = os.getloadavg()
    when = datetime.datetime.now(datetime.timezone.utc)
    lines = [
        f"# Steady state and real sizes ({when:%Y-%m-%d %H:%M} UTC)",
        "",
        f"Machine: {platform.node()}, {platform.machine()}, {os.cpu_count()} CPUs, "
        f"Python {platform.python_version()}, torch {torch.__version__}.",
        f"Load average (1, 5, 15 min): before {' '.join(f'{x:.2f}' for x in load_before)}, "
        f"after {' '.join(f'{x:.2f}' for x in load_after)}.",
        f"Disk: write+fsync {write:.2f} GB/s, cold read {read:.2f} GB/s (fresh file).",
        f"Command: `python {' '.join(sys.argv)}`; medians of {args.rounds} paired, interleaved rounds.",
        "",
        "| row | baseline | ours | baseline | ratio | note |",
        "|---|---|---:|---:|---:|---|",
    ]
    for name, baseline, ours, base, note in rows:
        ratio = ours / base if base == base and base > 0 else float("nan")
        lines.append(f"| {name} | {baseline} | {ours:.4f} | {base:.4f} | {ratio:.2f}x | {note} |")
    text = "\n".join(lines) + "\n"
    print(text)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"steady-{when:%Y%m%d-%H%M%S}.md").write_text(text)


if __name__ == "__main__":
    main()
