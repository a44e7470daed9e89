"""Which files of a plain checkpoint folder are the checkpoint: --ckpt-glob, else checkpoint-like names."""

from __future__ import annotations

from ckpt_lesson.resume_test.names import NameFilter, looks_like_checkpoint


def test_checkpoint_like_names_include_temporary_suffixes_and_exclude_logs():
    assert [
        looks_like_checkpoint(n)
        for n in ("last.ckpt", "model.safetensors", "opt.pt.tmp", "x/pytorch_model.bin")
    ]
    assert not any(
        looks_like_checkpoint(n) for n in ("metrics.csv", "events.out", "ckpt/", "trainer_state.json")
    )


def test_without_globs_every_file_counts_until_a_checkpoint_like_one_appears():
    names = NameFilter()
    assert names.select({"metrics.csv"}) == {"metrics.csv"} and not names.active
    assert names.select({"metrics.csv", "epoch=0.ckpt"}) == {"epoch=0.ckpt"} and names.active
    assert names.select({"metrics.csv"}) == set()


def test_globs_match_the_relative_path_or_the_bare_name_and_nothing_else_counts():
    names = NameFilter(("state.json", "checkpoint-*/model.safetensors"))
    changed = {
        "state.json",
        "sub/state.json",
        "checkpoint-5/model.safetensors",
        "checkpoint-5/x.json",
        "last.ckpt",
    }
    assert names.select(changed) == {"state.json", "sub/state.json", "checkpoint-5/model.safetensors"}
    assert not names.is_checkpoint("checkpoint-5/")
