"""A learner's function as stand-alone source: what it names comes along, or is reported missing.

A function typed in a notebook cell lives in ``__main__``; to run it in a child
process (lesson 02's kill) or in a later notebook (``course/carry.py``) it has to
be written out as source that runs on its own. :func:`function_source` starts
from the function's source and adds every global it reads, found from the
bytecode (``LOAD_GLOBAL``, not attribute names: ``type(exc).__name__`` must not
copy ``__name__ = '__main__'``) and from the ``def`` line (defaults,
annotations, decorators):

* modules become ``import x as name``; functions and classes from a package
  become ``from module import obj as name``;
* helper functions written beside it come as their source, and what they name too;
* values that print as Python (numbers, strings, tuples, lists, dicts, sets,
  ``Path``, ``torch.float32``...) and compiled regexes become ``name = <value>``;
* anything else (a tensor, an instance of the learner's class) comes as the
  learner's own statement that made it, found in the cell that defined the
  function or in IPython's input history, with what that statement names.

A global none of these can rebuild is listed in :attr:`KeptSource.missing`, so
the caller can say so in the learner's words instead of failing later.
"""

from __future__ import annotations

import ast
import dis
import inspect
import linecache
import re
import sys
import textwrap
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

__all__ = ["KeptSource", "function_source", "kept_source"]

# Values whose repr() reads back as the same value with no import at all.
_LITERAL = (str, bytes, int, float, complex, bool, type(None), tuple, list, dict, set, frozenset)
_MAX_VALUE_CHARS = 64 * 1024


@dataclass(frozen=True)
class KeptSource:
    """What :func:`kept_source` produced.

    Attributes:
        text: The source, in an order that runs top to bottom.
        missing: The names the function reads that could not be written out, each with
            the type of its value (``"CACHE (a Lock)"``); empty when nothing is missing.
    """

    text: str
    missing: tuple[str, ...]


def function_source(fn: Callable[..., Any]) -> str:
    """The source of ``fn`` plus everything it names, enough to run it in a fresh process.

    Args:
        fn: A function defined with ``def`` (in a notebook cell, a script or a module).

    Returns:
        Python source that defines ``fn`` under its own name, with its imports, helpers
        and constants before it.

    Raises:
        OSError or TypeError: ``fn``'s source cannot be found (a lambda typed at a prompt,
            a builtin).

    Example:
        >>> from ckpt_lesson.course.solutions import keep_last_k
        >>> "def keep_last_k(" in function_source(keep_last_k)
        True
    """
    return kept_source(fn).text


def kept_source(fn: Callable[..., Any]) -> KeptSource:
    """Like :func:`function_source`, and says which globals could not be kept.

    Args:
        fn: A function defined with ``def``.

    Returns:
        A :class:`KeptSource`.

    Raises:
        OSError or TypeError: ``fn``'s source cannot be found.

    Example:
        >>> from ckpt_lesson.course.solutions import keep_last_k
        >>> kept_source(keep_last_k).missing
        ()
    """
    out: list[str] = []  # dependencies first: a statement runs top to bottom
    missing: list[str] = []
    seen: set[str] = set()
    home = fn.__globals__

    def need(names: Iterator[str], namespace: dict[str, Any]) -> None:
        for name in names:
            if name in seen or name.startswith("__") or name not in namespace:
                continue  # a builtin, a dunder such as __name__, or a local
            seen.add(name)
            add(name, namespace[name], namespace)

    def add(name: str, obj: Any, namespace: dict[str, Any]) -> None:
        if isinstance(obj, types.ModuleType):
            out.append(f"import {obj.__name__} as {name}")
        elif isinstance(obj, types.FunctionType) and obj.__module__ in ("__main__", fn.__module__):
            source = textwrap.dedent(inspect.getsource(obj))
            need(_names_read(obj.__code__, source), obj.__globals__)
            out.append(source)
            if obj.__name__ != name:  # bound under another name: `capture = yours("capture_rng_state")`
                out.append(f"{name} = {obj.__name__}\n")
        elif (value := _value_text(obj, home)) is not None:
            out.append(f"{value[0]}{name} = {value[1]}")
        elif (
            getattr(obj, "__module__", None) not in (None, "__main__", fn.__module__)
            and isinstance(getattr(obj, "__name__", None), str)  # a class or function, not an instance
            and getattr(obj, "__qualname__", None) == obj.__name__
        ):
            out.append(f"from {obj.__module__} import {obj.__name__} as {name}")
        elif (statement := _defining_statement(name, fn, home)) is not None:
            need(_statement_names(statement), namespace)
            out.append(statement)
        else:
            missing.append(f"{name} (a {type(obj).__name__})")

    source = textwrap.dedent(inspect.getsource(fn))
    seen.add(fn.__name__)
    need(_names_read(fn.__code__, source), home)
    return KeptSource("\n".join([*out, "", source]), tuple(missing))


