"""The documentation site covers the package: every public name has an API entry, every entry
points at the object the package exports, and every result file a page cites exists.

The site itself is built by ``python -m mkdocs build --strict`` in ``.ci/run`` (broken links,
pages missing from the nav and docstrings griffe cannot parse fail there); these tests catch the
drift a build cannot see: a new public name nobody documented, or a benchmark file renamed.
"""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

import ckpt_lesson

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
# An mkdocstrings entry is a line of its own: `::: dotted.path`, optionally followed by options.
ENTRY = re.compile(r"^:::\s+(\S+)\s*$", re.MULTILINE)
# Paths the guide names in code formatting, e.g. `benchmarks/results/hf-20261201.md`.
CITED = re.compile(r"`((?:benchmarks|outputs)/[^`\s]+)`")


def api_entries() -> dict[str, list[str]]:
    """Map each documented name (an entry's last component) to the dotted paths naming it."""
    entries: dict[str, list[str]] = {}
    for page in sorted((DOCS / "api").glob("*.md")):
        for dotted in ENTRY.findall(page.read_text(encoding="utf-8")):
            entries.setdefault(dotted.rsplit(".", 1)[-1], []).append(dotted)
    return entries


def resolve(dotted: str) -> object:
    """Import ``pkg.module.Name`` as mkdocstrings reads it: the longest importable module, then attributes."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        for attr in parts[cut:]:
            obj = getattr(obj, attr)
        return obj
    raise ModuleNotFoundError(dotted)


def test_every_public_name_has_an_api_reference_entry():
    documented = api_entries()
    missing = [name for name in ckpt_lesson.__all__ if name not in documented]
    assert missing == [], f"add a `::: ckpt_lesson.<module>.<name>` line to a docs/api page for: {missing}"


@pytest.mark.parametrize("name", ckpt_lesson.__all__)
def test_each_api_entry_points_at_the_object_the_package_exports(name):
    for dotted in api_entries().get(name, []):
        assert resolve(dotted) is getattr(ckpt_lesson, name), f"{dotted} is not ckpt_lesson.{name}"


def test_no_public_name_is_documented_twice():
    entries = api_entries()
    twice = {name: entries[name] for name in ckpt_lesson.__all__ if len(entries.get(name, [])) > 1}
    assert twice == {}


def test_every_result_file_the_guide_cites_exists():
    cited = {
        (page.relative_to(ROOT).as_posix(), path)
        for page in sorted(DOCS.glob("*.md"))
        for path in CITED.findall(page.read_text(encoding="utf-8"))
    }
    assert cited, "the guide names no benchmark or output file at all: the pattern is stale"
    missing = sorted((page, path) for page, path in cited if not (ROOT / path.rstrip("/")).exists())
    assert missing == []


def test_every_guide_page_that_quotes_a_measurement_names_its_source():
    # A figure like "0.80x" or "1.34x" is a measured ratio; the page must say where it came from.
    for page in sorted(DOCS.glob("*.md")):
        text = page.read_text(encoding="utf-8")
        if re.search(r"\b\d+\.\d+x\b", text):
            assert CITED.search(text), f"{page.name} quotes a measured ratio but names no result file"
