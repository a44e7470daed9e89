"""The bench command: a seconds-long smoke run checks its output, never its timings."""

from __future__ import annotations

import json

from ckpt_lesson.cli import main


def test_bench_writes_paired_ratios_load_average_and_the_mmap_setting(tmp_path, capsys):
    out = tmp_path / "result.json"
    only = "atomic_save,load_checkpoint"
    assert main(["bench", "--size-mb", "0.5", "--reps", "2", "--only", only, "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert [r["variant"] for r in result["rows"]] == ["atomic_save", "load_checkpoint"]
    for row in result["rows"]:
        assert len(row["ratios"]) == 2 and row["median_ratio"] > 0
        assert len(result["seconds"][row["variant"]]) == len(result["seconds"][row["baseline"]]) == 2
    assert result["MALLOC_MMAP_THRESHOLD_"] == "131072"  # re-executed with fresh pages for big buffers
    assert len(result["load_before"]) == 3 and isinstance(result["under_load"], bool)


def test_bench_refuses_an_unknown_variant_with_exit_code_2(tmp_path, capsys):
    assert main(["bench", "--only", "nonsense", "--reps", "1", "--out", str(tmp_path / "r.json")]) == 2
    assert "--only" in capsys.readouterr().err
