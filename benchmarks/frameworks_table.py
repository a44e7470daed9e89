"""What resume-test finds in the frameworks' own resume: runs, JSON reports, and the docs table.

Three tiny scripts of ours, `examples/frameworks/`, resume the way each framework documents it,
with nothing of ckpt_lesson in their saving or loading (their one ckpt_lesson line is `log_step`,
which reports each step to the tool): the Hugging Face Trainer (`resume_from_checkpoint=True`),
Lightning (`ModelCheckpoint(save_last=True, every_n_train_steps=4)`, `ckpt_path="last"`) and
accelerate (`save_state` / `load_state`, `skip_first_batches`). Each has dropout and a shuffled
loader; 3 epochs of 6 steps, a save every 4 steps (mid-epoch at steps 4, 8, 16; an epoch's end at 12).

    python benchmarks/frameworks_table.py            # run every scenario (minutes), then the table
    python benchmarks/frameworks_table.py --only lightning:mid-save
    python benchmarks/frameworks_table.py --table    # only rewrite the table from the JSON

Each scenario is one `python -m ckpt_lesson resume-test --trials 1 --kills 1` run; its report goes
to `benchmarks/results/frameworks/FRAMEWORK-SCENARIO.json` with machine paths replaced by
`WORKDIR`, `REPO` and `python`. The table in `docs/resume-test.md` (between the two
`frameworks-table` comments) is generated from those files only, and `tests/test_frameworks_table.py`
checks that it still is. Not a test and not in CI: it starts about 40 framework processes.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from importlib.metadata import version
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results" / "frameworks"
DOC = REPO / "docs" / "resume-test.md"
BEGIN, END = "<!-- frameworks-table:begin -->", "<!-- frameworks-table:end -->"

#: framework -> (script, the distribution whose version the table names, the fix with ckpt_lesson).
FRAMEWORKS = {
    "hf": (
        "examples/frameworks/hf_trainer.py",
        "transformers",
        "`VerifiedCheckpointCallback()` and `resume_from_checkpoint=latest_verified_checkpoint()`: "
        "resumes from the newest save that verifies ([integrations](integrations.md#hugging-face-trainer))",
    ),
    "lightning": (
        "examples/frameworks/lightning_last.py",
        "lightning",
        "`plugins=[VerifiedCheckpointIO()]` and `ckpt_path=latest_verified_checkpoint()`: atomic, "
        "verified files that carry the generators; saves at epoch ends or a loader with "
        "`state_dict()` ([integrations](integrations.md#lightning))",
    ),
    "accelerate": (
        "examples/frameworks/accelerate_state.py",
        "accelerate",
        "a `CheckpointManager` loop: `restore_latest(state)` with the sampler's order and position in "
        "the state ([your loop](your-loop.md#an-epoch-loop-over-a-shuffled-dataloader-scheduler-per-epoch))",
    ),
}
#: scenario -> (words for the table, --kill-at, the save step the kill is aimed at). Saves fall
#: after steps 4, 8, 12, 16; step 12 ends epoch 2, the others are inside an epoch.
SCENARIOS = {
    "after-save-epoch-end": ("killed right after the save at an epoch's end (step 12)", "after-save", 12),
    "after-save-mid-epoch": ("killed right after a save mid-epoch (step 8)", "after-save", 8),
    "mid-save": ("killed during a save mid-epoch (step 8)", "mid-save", 8),
    "random-mid-epoch": ("killed at a random moment mid-epoch (after step 10)", "random", 10),
}
STEPS, SAVES = list(range(1, 19)), [4, 8, 12, 16, 18]


def seed_for(kill_at: str, step: int) -> int:
    """The first --seed whose one-kill plan aims at ``step`` (resume-test's own planner decides)."""
    from ckpt_lesson.resume_test.plan import plan_trials

    for seed in range(1000):
        (plan,) = plan_trials(
            steps=STEPS, save_steps=SAVES, trials=1, kinds=(kill_at,), kills=1, seed=seed, step_seconds=0.05
        )
        if plan.targets[0].step == step:
            return seed
    raise SystemExit(f"no seed below 1000 aims a {kill_at} kill at step {step}")


def run_report(framework: str, scenario: str) -> dict:
    """Run one scenario under resume-test; its report, machine paths replaced, the framework added.

    The kill is aimed at the save the scenario names, from the save steps the scripts are written
    to make; a baseline whose saves the tool saw elsewhere (a busy machine can make it see a save
    with the next step's report) is run again, up to three times, and then refused.
    """
    script, package, _ = FRAMEWORKS[framework]
    _, kill_at, step = SCENARIOS[scenario]
    for _ in range(3):
        with tempfile.TemporaryDirectory() as tmp:
            workdir = Path(tmp) / "rt"
            command = [sys.executable, "-m", "ckpt_lesson", "resume-test", "--workdir", str(workdir)]
            seed = str(seed_for(kill_at, step))
            command += ["--trials", "1", "--kills", "1", "--kill-at", kill_at, "--seed", seed]
            command += ["--", sys.executable, script, "--out", "{ckpt_dir}"]
            env = {**os.environ, "PYTHONPATH": str(REPO)}
            done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True)
            if done.returncode not in (0, 1, 3):
                why = done.stderr[-2000:]
                raise SystemExit(f"{framework}:{scenario}: resume-test exited {done.returncode}: {why}")
            text = (workdir / "report.json").read_text()
        # Longest first: the workdir lies under the temp folder, the interpreter may lie under the repo.
        paths = [(str(workdir), "WORKDIR"), (sys.executable, "python"), (str(REPO), "REPO")]
        for path, label in sorted(paths, key=lambda p: -len(p[0])):
            text = text.replace(path, label)
        report = json.loads(text)
        saves = report["baseline"]["save_steps"]
        if [s for s in saves if s < STEPS[-1]] == SAVES[:-1]:
            report["framework"] = {"name": framework, "package": package, "version": version(package),
                                   "scenario": scenario}  # fmt: skip
            return report
        print(f"{framework}:{scenario}: the baseline's saves were seen at {saves}; again", flush=True)
    raise SystemExit(f"{framework}:{scenario}: the baseline's saves were seen at {saves}, not at {SAVES}")


