"""The benchmark run: what our safety costs against plain PyTorch, measured honestly.

How (each rule closes a way benchmarks lie):

* every repetition runs every variant once, **in a shuffled order**, each into
  a **fresh folder** (rewriting one file would time page reuse, not a save);
* ratios are **paired**: variant / baseline within the same repetition, then
  the median over repetitions, so a slow moment slows both sides of a ratio;
* ``MALLOC_MMAP_THRESHOLD_=131072`` is set (the command re-executes itself
  with it when missing) so large buffers get fresh pages, as in a new resume
  process; without it glibc reuses touched pages and loads look up to 3x faster;
* the **load average** is recorded before and after; when the machine was busy
  before the run (1-minute load above half the cores; the run's own threads
  raise the figure after it, so that one is kept as data) the output and the JSON say
  ``MEASURED UNDER LOAD``, and the numbers must not be quoted without that.

The ``bench`` command (:mod:`ckpt_lesson.cli.bench`) checks its flags, sets the
variable, calls :func:`measure`, writes the JSON and prints :func:`print_table`.
"""

from __future__ import annotations

import os
import platform
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ckpt_lesson.bench.cases import Sample

__all__ = ["MMAP_ENV", "MMAP_VALUE", "measure", "print_table"]

#: glibc's knob: buffers above this many bytes get fresh pages (see the module docstring).
MMAP_ENV = "MALLOC_MMAP_THRESHOLD_"
MMAP_VALUE = "131072"


def _loadavg() -> list[float]:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return []


def _machine() -> dict[str, Any]:
    import torch

    return {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "processor": platform.processor() or platform.machine(),
    }


def measure(
    wanted: list[tuple[str, str, str]], *, size_mb: float, reps: int, seed: int, folder: str | None
) -> dict[str, Any]:
    """Time every variant of ``wanted`` and its baseline, shuffled and paired, and sum them up.

    Args:
        wanted: ``(variant, baseline, what)`` rows from :data:`ckpt_lesson.bench.cases.PAIRS`.
        size_mb: Total state size (weights + AdamW moments).
        reps: Repetitions; each runs every variant once, in a fresh folder.
        seed: Seed of the shuffled order.
        folder: Where the files are written (None: the system temp folder).

    Returns:
        The result: machine, load before and after, one row of paired ratios per variant,
        and every raw time (the JSON that ``bench`` writes).

    Example:
        >>> measure(PAIRS[:1], size_mb=8, reps=3, seed=0, folder=None)  # doctest: +SKIP
        {'size_mb': 8, ...}
    """
    # Imported here, not at the top: the cases pull in torch, and `--help` should stay fast.
    from ckpt_lesson.bench.cases import Sample, Workload, make_cases

    names = sorted({n for v, b, _ in wanted for n in (v, b)})
    load_before = _loadavg()
    workload = Workload(size_mb)
    cases = make_cases(workload)
    samples: dict[str, list[Sample]] = {n: [] for n in names}
    rng = random.Random(seed)
    print("warm-up: every variant once, not recorded (imports, first allocations)", file=sys.stderr)
    root = Path(tempfile.mkdtemp(prefix="ckpt-bench-", dir=folder))
    try:
        for name in names:
            (root / f"warm-{name}").mkdir()
            cases[name](root / f"warm-{name}")
            shutil.rmtree(root / f"warm-{name}")
        for rep in range(reps):
            order = names[:]
            rng.shuffle(order)
            for i, name in enumerate(order):
                print(f"\r[rep {rep + 1}/{reps}] {i + 1}/{len(order)} {name:<26}", end="", file=sys.stderr)
                folder = root / f"{rep}-{name}"
                folder.mkdir()
                got = cases[name](folder)
                samples[name].append(got if isinstance(got, Sample) else Sample(got))
                shutil.rmtree(folder)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print("", file=sys.stderr)
    load_after = _loadavg()
    cpus = os.cpu_count() or 1
    # Judged on the load *before* the run: the benchmark's own threads raise the load average it
    # leaves behind (on 2 cores a one-minute run ends near 1.0 by itself). "after" is kept as data.
    under_load = any(x > cpus / 2 for x in load_before[:1])
    times = {n: [x.seconds for x in got] for n, got in samples.items()}
    rows = []
    for variant, base, what in wanted:
        ratios = [v / b for v, b in zip(times[variant], times[base], strict=True)]
        rows.append(
            {
                "variant": variant,
                "baseline": base,
                "what": what,
                "median_ratio": round(statistics.median(ratios), 3),
                "ratios": [round(r, 3) for r in ratios],
                "median_s": round(statistics.median(times[variant]), 4),
                "baseline_median_s": round(statistics.median(times[base]), 4),
                "peak_extra_mb": _median_mb(samples[variant], "peak_extra"),
                "baseline_peak_extra_mb": _median_mb(samples[base], "peak_extra"),
                "resident": _median_of(samples[variant], "resident"),
                "baseline_resident": _median_of(samples[base], "resident"),
            }
        )
    return {
        "size_mb": size_mb,
        "state_bytes": workload.bytes,
        "reps": reps,
        "machine": _machine(),
        "load_before": load_before,
        "load_after": load_after,
        "under_load": under_load,
        MMAP_ENV: os.environ.get(MMAP_ENV),
        "created_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "rows": rows,
        "seconds": {n: [round(t, 4) for t in ts] for n, ts in times.items()},
    }


def _median_of(got: list[Any], field: str) -> float | None:
    values = [getattr(x, field) for x in got if getattr(x, field) is not None]
    return round(statistics.median(values), 3) if values else None


def _median_mb(got: list[Any], field: str) -> float | None:
    value = _median_of(got, field)
    return None if value is None else round(value / 1e6, 1)


def _mb(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}"


def print_table(result: dict[str, Any]) -> None:
    """Print ``result`` as a table, with the load warning first when the machine was busy.

    Args:
        result: What :func:`measure` returned.

    Example:
        >>> print_table(measure(PAIRS[:1], size_mb=8, reps=3, seed=0, folder=None))  # doctest: +SKIP
        8 MB of state, 3 repetitions, paired median ratios
    """
    if result["under_load"]:
        print(
            f"MEASURED UNDER LOAD (load average {result['load_before']} before, {result['load_after']} "
            f"after, {result['machine']['cpus']} CPUs): do not quote these ratios as the machine's; "
            "re-run when quiet."
        )
    print(
        f"{result['state_bytes'] / 1e6:.0f} MB of state, {result['reps']} repetitions, paired median ratios"
    )
    print("peak MB: most resident memory held above the start, variant / baseline")
    print(f"| {'variant':<26} | {'vs':<26} | ratio | variant s | baseline s | peak MB   |")
    for r in result["rows"]:
        peak = f"{_mb(r['peak_extra_mb'])} / {_mb(r['baseline_peak_extra_mb'])}"
        print(
            f"| {r['variant']:<26} | {r['baseline']:<26} | {r['median_ratio']:5.2f} | "
            f"{r['median_s']:9.4f} | {r['baseline_median_s']:10.4f} | {peak:<9} |"
        )
