"""The kill-and-resume demo's artifacts: a JSON record, a loss plot, the skill recipe.

Everything written here is deterministic (no timestamps, no temp paths, a
fixed plot style, PNG metadata without a software version), so running the
demo twice with the same arguments on the same machine and stack rewrites the
same bytes. Not on every machine: another CPU rounds the losses' last bits
differently and another matplotlib draws other pixels, so the committed
``outputs/`` is written only when asked (``--out outputs``) and tests compare
what holds everywhere (``tests/test_demo_artifacts.py``).
``python -m ckpt_lesson demo`` and notebook 05 both write through
:func:`write_demo_artifacts`.
"""

from __future__ import annotations

import io
import os
import platform
from pathlib import Path
from typing import Any

import torch

from ckpt_lesson.course.skill import write_skill_markdown
from ckpt_lesson.errors import CheckpointError
from ckpt_lesson.files.atomic import atomic_write_bytes, atomic_write_json

__all__ = ["DEMO_SCHEMA", "write_demo_artifacts"]

DEMO_SCHEMA = "ckpt_lesson.resume_demo.v1"


def write_demo_artifacts(results: dict[str, Any], out_dir: str | os.PathLike[str]) -> dict[str, Path]:
    """Write ``resume-demo.json``, ``loss-curves.png`` and the skill recipe to ``out_dir``.

    Deterministic: no timestamps, no temp paths, fixed plot style and PNG
    metadata, so re-running with the same arguments on the same machine
    rewrites identical bytes.

    Args:
        results: What :func:`run_full_demo` returned.
        out_dir: Created if missing.

    Returns:
        ``{"json": ..., "png": ..., "skill": ...}`` paths.

    Raises:
        CheckpointError: ``results`` is not shaped like :func:`run_full_demo`'s.

    Example:
        >>> paths = write_demo_artifacts(run_full_demo(ckpt_dir="ckpt"), "outputs")  # doctest: +SKIP
        >>> sorted(p.name for p in paths.values())  # doctest: +SKIP
        ['loss-curves.png', 'resume-demo.json', 'skill-checkpoint-save-resume.md']
    """
    needed = ("config", "baseline", "variants")
    missing = [k for k in needed if not isinstance(results, dict) or k not in results]
    if missing:
        raise CheckpointError(f"results lack {missing}; pass what run_full_demo() returned.")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    doc = {
        "schema": DEMO_SCHEMA,
        "torch": str(torch.__version__),
        "python": platform.python_version(),
        "machine": platform.machine(),
        **results["config"],
        "baseline_losses": results["baseline"]["losses"],
        "max_loss_diff_after_resume": {
            k: v["max_loss_diff_after_resume"] for k, v in results["variants"].items()
        },
        "sample_ids_match": {k: v["sample_ids_match"] for k, v in results["variants"].items()},
        "variants": results["variants"],
    }
    paths = {"json": out / "resume-demo.json", "png": out / "loss-curves.png"}
    atomic_write_json(doc, paths["json"])
    atomic_write_bytes(_plot_png(results), paths["png"])
    paths["skill"] = write_skill_markdown(out / "skill-checkpoint-save-resume.md")
    return paths


# Real resumes are drawn as markers only, so the baseline's line stays visible
# underneath them: the markers sitting exactly on it is the result.
_STYLE = {
    "single_file": {"label": "resumed from one file", "color": "tab:orange", "marker": "o", "linestyle": ""},
    "sharded": {"label": "resumed from shards", "color": "tab:green", "marker": "x", "linestyle": ""},
    "no_rng": {"label": "control: RNG not restored (naive)", "color": "tab:red", "linestyle": "--"},
    "fresh_optimizer": {
        "label": "control: fresh optimizer (naive)",
        "color": "tab:purple",
        "linestyle": "-.",
    },
}


def _plot_png(results: dict[str, Any]) -> bytes:
    # The object-oriented API with no pyplot: no global backend switch, so a
    # notebook's inline plots are untouched, and rcdefaults() inside a context
    # makes the bytes independent of the caller's style settings.
    import matplotlib
    from matplotlib.figure import Figure

    cfg, base = results["config"], results["baseline"]["losses"]
    k, n = cfg["interrupt_at"], cfg["total_steps"]
    with matplotlib.rc_context():
        matplotlib.rcdefaults()
        fig = Figure(figsize=(9, 6.5))
        top, bottom = fig.subplots(2, 1, sharex=True, gridspec_kw={"height_ratios": [3, 2]})
        top.plot(range(1, n + 1), base, color="black", linewidth=2.5, label="uninterrupted baseline")
        after = range(k + 1, n + 1)
        variants = results["variants"]
        order = [n for n in _STYLE if n in variants] + sorted(set(variants) - set(_STYLE))
        for name in order:  # a fixed drawing order, however the dict was built
            v = variants[name]
            style = {
                "linewidth": 1.5,
                "markersize": 6,
                "fillstyle": "none",
                **_STYLE.get(name, {"label": name}),
            }
            top.plot(after, v["resumed_losses"], **style)
            diffs = [abs(a - b) for a, b in zip(v["resumed_losses"], base[k:], strict=True)]
            diff = v["max_loss_diff_after_resume"]
            style["label"] = f"{name}: " + ("0.0, bit-identical" if diff == 0.0 else f"{diff:.3g}")
            bottom.plot(after, diffs, **{**style, "linestyle": style.get("linestyle") or "-"})
        for ax in (top, bottom):
            ax.axvline(k + 0.5, color="gray", linestyle=":", linewidth=1.5)
            ax.grid(alpha=0.3)
        top.annotate(
            f"saved at step {k},\nthen SIGKILL",
            xy=(k + 0.5, max(base)),
            xytext=(6, -4),
            textcoords="offset points",
            va="top",
            fontsize=9,
            color="dimgray",
        )
        top.set_ylabel("training loss (MSE)")
        top.set_title(
            f"SIGKILL after the step-{k} save, resume in a fresh process (seed {cfg['seed']}, {n} steps)"
        )
        top.legend(fontsize=8, loc="upper right")
        bottom.set_ylabel("|loss - baseline loss|")
        bottom.set_xlabel("optimizer step")
        bottom.legend(fontsize=8, loc="upper left", title="max |difference| after resume", title_fontsize=8)
        fig.tight_layout()
        buf = io.BytesIO()
        fig.savefig(buf, format="png", dpi=110, metadata={"Software": None})
    return buf.getvalue()
