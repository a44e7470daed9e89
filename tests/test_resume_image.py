"""The machine image of ``--lose-machine``: the working folder as it was before the baseline."""

from __future__ import annotations

import pytest

from ckpt_lesson.errors import CheckpointError
from ckpt_lesson.resume_test import image
from ckpt_lesson.resume_test.image import install_image, take_image


def test_the_image_copies_code_and_inputs_keeps_links_and_leaves_out_the_workdir(tmp_path):
    project = tmp_path / "project"
    (project / "data").mkdir(parents=True)
    (project / "train.py").write_text("print(1)")
    (project / "data" / "x.bin").write_bytes(b"abc")
    (project / "link").symlink_to("train.py")
    workdir = project / "rt"  # --workdir inside the working folder
    workdir.mkdir()
    (workdir / "report.json").write_text("{}")
    copy = take_image(project, workdir / "machine-image", workdir=workdir)
    assert sorted(p.name for p in copy.iterdir()) == ["data", "link", "train.py"]
    assert (copy / "link").is_symlink() and (copy / "data" / "x.bin").read_bytes() == b"abc"
    machine = install_image(copy, tmp_path / "m" / "cwd")
    (machine / "train.py").write_text("changed on the new machine")
    assert (copy / "train.py").read_text() == "print(1)"  # the next machine gets the image again
    assert (project / "train.py").read_text() == "print(1)"


def test_a_working_folder_too_big_to_copy_for_every_restart_is_a_usage_error(tmp_path, monkeypatch):
    project = tmp_path / "project"
    project.mkdir()
    for n in range(5):
        (project / f"f{n}").write_text("x")
    monkeypatch.setattr(image, "IMAGE_MAX_FILES", 3)
    with pytest.raises(CheckpointError, match="run from a folder with only the code and its inputs"):
        take_image(project, tmp_path / "w" / "machine-image", workdir=tmp_path / "w")
    assert not (tmp_path / "w" / "machine-image").exists()
