"""``python -m ckpt_lesson``: help lists every command; errors exit 2 with a readable message."""

from __future__ import annotations

import runpy
import sys
import textwrap

import pytest

from ckpt_lesson import cli


def test_help_exits_zero_and_lists_every_registered_command(capsys):
    # In-process (a subprocess would spend seconds importing torch again); building the
    # parser imports every command module, so a broken one fails here too.
    with pytest.raises(SystemExit) as info:
        cli.main(["--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert "usage: python -m ckpt_lesson" in out
    for name in cli.COMMANDS:
        assert name in out


def test_python_dash_m_ckpt_lesson_runs_the_same_main(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["ckpt_lesson", "--help"])
    with pytest.raises(SystemExit) as info:
        runpy.run_module("ckpt_lesson", run_name="__main__")
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: python -m ckpt_lesson")
    assert all(name in out for name in cli.COMMANDS)


def test_no_command_is_a_usage_error_not_a_traceback(capsys):
    with pytest.raises(SystemExit) as info:
        cli.main([])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "required: COMMAND" in err and "--help" in err  # one line


@pytest.fixture
def fake_command(tmp_path, monkeypatch):
    """Register a throwaway command module whose run() raises a CheckpointError."""
    (tmp_path / "ckpt_fake_cmd.py").write_text(
        textwrap.dedent(
            """
            from ckpt_lesson.errors import CorruptCheckpointError

            def configure(parser):
                parser.add_argument("path")

            def run(args):
                if args.path == "bad.pt":
                    raise CorruptCheckpointError(f"{args.path}: damaged")
                return 0
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(cli, "COMMANDS", {"fake": ("ckpt_fake_cmd", "a test command")})


def test_a_checkpoint_error_becomes_exit_code_2_and_an_error_line(fake_command, capsys):
    assert cli.main(["fake", "bad.pt"]) == 2
    assert capsys.readouterr().err == "error: bad.pt: damaged\n"


def test_a_successful_command_returns_its_own_exit_code(fake_command):
    assert cli.main(["fake", "good.pt"]) == 0
