"""The committed outputs/ against what the demo would write now, without rewriting them.

Only what is true on every machine is compared exactly: the run's shape, the verdicts, the
skill recipe, the plot's size. The losses are compared to float rounding: another CPU's kernels
round their last bits differently (ATEN_CPU_CAPABILITY shows it on one machine), so a byte
comparison of the JSON or the PNG would fail on a learner's machine for no fault of theirs.
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

from ckpt_lesson.cli import build_parser
from ckpt_lesson.course.controls import CONTROL_KINDS
from ckpt_lesson.course.demo import RESUME_TOLERANCE, _baseline
from ckpt_lesson.course.demo_artifacts import DEMO_SCHEMA, _plot_png
from ckpt_lesson.course.demo_worker import COURSE_SIZES

OUTPUTS = Path(__file__).resolve().parent.parent / "outputs"
# The same losses to this relative difference: CPUs differ near 1e-7 after 30 steps.
LOSS_REL_TOL = 1e-5


def committed() -> dict:
    return json.loads((OUTPUTS / "resume-demo.json").read_text(encoding="utf-8"))


def png_size(data: bytes) -> tuple[int, int]:
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def test_the_committed_demo_record_is_the_run_the_demo_command_makes_by_default():
    doc = committed()
    args = build_parser().parse_args(["demo"])
    assert doc["schema"] == DEMO_SCHEMA
    shape = {k: doc[k] for k in ("total_steps", "interrupt_at", "num_shards", "seed", "resume_tolerance")}
    assert shape == {
        "total_steps": args.total_steps,
        "interrupt_at": args.interrupt_at,
        "num_shards": args.num_shards,
        "seed": args.seed,
        "resume_tolerance": RESUME_TOLERANCE,
    }


def test_the_committed_demo_record_holds_the_verdicts_every_machine_reaches():
    doc = committed()
    assert set(doc["variants"]) == {"single_file", "sharded", *CONTROL_KINDS}
    for name, v in doc["variants"].items():
        assert v["sample_ids_match"] is True
        assert v["real_resume"] is (name in ("single_file", "sharded"))
        if v["real_resume"]:
            assert v["max_loss_diff_after_resume"] == 0.0 and v["killed_by_sigkill"] is True
        else:
            assert v["max_loss_diff_after_resume"] > 100 * RESUME_TOLERANCE
        assert len(v["resumed_losses"]) == doc["total_steps"] - doc["interrupt_at"]


def test_the_committed_baseline_losses_are_this_machines_to_float_rounding():
    doc = committed()
    losses, _ = _baseline(doc["total_steps"], doc["seed"], COURSE_SIZES)
    assert len(losses) == len(doc["baseline_losses"])
    far = [
        (step, mine, theirs)
        for step, (mine, theirs) in enumerate(zip(losses, doc["baseline_losses"], strict=True), start=1)
        if not math.isclose(mine, theirs, rel_tol=LOSS_REL_TOL)
    ]
    assert not far, f"(step, this machine, committed) beyond float rounding: {far}"


def test_the_committed_plot_is_the_size_the_demo_draws():
    doc = committed()
    results = {
        "config": {k: doc[k] for k in ("total_steps", "interrupt_at", "seed")},
        "baseline": {"losses": doc["baseline_losses"]},
        "variants": doc["variants"],
    }
    drawn = png_size(_plot_png(results))
    assert png_size((OUTPUTS / "loss-curves.png").read_bytes()) == drawn == (990, 715)
