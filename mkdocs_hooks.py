"""MkDocs hooks for the documentation site (named in mkdocs.yml)."""

from griffe._internal.docstrings import google
from griffe._internal.enumerations import DocstringSectionKind


def on_config(config):
    # The package's docstrings title their doctest blocks "Example:" (singular), which griffe's
    # Google parser reads as a generic admonition and renders as prose: `>>>` lines become
    # block quotes and `x["a"][0]` a broken reference link. Reading the singular as the plural
    # section renders them as code, without rewriting some 190 docstrings across the package.
    google._section_kind.setdefault("example", DocstringSectionKind.examples)
    return config