def run_one(framework: str, scenario: str) -> Path:
    """Run one scenario and store its report in ``benchmarks/results/frameworks/``."""
    report = run_report(framework, scenario)
    out = RESULTS / f"{framework}-{scenario}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"{framework:10} {scenario:22} {report['verdict']}", flush=True)
    return out


def load_reports(folder: Path = RESULTS) -> list[dict]:
    """Every stored report, in the table's order (framework, then scenario)."""
    reports = [json.loads(p.read_text()) for p in folder.glob("*.json")]
    order = {(f, s): i for i, (f, s) in enumerate((f, s) for f in FRAMEWORKS for s in SCENARIOS)}
    return sorted(reports, key=lambda r: order[(r["framework"]["name"], r["framework"]["scenario"])])


def _cell(text: str) -> str:
    return re.sub(r"\s+", " ", text.replace("|", "\\|")).strip()


def what_happened(report: dict) -> str:
    """Where the kill landed and where the restart began, as the report records them."""
    (trial,) = report["trials"]
    (kill,) = trial["kills"]
    (restart,) = trial["restarts"]
    if restart["first_step"] is None:
        return f"killed {kill['point']}; the restart reported no step"
    began = f"began at step {restart['first_step']}"
    if restart["resumed_from"] is not None and not restart["from_scratch"]:
        began = f"resumed from step {restart['resumed_from']}, {began}"
    return f"killed {kill['point']}; the restart {began}"


def what_it_found(report: dict) -> str:
    """The report's own words: the diagnosis of a FAIL, the reason of an INCONCLUSIVE, else a match."""
    if report["verdict"] == "FAIL":
        return report["diagnosis"]
    if report["verdict"] == "INCONCLUSIVE":
        repeat = report.get("repeatability") or {}
        if repeat.get("checked") and not repeat["repeats"]:
            return repeat["explanation"]
        return "; ".join(report["inconclusive"])
    return "every step equal to the uninterrupted run's, losses and sample ids bit for bit"


def render_table(reports: list[dict]) -> str:
    """The markdown table of ``reports`` (see :func:`load_reports`)."""
    lines = [
        "| framework | scenario | what happened | verdict | what resume-test says | fix with ckpt_lesson |",
        "|---|---|---|---|---|---|",
    ]
    for r in reports:
        fw = r["framework"]
        fix = "none needed here" if r["verdict"] == "PASS" else FRAMEWORKS[fw["name"]][2]
        cells = [f"{fw['package']} {fw['version']}", SCENARIOS[fw["scenario"]][0], _cell(what_happened(r)),
                 f"**{r['verdict']}**", _cell(what_it_found(r)), fix]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def with_table(doc: str, table: str) -> str:
    """``doc`` with the text between the two markers replaced by ``table``."""
    head, _, rest = doc.partition(BEGIN)
    _, _, tail = rest.partition(END)
    if not rest or END not in rest:
        raise SystemExit(f"{DOC}: the markers {BEGIN} and {END} are missing")
    return f"{head}{BEGIN}\n{table}{END}{tail}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--table", action="store_true", help="only regenerate the table from the JSON")
    parser.add_argument("--only", action="append", default=[], help="FRAMEWORK:SCENARIO to run (repeatable)")
    args = parser.parse_args(argv)
    if not args.table:
        every = [(f, s) for f in FRAMEWORKS for s in SCENARIOS]
        wanted = [tuple(o.split(":", 1)) for o in args.only] or every
        for framework, scenario in wanted:
            run_one(framework, scenario)
    DOC.write_text(with_table(DOC.read_text(), render_table(load_reports())))
    return 0


if __name__ == "__main__":
    sys.exit(main())
