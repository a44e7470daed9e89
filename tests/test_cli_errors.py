"""Every command-line error is one line on stderr and a non-zero exit, never a traceback.

Each case runs ``python -m ckpt_lesson`` as a real subprocess, the way a user
(or a CI script) meets it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


#: Runs each command in a process of its own, forked from one that imported torch once: a fresh
#: interpreter per case would spend most of this file's time importing torch.
RUNNER = r"""
import json, os, sys, traceback
from ckpt_lesson.cli import main
results = []
for i, args in enumerate(json.loads(sys.argv[1])):
    err = os.path.join(sys.argv[2], f"{i}.err")
    pid = os.fork()
    if pid == 0:
        fd = os.open(err, os.O_WRONLY | os.O_CREAT, 0o600)
        os.dup2(fd, 2)
        os.dup2(os.open(os.devnull, os.O_WRONLY), 1)
        try:
            code = main(args)
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else 1
        except BaseException:
            traceback.print_exc()
            code = 1
        sys.stdout.flush(); sys.stderr.flush()
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    results.append(os.waitstatus_to_exitcode(status))
print(json.dumps(results))
"""


def cli_many(runs: list[list[str]], tmp: Path) -> list[subprocess.CompletedProcess[str]]:
    """Run ``python -m ckpt_lesson ARGS`` semantics for each args list, one forked process each."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("CKPT_LESSON_DEBUG", None)
    logs = tmp / "stderr"
    logs.mkdir()
    done = subprocess.run(
        [sys.executable, "-c", RUNNER, json.dumps(runs), str(logs)],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    codes = json.loads(done.stdout.strip().splitlines()[-1])
    return [
        subprocess.CompletedProcess(args, code, "", (logs / f"{i}.err").read_text())
        for i, (args, code) in enumerate(zip(runs, codes, strict=True))
    ]


def cli(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("CKPT_LESSON_DEBUG", None)
    return subprocess.run(
        [sys.executable, "-m", "ckpt_lesson", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        cwd=cwd,
    )


def assert_one_line_error(out: subprocess.CompletedProcess[str], *needles: str) -> str:
    assert out.returncode != 0, out.stdout
    assert "Traceback" not in out.stderr, out.stderr
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, out.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


@pytest.fixture
def a_file(tmp_path: Path) -> Path:
    path = tmp_path / "plain.txt"
    path.write_text("not a folder\n")
    return path


def cases(tmp: Path, a_file: Path) -> dict[str, tuple[list[str], tuple[str, ...]]]:
    long_path = "/".join(["x" * 250] * 20)
    (tmp / "empty").mkdir()
    bad_log = tmp / "badlog"
    bad_log.mkdir()
    (bad_log / "recovery.jsonl").write_bytes(b"\xff\xfe not utf-8\n")
    nested = tmp / "nested"
    nested.mkdir()
    (nested / "recovery.jsonl").write_text("[" * 200_000 + "\n" + "[" * 200_000 + "\n")
    typed = tmp / "typed"
    typed.mkdir()
    (typed / "recovery.jsonl").write_text(json.dumps({"steps_redone": "many"}) + "\n" + '{"x": [1]}garbage\n')
    dir_log = tmp / "dirlog"
    (dir_log / "recovery.jsonl").mkdir(parents=True)
    return {
        "scan_long_path": (["scan", long_path], ()),
        "scan_empty_folder": (["scan", str(tmp / "empty")], ("no saves found",)),
        "scan_a_file": (["scan", str(a_file)], ()),
        "migrate_long_path": (["migrate", long_path], ()),
        "migrate_long_suffix": (["migrate", str(a_file), "--backup-suffix", "s" * 300], ()),
        "migrate_zero_device": (["migrate", "/dev/zero"], ("not a regular file",)),
        "report_log_is_a_directory": (["report", str(dir_log)], ()),
        "report_log_not_utf8": (["report", str(bad_log)], ("recovery.jsonl",)),
        "report_log_deeply_nested": (["report", str(nested)], ("recovery.jsonl",)),
        "report_log_wrongly_typed": (["report", str(typed)], ("recovery.jsonl",)),
        "train_batch_size_zero": (
            ["train", "--ckpt-dir", str(tmp / "r"), "--total-steps", "3", "--batch-size", "0"],
            ("--batch-size",),
        ),  # fmt: skip
        "train_batch_size_too_big": (
            ["train", "--ckpt-dir", str(tmp / "r"), "--total-steps", "3", "--batch-size", "100000"],
            ("--batch-size",),
        ),
        "train_seed_too_big": (
            ["train", "--ckpt-dir", str(tmp / "r"), "--total-steps", "3", "--seed", str(2**70)],
            ("--seed",),
        ),
        "train_total_steps_zero": (
            ["train", "--ckpt-dir", str(tmp / "r"), "--total-steps", "0"],
            ("--total-steps",),
        ),
        "train_ckpt_dir_below_a_file": (
            ["train", "--ckpt-dir", str(a_file / "run"), "--total-steps", "3"],
            ("--ckpt-dir",),
        ),
        "train_ckpt_dir_on_proc": (
            ["train", "--ckpt-dir", "/proc/ckpt-run", "--total-steps", "3"],
            ("--ckpt-dir",),
        ),
        "train_bad_env_policy": (
            ["train", "--ckpt-dir", str(tmp / "r"), "--total-steps", "3", "--env-policy", "maybe"],
            ("--env-policy",),
        ),
        "demo_out_is_a_file": (["demo", "--out", str(a_file)], ("--out",)),
        "chaos_workdir_is_a_file": (["chaos", "--workdir", str(a_file), "--kills", "1"], ("--workdir",)),
        "unknown_command": (["frobnicate"], ()),
        "missing_argument": (["scan"], ()),
    }


CASE_NAMES = [
    "scan_long_path",
    "scan_empty_folder",
    "scan_a_file",
    "migrate_long_path",
    "migrate_long_suffix",
    "migrate_zero_device",
    "report_log_is_a_directory",
    "report_log_not_utf8",
    "report_log_deeply_nested",
    "report_log_wrongly_typed",
    "train_batch_size_zero",
    "train_batch_size_too_big",
    "train_seed_too_big",
    "train_total_steps_zero",
    "train_ckpt_dir_below_a_file",
    "train_ckpt_dir_on_proc",
    "train_bad_env_policy",
    "demo_out_is_a_file",
    "chaos_workdir_is_a_file",
    "unknown_command",
    "missing_argument",
]


def test_every_command_line_error_is_one_line_and_a_non_zero_exit(tmp_path, a_file):
    built = cases(tmp_path, a_file)
    results = cli_many([built[name][0] for name in CASE_NAMES], tmp_path)
    for name, out in zip(CASE_NAMES, results, strict=True):
        try:
            assert_one_line_error(out, *built[name][1])
        except AssertionError as exc:
            raise AssertionError(f"case {name}: {exc}") from None


def test_a_real_interpreter_exit_is_one_line_too(tmp_path):
    assert_one_line_error(cli("scan", str(tmp_path / "missing")), "no such run directory")


def test_the_case_list_covers_every_case_built(tmp_path, a_file):
    assert sorted(CASE_NAMES) == sorted(cases(tmp_path, a_file))


def test_scan_on_the_parent_of_run_folders_says_what_it_expected(tmp_path):
    (tmp_path / "run-a").mkdir()
    (tmp_path / "run-b").mkdir()
    line = assert_one_line_error(cli("scan", str(tmp_path)), "step-XXXXXXXX")
    assert "parent" in line


def test_report_json_is_strict_json_even_with_unknown_values(tmp_path):
    (tmp_path / "recovery.jsonl").write_text(
        json.dumps({"steps_redone": None, "recovery_seconds": 1.5}) + "\n"
    )
    out = cli("report", str(tmp_path), "--json")
    assert out.returncode == 0, out.stderr
    json.loads(out.stdout, parse_constant=lambda name: pytest.fail(f"{name} is not JSON"))


def test_a_refusal_names_the_flag_train_has(tmp_path):
    from ckpt_lesson.cli import one_line

    assert one_line("pass env_policy='warn' to continue; total_steps must be >= 1") == (
        "pass --env-policy warn to continue; --total-steps must be >= 1"
    )


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a small tmpfs needs root")
def test_train_on_a_full_disk_is_one_line_naming_the_lack_of_space(tmp_path):
    mount = tmp_path / "tiny"
    mount.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mount)], capture_output=True
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()[:100]}")
    try:
        out = cli("train", "--ckpt-dir", str(mount / "run"), "--total-steps", "4", "--ckpt-every-steps", "2")
        assert_one_line_error(out, "no space left on device")
        assert not [p for p in mount.rglob("*") if ".tmp-" in p.name]  # no temp file left behind
    finally:
        subprocess.run(["umount", str(mount)], capture_output=True)
