"""The frameworks' table in docs/resume-test.md is the one generated from the committed reports.

``benchmarks/frameworks_table.py`` runs the stock-resume scripts of ``examples/frameworks/`` under
resume-test (minutes, not in CI) and stores one JSON report per framework and scenario. These tests
never run a framework: they regenerate the table from the stored reports and compare, and check
that the reports were made with the scripts as they are committed now.
"""

from __future__ import annotations

import copy
import hashlib
import importlib.util
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("frameworks_table", REPO / "benchmarks/frameworks_table.py")
table = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(table)


@pytest.fixture(scope="module")
def reports():
    return table.load_reports()


def documented_table() -> str:
    doc = table.DOC.read_text()
    assert doc.count(table.BEGIN) == 1 and doc.count(table.END) == 1
    return doc.split(table.BEGIN, 1)[1].split(table.END, 1)[0].lstrip("\n")


def test_the_table_in_the_docs_is_the_one_generated_from_the_committed_reports(reports):
    assert documented_table() == table.render_table(reports)


def test_every_framework_has_a_committed_report_for_every_scenario(reports):
    found = [(r["framework"]["name"], r["framework"]["scenario"]) for r in reports]
    assert found == [(f, s) for f in table.FRAMEWORKS for s in table.SCENARIOS]


def test_each_report_was_made_with_the_script_as_committed_now(reports):
    # A script changed after its reports were made would leave the table describing other code.
    for r in reports:
        script, package, _ = table.FRAMEWORKS[r["framework"]["name"]]
        recorded = r["evidence"]["code"]["script"]
        assert recorded["path"] == f"REPO/{script}"
        assert recorded["sha256"] == hashlib.sha256((REPO / script).read_bytes()).hexdigest(), script
        assert r["framework"]["package"] == package and r["framework"]["version"]


def test_each_kill_landed_as_its_scenario_says(reports):
    for r in reports:
        _, kill_at, step = table.SCENARIOS[r["framework"]["scenario"]]
        assert r["settings"]["trials"] == 1 and r["evidence"]["scenario"]["kill_at"] == [kill_at]
        (trial,) = r["trials"]
        (kill,) = trial["kills"]
        assert kill["kind"] == kill_at and kill["target_step"] == step, (r["framework"], kill)
        if kill_at == "mid-save":
            assert kill["mid_save"], (r["framework"], kill["point"])


def test_a_changed_verdict_in_a_report_changes_its_row(reports):
    changed = copy.deepcopy(reports)
    changed[0]["verdict"] = "FAIL" if changed[0]["verdict"] != "FAIL" else "PASS"
    changed[0]["diagnosis"] = "a diagnosis of the test's own"
    assert table.render_table(changed) != table.render_table(reports)


def test_a_doc_without_the_markers_is_refused_by_name():
    with pytest.raises(SystemExit, match="frameworks-table:begin"):
        table.with_table("# no markers here\n", "| table |\n")


def _restarts(report: dict) -> list[tuple[int | None, int | None]]:
    (trial,) = report["trials"]
    return [(r["resumed_from"], r["first_step"]) for r in trial["restarts"]]


def test_the_cheapest_row_run_again_gives_the_committed_verdict(reports):
    # One real resume-test run (three short accelerate processes, about 15 s): the table's rows come
    # from runs like this one, not from the JSON alone. The others are left to the benchmark script.
    pytest.importorskip("accelerate", reason="accelerate is not installed: pip install -r requirements.txt")
    row = ("accelerate", "after-save-epoch-end")
    committed = next(r for r in reports if (r["framework"]["name"], r["framework"]["scenario"]) == row)
    fresh = table.run_report(*row)
    assert fresh["verdict"] == committed["verdict"], fresh["diagnosis"]
    assert fresh["first_difference"] == committed["first_difference"]
    assert _restarts(fresh) == _restarts(committed)
