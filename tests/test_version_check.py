"""torch releases before 2.6 are refused: their weights-only loader can be bypassed."""

from __future__ import annotations

import pytest

from ckpt_lesson._version_check import check_torch_version


@pytest.mark.parametrize("old", ["2.5.1", "2.5.1+cu121", "1.13.0", "2.0.0"])
def test_torch_before_2_6_is_refused_naming_the_cve(old):
    with pytest.raises(ImportError, match="CVE-2025-32434") as info:
        check_torch_version(old)
    assert old in str(info.value)


@pytest.mark.parametrize("new", ["2.6.0", "2.6.0+cpu", "2.10.1", "2.13.0.dev20260101", "3.0"])
def test_torch_2_6_and_later_passes_even_when_minor_has_two_digits(new):
    check_torch_version(new)


def test_an_unparseable_version_is_refused_rather_than_guessed():
    with pytest.raises(ImportError, match="cannot parse"):
        check_torch_version("nightly")


def test_the_installed_torch_passes():
    check_torch_version()
