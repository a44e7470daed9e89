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


def test_bench_records_peak_memory_of_saves_and_page_cache_residency_of_cold_loads(tmp_path, capfd):
    out = tmp_path / "result.json"
    only = "save_checkpoint,load_checkpoint_cold,load_checkpoint"
    assert main(["bench", "--size-mb", "0.5", "--reps", "1", "--only", only, "--out", str(out)]) == 0
    rows = {r["variant"]: r for r in json.loads(out.read_text())["rows"]}
    assert rows["save_checkpoint"]["peak_extra_mb"] is not None  # Linux: /proc/self/clear_refs and VmHWM
    assert rows["load_checkpoint"]["resident"] == 1.0  # just written: every page cached
    assert rows["load_checkpoint_cold"]["resident"] < 1.0  # evicted before the timed load
    assert "peak MB" in capfd.readouterr().out  # printed by the re-executed child process


def test_bench_compares_async_saves_with_dcp_async_save(tmp_path):
    out = tmp_path / "result.json"
    only = "async_stall,dcp_async_persistent_stall,async_steps,dcp_async_steps"
    assert main(["bench", "--size-mb", "0.5", "--reps", "1", "--only", only, "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    pairs = {(r["variant"], r["baseline"]) for r in rows}
    assert ("async_stall", "dcp_async_persistent_stall") in pairs
    assert ("dcp_async_steps", "steps_alone") in pairs
    assert all(r["median_s"] > 0 for r in rows)
