"""One short line for the ``repr`` of every public result type.

A dataclass's own ``repr`` prints every field in full. A :class:`Restored`
holds the saved RNG state (Python's Mersenne Twister alone is 625 integers), so
printing one in a notebook or a log took about 15,000 characters; a
``TrainState`` after a long run prints every loss. Here each field is
summarized instead: numbers and short strings as they are, a tensor as its
shape and dtype, a large container as its size, a long string as its head and
tail (paths end in what matters). Fields still at their default are left out,
and the whole line is kept under :data:`MAX_CHARS`.

A class opts in with ``__repr__ = short_repr`` in its body (``@dataclass``
keeps a ``__repr__`` the class defines itself).
"""

from __future__ import annotations

import dataclasses
import enum
import os
from typing import Any

import torch

__all__ = ["MAX_CHARS", "short_repr"]

#: The longest line :func:`short_repr` returns.
MAX_CHARS = 160
_INLINE = 64  # a value longer than this is summarized
_STRING = 40  # a string longer than this keeps its head and tail


def short_repr(obj: Any) -> str:
    """``Name(field=value, ...)`` for a dataclass instance, on one line under :data:`MAX_CHARS`.

    Args:
        obj: A dataclass instance.

    Returns:
        The class name and its non-default fields, each summarized; fields that
        do not fit are replaced by ``...``.

    Example:
        >>> from dataclasses import dataclass, field
        >>> @dataclass
        ... class Result:
        ...     step: int
        ...     rng: dict = field(default_factory=dict)
        ...     note: str = ""
        ...     __repr__ = short_repr
        >>> Result(3, {"torch": torch.zeros(5056, dtype=torch.uint8), "python": list(range(625))})
        Result(step=3, rng={'torch': <tensor (5056,) uint8>, 'python': <list of 625>})
        >>> Result(4, {str(i): i for i in range(624)}, note="a" * 200)
        Result(step=4, rng=<dict of 624>, note='aaaaaaaaaaaaaaaaaaaa...aaaaaaaaaaaaaaaaaaaa')
    """
    name = type(obj).__name__
    parts = []
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name, None)
        if f.repr and not _is_default(f, value):
            parts.append(f"{f.name}={_summary(value)}")
    kept: list[str] = []
    for i, part in enumerate(parts):
        rest = ", ..." if i < len(parts) - 1 else ""
        if len(name) + 2 + len(", ".join([*kept, part])) + len(rest) > MAX_CHARS:
            kept.append("...")
            break
        kept.append(part)
    return f"{name}({', '.join(kept)})"


def _is_default(f: dataclasses.Field, value: Any) -> bool:
    if f.default is not dataclasses.MISSING:
        default = f.default
    elif f.default_factory is not dataclasses.MISSING:
        default = f.default_factory()
    else:
        return False
    try:
        return type(value) is type(default) and bool(value == default)
    except Exception:  # a tensor compares element-wise: never a default here
        return False


def _summary(value: Any) -> str:
    """One value in at most about ``_INLINE`` characters, never a newline."""
    if isinstance(value, torch.Tensor):
        return f"<tensor {tuple(value.shape)} {str(value.dtype).removeprefix('torch.')}>"
    if isinstance(value, enum.Enum):
        return f"{type(value).__name__}.{value.name}"
    if value is None or isinstance(value, (bool, int, float, complex)):
        return repr(value)
    if isinstance(value, os.PathLike):
        value = os.fspath(value)
    if isinstance(value, (str, bytes)):
        if len(value) > _STRING:  # the head says what it is, the tail which one (a path's step folder)
            half = _STRING // 2
            value = value[:half] + ("..." if isinstance(value, str) else b"...") + value[-half:]
        return repr(value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        inline = short_repr(value)
        return inline if len(inline) <= _INLINE else f"<{type(value).__name__}>"
    if isinstance(value, dict):
        if len(value) <= 8:
            inline = "{" + ", ".join(f"{_summary(k)}: {_summary(v)}" for k, v in value.items()) + "}"
            if len(inline) <= _INLINE:
                return inline
        return f"<dict of {len(value)}>"
    if type(value) in _BRACKETS:
        if len(value) <= 8:
            open_, close = _BRACKETS[type(value)]
            items = [_summary(v) for v in value]
            inline = (
                open_ + ", ".join(items) + ("," if type(value) is tuple and len(items) == 1 else "") + close
            )
            if len(inline) <= _INLINE and (value or type(value) is not set):
                return inline
        return f"<{type(value).__name__} of {len(value)}>"
    return f"<{type(value).__name__}>"


_BRACKETS = {list: ("[", "]"), tuple: ("(", ")"), set: ("{", "}")}
