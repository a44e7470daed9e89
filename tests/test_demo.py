"""The kill-and-resume demo: real SIGKILL, fresh-process resume, exact comparison.

Child processes cost a torch import each, so the expensive runs happen once
per module: one real CLI run (four children) that every test reads from.
"""

from __future__ import annotations

import contextlib
import io
import json
import signal
from pathlib import Path

import pytest
import torch

from ckpt_lesson import errors
from ckpt_lesson.cli import demo as demo_cli
from ckpt_lesson.cli import main
from ckpt_lesson.course import demo
from ckpt_lesson.course.controls import CONTROL_KINDS
from ckpt_lesson.course.demo import demo_failures, run_resume_demo
from ckpt_lesson.course.demo_artifacts import DEMO_SCHEMA, write_demo_artifacts
from ckpt_lesson.course.skill import render_skill_markdown, write_skill_markdown
from ckpt_lesson.errors import CheckpointError
from ckpt_lesson.files import atomic, checkpoint, integrity, rng, schema, shard_index

STEPS, KILL_AT, SEED = 20, 7, 5
ARTIFACTS = ("resume-demo.json", "loss-curves.png", "skill-checkpoint-save-resume.md")


@pytest.fixture(scope="module")
def cli_run(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """One real ``python -m ckpt_lesson demo`` (in-process ``main``), with its resumes recorded.

    A spy wraps ``run_resume_demo`` (calling the real one) so the tests can
    also read the full per-variant dicts the CLI condenses into its JSON.
    """
    out = tmp_path_factory.mktemp("out")
    ckpt_dir = tmp_path_factory.mktemp("cli-ckpt")
    argv = ["demo", "--total-steps", str(STEPS), "--interrupt-at", str(KILL_AT), "--seed", str(SEED)]
    runs: list[dict] = []
    real = demo.run_resume_demo

    def spy(**kwargs: object) -> dict:
        runs.append(real(**kwargs))
        return runs[-1]

    stdout, stderr = io.StringIO(), io.StringIO()
    with (
        pytest.MonkeyPatch.context() as mp,
        contextlib.redirect_stdout(stdout),
        contextlib.redirect_stderr(stderr),
    ):
        mp.setattr(demo, "run_resume_demo", spy)
        rc = main([*argv, "--out", str(out), "--ckpt-dir", str(ckpt_dir)])
    doc = json.loads((out / "resume-demo.json").read_text(encoding="utf-8"))
    by_kind = {("sharded" if r["sharded"] else "single_file"): r for r in runs}
    return {
        "rc": rc,
        "out": out,
        "ckpt_dir": ckpt_dir,
        "doc": doc,
        "stdout": stdout.getvalue(),
        "stderr": stderr.getvalue(),
        **by_kind,
    }


@pytest.fixture(scope="module")
def single(cli_run: dict) -> dict:
    return cli_run["single_file"]


@pytest.fixture(scope="module")
def sharded(cli_run: dict) -> dict:
    return cli_run["sharded"]


# --- the real resume, single file -------------------------------------------


def test_single_file_resume_in_a_fresh_process_matches_the_baseline_exactly(single: dict) -> None:
    assert single["max_loss_diff_after_resume"] == 0.0
    # the lesson's shape: the checkpoint's history plus the resumed steps, the whole run long
    assert single["resumed_losses"] == single["full_losses"]
    assert len(single["resumed_losses"]) == STEPS


def test_single_file_resume_trains_on_the_same_sample_ids_as_the_baseline(single: dict) -> None:
    assert single["sample_ids_match"] is True
    assert single["resumed_sample_ids"] == single["baseline_sample_ids"]
    assert len(single["resumed_sample_ids"]) == STEPS - KILL_AT


def test_the_interrupted_child_really_was_sigkilled(single: dict) -> None:
    assert single["interrupted_returncode"] == -signal.SIGKILL
    assert single["killed_by_sigkill"] is True


def test_the_checkpoint_holds_the_losses_the_killed_child_recorded(single: dict) -> None:
    assert single["losses_before_interrupt"] == single["full_losses"][:KILL_AT]
    assert single["max_loss_diff_before_interrupt"] == 0.0
    payload = checkpoint.read_checkpoint(single["checkpoint"])
    assert payload["state"]["step"] == KILL_AT


def test_demo_leaves_no_signal_files_behind(single: dict) -> None:
    ckpt_dir = Path(single["checkpoint"]).parent
    names = sorted(p.name for p in ckpt_dir.iterdir())
    assert names == ["ckpt.pt", "index.json", "meta.pt", *(f"model.shard-00{i}.pt" for i in range(3))]


# --- the sharded variant and the CLI (one real run) ---------------------------


def test_cli_demo_returns_zero_and_writes_the_three_artifacts(cli_run: dict) -> None:
    assert cli_run["rc"] == 0
    assert sorted(p.name for p in cli_run["out"].iterdir()) == sorted(ARTIFACTS)


def test_sharded_resume_in_a_fresh_process_matches_the_baseline_exactly(sharded: dict) -> None:
    assert sharded["sharded"] is True and sharded["num_shards"] == 3
    assert sharded["max_loss_diff_after_resume"] == 0.0
    assert sharded["resumed_losses"] == sharded["full_losses"]
    assert sharded["resumed_sample_ids"] == sharded["baseline_sample_ids"]
    assert sharded["sample_ids_match"] is True
    assert sharded["interrupted_returncode"] == -signal.SIGKILL


def test_the_json_records_the_sharded_resume_as_it_happened(cli_run: dict, sharded: dict) -> None:
    recorded = cli_run["doc"]["variants"]["sharded"]
    assert recorded["resumed_losses"] == sharded["resumed_losses"][KILL_AT:]  # the JSON keeps the tail
    assert recorded["max_loss_diff_after_resume"] == 0.0 and recorded["killed_by_sigkill"] is True


def test_sharded_demo_checkpoint_is_a_real_sharded_directory(sharded: dict, cli_run: dict) -> None:
    shard_dir = Path(sharded["checkpoint"])
    assert shard_dir == cli_run["ckpt_dir"]  # straight into ckpt_dir, as in the lesson
    index = shard_index.read_shard_index(shard_dir)
    assert [e["file"] for e in index["shards"]] == [f"model.shard-00{i}.pt" for i in range(3)]


def test_demo_json_has_its_schema_config_and_every_variant(cli_run: dict) -> None:
    doc = cli_run["doc"]
    assert doc["schema"] == DEMO_SCHEMA
    assert (doc["total_steps"], doc["interrupt_at"], doc["seed"]) == (STEPS, KILL_AT, SEED)
    assert doc["torch"] == str(torch.__version__)
    for key in ("python", "machine", "num_shards", "baseline_losses", "resume_tolerance"):
        assert key in doc
    assert set(doc["variants"]) == {"single_file", "sharded", *CONTROL_KINDS}
    assert doc["max_loss_diff_after_resume"]["single_file"] == 0.0
    assert doc["sample_ids_match"] == {
        "single_file": True,
        "sharded": True,
        "no_rng": True,
        "fresh_optimizer": True,
    }
    assert len(doc["baseline_losses"]) == STEPS


def test_demo_json_holds_no_paths_or_times(cli_run: dict) -> None:
    text = (cli_run["out"] / "resume-demo.json").read_text(encoding="utf-8")
    assert str(cli_run["ckpt_dir"]) not in text and "/tmp" not in text
    assert "saved_at" not in text and "time" not in text


def test_cli_prints_a_table_with_every_variant_and_no_failures(cli_run: dict) -> None:
    lines = cli_run["stdout"].splitlines()
    assert "max |loss diff| after resume" in lines[0] and "sample ids match" in lines[0]
    rows = {line.split()[0]: line.split()[1:] for line in lines[1:5]}
    assert rows["single_file"] == ["0", "True"] and rows["sharded"] == ["0", "True"]
    assert float(rows["no_rng"][0]) > 0 and float(rows["fresh_optimizer"][0]) > 0


def test_rewriting_the_artifacts_gives_identical_bytes(cli_run: dict, tmp_path) -> None:
    doc = cli_run["doc"]
    results = {
        "config": {
            k: doc[k] for k in ("total_steps", "interrupt_at", "num_shards", "seed", "resume_tolerance")
        },
        "baseline": {"losses": doc["baseline_losses"]},
        "variants": doc["variants"],
    }
    write_demo_artifacts(results, tmp_path)
    for name in ARTIFACTS:
        assert (tmp_path / name).read_bytes() == (cli_run["out"] / name).read_bytes(), name


def test_cli_demo_announces_each_phase_on_stderr_and_keeps_stdout_for_the_table(cli_run: dict) -> None:
    lines = cli_run["stderr"].splitlines()
    assert [line.split("]")[0] for line in lines] == ["[1/4", "[2/4", "[3/4", "[4/4"]
    assert "SIGKILL" in lines[0] and "sharded" in lines[1] and "no_rng" in lines[2]
    assert "[1/4]" not in cli_run["stdout"]


def test_cli_demo_exits_1_when_a_real_resume_diverges(cli_run: dict, tmp_path, monkeypatch, capsys) -> None:
    doc = cli_run["doc"]
    variants = {k: dict(v) for k, v in doc["variants"].items()}
    variants["sharded"]["max_loss_diff_after_resume"] = 1e-3  # above RESUME_TOLERANCE
    config = {k: doc[k] for k in ("total_steps", "interrupt_at", "num_shards", "seed", "resume_tolerance")}
    fake = {"config": config, "baseline": {"losses": doc["baseline_losses"]}, "variants": variants}
    monkeypatch.setattr(demo_cli, "run_full_demo", lambda **kwargs: fake)
    rc = main(["demo", "--total-steps", str(STEPS), "--interrupt-at", str(KILL_AT), "--out", str(tmp_path)])
    assert rc == 1
    assert "FAILED sharded" in capsys.readouterr().err


def test_write_demo_artifacts_refuses_a_dict_it_does_not_know(tmp_path) -> None:
    with pytest.raises(CheckpointError, match="run_full_demo"):
        write_demo_artifacts({"variants": {}}, tmp_path)


# --- what the CLI counts as a failure ----------------------------------------


def test_demo_failures_flags_a_diverged_resume_and_a_control_that_did_not_diverge() -> None:
    results = {
        "variants": {
            "single_file": {"real_resume": True, "max_loss_diff_after_resume": 0.5, "sample_ids_match": True},
            "no_rng": {"real_resume": False, "max_loss_diff_after_resume": 0.0, "sample_ids_match": True},
            "sharded": {"real_resume": True, "max_loss_diff_after_resume": 0.0, "sample_ids_match": True},
        }
    }
    problems = demo_failures(results)
    assert len(problems) == 2
    assert problems[0].startswith("single_file") and problems[1].startswith("no_rng")


# --- argument validation and help ----------------------------------------------


@pytest.mark.parametrize(("total", "kill"), [(20, 20), (20, 25), (20, 0), (5, -1)])
def test_run_resume_demo_refuses_an_interrupt_outside_the_run(tmp_path, total: int, kill: int) -> None:
    with pytest.raises(CheckpointError, match="interrupt_at"):
        run_resume_demo(total_steps=total, interrupt_at=kill, ckpt_dir=tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_run_resume_demo_refuses_zero_shards(tmp_path) -> None:
    with pytest.raises(CheckpointError, match="num_shards"):
        run_resume_demo(total_steps=10, interrupt_at=3, ckpt_dir=tmp_path, sharded=True, num_shards=0)


@pytest.mark.parametrize("size", ["in_dim", "hidden", "out_dim", "batch_size", "batches_per_epoch"])
def test_run_resume_demo_refuses_a_size_below_one_before_starting_anything(tmp_path, size: str) -> None:
    with pytest.raises(CheckpointError, match=size):
        run_resume_demo(total_steps=10, interrupt_at=3, ckpt_dir=tmp_path, **{size: 0})
    assert list(tmp_path.iterdir()) == []


def test_run_resume_demo_refuses_a_file_as_its_checkpoint_directory(tmp_path) -> None:
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("x")
    with pytest.raises(CheckpointError, match="not a directory"):
        run_resume_demo(total_steps=10, interrupt_at=3, ckpt_dir=not_a_dir)


def test_cli_demo_with_interrupt_at_the_end_fails_with_a_clear_message(tmp_path, capsys) -> None:
    rc = main(["demo", "--total-steps", "20", "--interrupt-at", "20", "--out", str(tmp_path)])
    err = capsys.readouterr().err
    assert rc == 2
    assert "error:" in err and "--interrupt-at=20" in err  # flags, not parameter names
    assert list(tmp_path.iterdir()) == []


def test_cli_demo_help_lists_its_options(capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["demo", "--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    for option in ("--total-steps", "--interrupt-at", "--num-shards", "--seed", "--out", "--ckpt-dir"):
        assert option in out


# --- the skill recipe --------------------------------------------------------------


def _rendered_constants() -> list[str]:
    payload_keys = list(
        checkpoint.build_payload(torch.nn.Module(), _tiny_opt(), None, checkpoint.TrainState())
    )
    return [
        *checkpoint.BUCKETS,
        *payload_keys,
        schema.CURRENT_SCHEMA,
        *schema.KNOWN_SCHEMAS,
        *schema.MIGRATIONS,
        *(fn.__name__ for fn in schema.MIGRATIONS.values()),
        *rng.RNG_SOURCES,
        atomic.TEMP_MARKER,
        integrity.FOOTER_MAGIC.decode(),
        shard_index.SHARDED_SCHEMA,
        shard_index.INDEX_NAME,
        shard_index.META_NAME,
        *shard_index.LAYOUTS,
        *errors.__all__,
    ]


def _tiny_opt() -> torch.optim.Optimizer:
    return torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)


def test_skill_markdown_contains_every_constant_it_documents() -> None:
    text = render_skill_markdown()
    # Backticked, so a bucket called "data" is not found by accident in prose.
    missing = [c for c in _rendered_constants() if f"`{c}" not in text]
    assert missing == []
    assert "weights_only=True" in text
    assert text.startswith("---\nname: checkpoint-save-resume\n")
    assert "# Checkpoint save and resume" in text


def test_skill_markdown_follows_a_changed_constant(monkeypatch) -> None:
    from ckpt_lesson.course import skill

    monkeypatch.setattr(skill, "RNG_SOURCES", (*rng.RNG_SOURCES, "jax_key"))
    monkeypatch.setattr(skill, "TEMP_MARKER", ".partial-")
    text = render_skill_markdown()
    assert "`jax_key`" in text and ".partial-" in text and ".tmp-" not in text


def test_skill_markdown_is_deterministic_and_leaves_global_rng_alone(tmp_path) -> None:
    torch.manual_seed(0)
    expected = torch.rand(2)
    torch.manual_seed(0)
    first = render_skill_markdown()
    assert torch.equal(torch.rand(2), expected)
    assert render_skill_markdown() == first
    path = write_skill_markdown(tmp_path / "skill.md")
    assert path.read_text(encoding="utf-8") == first
    assert "/tmp" not in first and 'digest": "<digest>' in first


def test_the_skill_recipe_shows_the_shuffled_dataloader_case_and_the_state_api() -> None:
    # issue 35: the recipe handed to "any new training script" covers the data position too.
    text = render_skill_markdown()
    own_loop = text[text.index("## 0. In your own training loop") : text.index("## 1.")]
    for needed in (
        "cl.resumable(train_loader)",
        "range(train_loader.epoch, epochs)",
        "restore_latest(state)",
    ):
        assert needed in own_loop
    assert "`consumed`, `epoch`" in own_loop and "no placeholder" in own_loop


def test_the_committed_skill_recipe_is_what_the_package_renders_now() -> None:
    committed = Path(__file__).resolve().parent.parent / "outputs" / "skill-checkpoint-save-resume.md"
    assert committed.read_text(encoding="utf-8") == render_skill_markdown(), (
        "outputs/skill-checkpoint-save-resume.md is stale: a constant it documents changed. "
        "Regenerate it with 'python -m ckpt_lesson demo'."
    )


def test_the_demo_writes_into_an_ignored_folder_by_default_not_over_the_committed_outputs() -> None:
    import subprocess

    from ckpt_lesson.course.demo import DEFAULT_OUT

    repo = Path(__file__).resolve().parent.parent
    assert DEFAULT_OUT == repo / "outputs" / "latest"
    if not (repo / ".git").exists():
        pytest.skip("not a git checkout: nothing to check the ignore rules with")
    for name in ARTIFACTS:
        ignored = subprocess.run(["git", "check-ignore", "-q", str(DEFAULT_OUT / name)], cwd=repo)
        assert ignored.returncode == 0, f"{DEFAULT_OUT / name} is not ignored by git"