def _names_read(code: types.CodeType, source: str) -> Iterator[str]:
    """The globals ``code`` (and the functions nested in it) reads, then those of its ``def`` line."""
    for instruction in dis.get_instructions(code):
        if instruction.opname in ("LOAD_GLOBAL", "LOAD_NAME") and isinstance(instruction.argval, str):
            yield instruction.argval
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _names_read(const, "")
    if source:
        node = ast.parse(source).body[0]
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            args = node.args
            header: list[ast.AST] = [*node.decorator_list, *args.defaults, *filter(None, args.kw_defaults)]
            every = [*args.posonlyargs, *args.args, *args.kwonlyargs, args.vararg, args.kwarg]
            header += [a.annotation for a in every if a is not None and a.annotation is not None]
            header += [node.returns] if node.returns else []
            for part in header:
                yield from (n.id for n in ast.walk(part) if isinstance(n, ast.Name))


def _value_text(obj: Any, namespace: dict[str, Any]) -> tuple[str, str] | None:
    """The imports and the expression that rebuild ``obj``; ``None`` when its repr does not read back."""
    if isinstance(obj, re.Pattern):
        return "", f"__import__('re').compile({obj.pattern!r}, {obj.flags})"
    text = repr(obj)
    if len(text) > _MAX_VALUE_CHARS:
        return None  # the learner's own statement is shorter than its value
    if isinstance(obj, _LITERAL):
        try:
            same = ast.literal_eval(text)
        except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
            return None
        return ("", text) if type(same) is type(obj) and _equal(same, obj) else None
    kind = type(obj)  # Path('a') prints as PosixPath('a'), torch.float32 as itself
    root = str(kind.__module__).split(".")[0]
    if text.startswith("<") or root in ("__main__", "builtins") or root not in sys.modules:
        return None
    module = sys.modules[root]
    if namespace.get(kind.__name__, kind) is not kind or namespace.get(root, module) is not module:
        return None  # the imports below would hide one of the learner's own names
    try:
        same = eval(text, {"__builtins__": {}}, {kind.__name__: kind, root: module})  # noqa: S307
    except Exception:  # the repr is not Python: fall back to the learner's statement
        return None
    if type(same) is not kind or not _equal(same, obj):
        return None
    imports = f"import {root}\n"
    if re.search(rf"\b{re.escape(kind.__name__)}\b", text):
        imports += f"from {kind.__module__} import {kind.__name__}\n"
    return imports, text


def _equal(a: Any, b: Any) -> bool:
    try:
        return bool(a == b)
    except Exception:  # a tensor's == is elementwise and bool() of it may raise
        return False


def _defining_statement(name: str, fn: Callable[..., Any], namespace: dict[str, Any]) -> str | None:
    """The learner's last top-level statement that binds ``name``: in ``fn``'s cell, else in the history."""
    cells = ["".join(linecache.getlines(fn.__code__.co_filename))]
    history = namespace.get("_ih")  # IPython's list of every cell run so far, as Python
    if isinstance(history, list):
        cells += [cell for cell in reversed(history) if isinstance(cell, str)]
    for cell in cells:
        try:
            tree = ast.parse(cell)
        except (SyntaxError, ValueError):
            continue
        for node in reversed(tree.body):
            if name in _bound_by(node):
                return ast.get_source_segment(cell, node)
    return None


def _bound_by(node: ast.stmt) -> set[str]:
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return {node.name}
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        return {(a.asname or a.name).split(".")[0] for a in node.names}
    if isinstance(node, ast.Assign):
        return {n.id for t in node.targets for n in ast.walk(t) if isinstance(n, ast.Name)}
    if isinstance(node, ast.AnnAssign) and node.value is not None and isinstance(node.target, ast.Name):
        return {node.target.id}
    return set()


def _statement_names(statement: str) -> Iterator[str]:
    """The names a statement reads at top level (its functions' bodies run later, by themselves)."""
    code = compile(statement, "<statement>", "exec")
    for instruction in dis.get_instructions(code):
        if instruction.opname in ("LOAD_NAME", "LOAD_GLOBAL") and isinstance(instruction.argval, str):
            yield instruction.argval
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _names_read(const, "")
