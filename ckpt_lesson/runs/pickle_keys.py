"""Read a few top-level keys of a checkpoint's pickle the way ``torch.load`` would, executing nothing.

A scan must know a Lightning file's ``epoch`` and ``global_step`` without
unpickling it. Walking the opcodes (``pickletools.genops``) and taking the
first ``global_step`` seen has two flaws, both fixed here:

* **Wrong answers.** A pickle may set a key twice (``SETITEMS`` with the key
  repeated, or a later ``SETITEM``). ``torch.load`` builds a dict, so the
  *last* assignment wins; a reader that keeps the first one shows a step the
  file will never load as. So this module runs a tiny *abstract* pickle
  machine: the stack holds tags (this string, this int, the top-level dict,
  "something else") instead of objects, and ``SETITEM(S)`` on the top-level
  dict records keys in order, last one winning. Any opcode outside the small
  set ``torch.load``'s weights-only unpickler accepts ends the walk with
  "unknown": such a file does not load weights-only anyway.
* **Cost.** ``genops`` decodes every opcode in Python (about 0.66 s per MiB of
  ``data.pkl`` here), and a scan runs on every resume. Lightning writes
  ``epoch`` and ``global_step`` first, so the walk stops as soon as both are
  known *and* the rest of the bytes cannot assign them again: no later
  encoding of either key's name and no memo fetch of a memo slot holding one
  appears in them (a few ``bytes.find`` calls, C speed). When that cannot be
  ruled out, the walk goes on, up to a byte budget; past it the answer is
  "unknown" (the file then ranks below every file whose step is known).
* **Deep nesting.** Marks are kept on a stack of their own, as in CPython's
  unpickler, so every opcode costs constant time and the byte budget is a
  time budget too: a ``data.pkl`` of millions of nested ``MARK`` s (or
  millions of objects under one) is walked no slower than any other 4 MiB.
  Nothing here recurses.
"""

from __future__ import annotations

import pickletools
import struct
from typing import Any

__all__ = ["WALK_BUDGET_BYTES", "read_top_level_ints"]

#: The most pickle bytes walked opcode by opcode (about 2-3 s at worst); only hostile or unusual
#: files get this far, since Lightning's keys come first.
WALK_BUDGET_BYTES = 4 << 20

_OTHER = object()
_PUSH_OTHER = {"NONE", "NEWTRUE", "NEWFALSE", "BINFLOAT", "EMPTY_LIST", "EMPTY_TUPLE", "EMPTY_SET", "GLOBAL"}
_PUSH_OTHER |= {"BINBYTES", "SHORT_BINBYTES", "BINBYTES8", "FLOAT"}
_INTS = {"BININT", "BININT1", "BININT2", "LONG1", "LONG4", "INT", "LONG"}
_STRS = {"SHORT_BINUNICODE", "BINUNICODE", "BINUNICODE8", "UNICODE", "SHORT_BINSTRING", "BINSTRING", "STRING"}
_PUTS, _GETS = {"BINPUT", "LONG_BINPUT", "PUT"}, {"BINGET", "LONG_BINGET", "GET"}
_POP_N = {"TUPLE1": 1, "TUPLE2": 2, "TUPLE3": 3, "REDUCE": 2, "NEWOBJ": 2, "STACK_GLOBAL": 2, "BINPERSID": 1}


class _Unknown(Exception):
    """The pickle does something this reader (and the weights-only unpickler) does not follow."""


def read_top_level_ints(data: bytes, keys: tuple[str, ...]) -> dict[str, int | None]:
    """The values ``torch.load`` would give ``keys`` of the top-level dict in ``data``, if ints.

    Args:
        data: A ``data.pkl`` record's bytes (bounded by the caller).
        keys: Top-level keys wanted, e.g. ``("epoch", "global_step")``.

    Returns:
        Each key found, mapped to its int value or ``None`` (present but not a
        plain int). Keys not set are absent. Empty when the pickle is damaged,
        not a dict, uses opcodes outside the weights-only set, or would need
        more than :data:`WALK_BUDGET_BYTES` walked.

    Example:
        >>> import pickle
        >>> data = pickle.dumps({"epoch": 3, "global_step": 12}, protocol=2)
        >>> read_top_level_ints(data, ("epoch", "global_step"))
        {'epoch': 3, 'global_step': 12}
    """
    try:
        return _walk(data, keys)
    except (_Unknown, ValueError, IndexError, KeyError):
        return {}


