"""What ``resume-test``'s folder watcher costs in CPU while the script trains: 10,000 files.

Run from the repository root::

    python benchmarks/bench_resume_watch.py                  # 10,000 files, 3 s per variant, 3 rounds
    python benchmarks/bench_resume_watch.py --files 4000 --seconds 5 --rounds 5

A checkpoint folder of ``--files`` files in 100 subfolders, and a writer
process that appends one line to a log in it every 50 ms (a training script
between saves). Each variant runs the runner's loop for ``--seconds``: sleep
on the waker (at most 20 ms), poll the watcher. Its CPU time (this process's
``time.process_time``; the writer runs in another process) divided by the wall
time is the share of a core the watcher takes. Variants:

* ``re-walk every tick`` (the baseline): the old watcher, a full walk of the
  folder on every 20 ms tick;
* ``inotify``: the watcher as shipped on Linux: the kernel names what changed,
  only that entry is looked at again;
* ``bounded polling``: the fallback without inotify: walks take at most 20%
  of the time.

Variants run interleaved (round robin), on fresh folders; the table gives the
median share of a core and the ratio to the baseline from the same round.
Prints a markdown table with the machine and the load average.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ckpt_lesson.resume_test import watch as resume_watch
from ckpt_lesson.resume_test.watch import FolderWatcher, Waker

TICK = 0.02  # the runner's longest sleep (resume_test.runner.TICK_SECONDS)
WRITER = """
import sys, time
path = sys.argv[1]
while True:
    with open(path, "a") as f:
        f.write("step,loss\\n")
    time.sleep(0.05)
"""


def make_folder(root: Path, files: int) -> None:
    per = max(1, files // 100)
    for i in range(files):
        sub = root / f"d{i // per:03d}"
        sub.mkdir(exist_ok=True)
        (sub / f"f{i:05d}.bin").write_bytes(b"x")


class RewalkEveryTick(FolderWatcher):
    """The baseline: the watcher as it was, one full walk per poll, however quiet the folder."""

    def _snapshot(self):
        return (*self._take(), None)


def measure(variant: str, files: int, seconds: float) -> float:
    with tempfile.TemporaryDirectory(prefix="bench-watch-") as tmp:
        root = Path(tmp)
        make_folder(root, files)
        writer = subprocess.Popen([sys.executable, "-c", WRITER, str(root / "metrics.csv")])
        waker = Waker()
        if variant == "bounded polling":
            waker.close()  # no inotify: the fallback path
        cls = RewalkEveryTick if variant == "re-walk every tick" else FolderWatcher
        watcher = cls(root, waker=waker)
        try:
            wall0, cpu0 = time.monotonic(), time.process_time()
            while time.monotonic() - wall0 < seconds:
                waker.wait(TICK)
                watcher.poll()
            return (time.process_time() - cpu0) / (time.monotonic() - wall0)
        finally:
            writer.kill()
            writer.wait()
            waker.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--files", type=int, default=10_000)
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    resume_watch.MAX_ENTRIES = max(resume_watch.MAX_ENTRIES, args.files + 200)
    variants = ["re-walk every tick", "inotify", "bounded polling"]
    shares: dict[str, list[float]] = {v: [] for v in variants}
    ratios: dict[str, list[float]] = {v: [] for v in variants}
    load_before = os.getloadavg()
    for _ in range(args.rounds):
        got = {v: measure(v, args.files, args.seconds) for v in variants}
        for v in variants:
            shares[v].append(got[v])
            ratios[v].append(got[v] / got["re-walk every tick"])
    load_after = os.getloadavg()
    machine = f"{platform.node()} {platform.machine()}, {os.cpu_count()} CPUs"
    print(f"machine: {machine}, Python {platform.python_version()}")
    print(f"load average before/after: {load_before[0]:.2f} / {load_after[0]:.2f}")
    each = f"{args.seconds:g} s x {args.rounds} rounds"
    print(f"{args.files} files in 100 folders, a log line every 50 ms, {each}\n")
    print("| variant | share of a core (median) | vs re-walk every tick (median ratio) |")
    print("|---|---|---|")
    for v in variants:
        print(f"| {v} | {statistics.median(shares[v]) * 100:.1f}% | {statistics.median(ratios[v]):.3f}x |")


if __name__ == "__main__":
    main()