def _walk(data: bytes, keys: tuple[str, ...]) -> dict[str, int | None]:
    # Marks live on their own stack of positions, as in CPython's unpickler: finding the last mark
    # is O(1), so deep nesting (millions of MARKs) costs what any other opcode costs, and a pop
    # through a mark is an error here as it is there. The top-level dict is the one object that
    # sits alone at the bottom of the stack; a dict made later in its place starts a fresh record.
    stack: list[Any] = []
    marks: list[int] = []
    memo: dict[int, Any] = {}
    top: Any = None
    found: dict[str, int | None] = {}
    checked_rest = False
    for op, arg, pos in pickletools.genops(data):
        if pos > WALK_BUDGET_BYTES:
            raise _Unknown
        name = op.name
        if name in ("PROTO", "FRAME"):
            continue
        if name == "STOP":
            if len(stack) != 1 or marks or stack[0] is not top:
                raise _Unknown
            return found
        if name == "MARK":
            marks.append(len(stack))
        elif name in ("EMPTY_DICT", "DICT"):
            items = _pop_to_mark(stack, marks) if name == "DICT" else []
            made = object()
            if not stack and not marks:
                top, found = made, {}
            stack.append(made)
            _assign(made, top, items, keys, found)
        elif name in _INTS:
            stack.append(("i", arg) if type(arg) is int else _OTHER)
        elif name in _STRS:
            stack.append(("s", arg) if isinstance(arg, str) else _OTHER)
        elif name in _PUSH_OTHER:
            stack.append(_OTHER)
        elif name in _PUTS:
            memo[arg] = _peek(stack, marks)
        elif name == "MEMOIZE":
            memo[len(memo)] = _peek(stack, marks)
        elif name in _GETS:
            stack.append(memo[arg])
        elif name in _POP_N:
            _pop(stack, marks, _POP_N[name])
            stack.append(_OTHER)
        elif name in ("TUPLE", "LIST"):
            _pop_to_mark(stack, marks)
            stack.append(_OTHER)
        elif name in ("APPEND", "BUILD"):
            _pop(stack, marks, 1)
            _peek(stack, marks)
        elif name == "APPENDS":
            _pop_to_mark(stack, marks)
            _peek(stack, marks)
        elif name == "SETITEM":
            items = _pop(stack, marks, 2)
            _assign(_peek(stack, marks), top, items, keys, found)
        elif name == "SETITEMS":
            items = _pop_to_mark(stack, marks)
            _assign(_peek(stack, marks), top, items, keys, found)
        else:
            raise _Unknown(name)
        _note_pending_pair(stack, marks, top, keys, found)
        if not checked_rest and len(found) == len(keys):
            checked_rest = True
            if not _could_assign_again(data[pos + 1 :], keys, memo):
                return found
    raise _Unknown("no STOP")


def _note_pending_pair(
    stack: list[Any], marks: list[int], top: Any, keys: tuple[str, ...], found: dict[str, int | None]
) -> None:
    # torch.save puts a dict's items in batches: MARK, key, value, key, value..., SETITEMS. The
    # assignment happens at SETITEMS, after everything else in the batch (the whole state_dict),
    # so waiting for it would walk the whole file. A key and its value pushed as a pair right
    # above the top-level dict's MARK will be assigned by that SETITEMS: note it now, as the
    # SETITEMS would (the early-stop check guarantees nothing later can push the key again).
    if len(stack) < 3 or not isinstance(stack[-2], tuple) or stack[-2][0] != "s" or stack[-2][1] not in keys:
        return
    if marks != [1] or stack[0] is not top or (len(stack) - 1) % 2:
        return
    value = stack[-1]
    found[stack[-2][1]] = value[1] if isinstance(value, tuple) and value[0] == "i" else None


def _peek(stack: list[Any], marks: list[int]) -> Any:
    if len(stack) <= (marks[-1] if marks else 0):
        raise _Unknown("nothing above the mark")
    return stack[-1]


def _pop(stack: list[Any], marks: list[int], n: int) -> list[Any]:
    at = len(stack) - n
    if at < (marks[-1] if marks else 0):
        raise _Unknown("stack underflow")
    items = stack[at:]
    del stack[at:]
    return items


def _pop_to_mark(stack: list[Any], marks: list[int]) -> list[Any]:
    if not marks:
        raise _Unknown("no mark")
    at = marks.pop()
    items = stack[at:]
    del stack[at:]
    return items


def _assign(
    target: Any, top: Any, items: list[Any], keys: tuple[str, ...], found: dict[str, int | None]
) -> None:
    if len(items) % 2:  # the unpickler refuses an odd count for DICT and SETITEMS
        raise _Unknown("odd number of items")
    if target is not top:
        return
    for key, value in zip(items[0::2], items[1::2], strict=True):
        if isinstance(key, tuple) and key[0] == "s" and key[1] in keys:
            found[key[1]] = value[1] if isinstance(value, tuple) and value[0] == "i" else None


def _could_assign_again(rest: bytes, keys: tuple[str, ...], memo: dict[int, Any]) -> bool:
    """Whether ``rest`` could push one of ``keys`` as a string again (conservative: may say yes wrongly)."""
    if any(escape in rest for escape in (b"\\u", b"\\U", b"\\x")):  # UNICODE/STRING ops may escape
        return True
    for key in keys:
        raw = key.encode("utf-8")
        spellings = [
            b"X" + struct.pack("<I", len(raw)) + raw,
            b"\x8d" + struct.pack("<Q", len(raw)) + raw,
            b"T" + struct.pack("<i", len(raw)) + raw,
            b"V" + raw + b"\n",
            b"S'" + raw,
            b'S"' + raw,
        ]
        if len(raw) < 256:
            spellings += [b"\x8c" + bytes([len(raw)]) + raw, b"U" + bytes([len(raw)]) + raw]
        if any(s in rest for s in spellings):
            return True
    for index, tag in memo.items():
        if isinstance(tag, tuple) and tag[0] == "s" and tag[1] in keys:
            fetches = [b"j" + struct.pack("<I", index), b"g%d\n" % index]
            if index < 256:
                fetches.append(b"h" + bytes([index]))
            if any(f in rest for f in fetches):
                return True
    return False
