"""Reading JSONL input: lines with their numbers and sizes, standard JSON only, errors naming file, line and field.

:func:`iter_jsonl_lines_sized` streams a file's lines (blank ones skipped, a byte order mark at its start
dropped, an overlong line reported instead of read); :func:`loads_line` decodes one with :func:`loads_strict`,
which refuses what :mod:`json` reads but strict readers refuse (``NaN``, ``Infinity``, numbers beyond float
range), keys given twice in one object (JSON keeps only the last) and lone UTF-16 surrogate escapes, each
named by its field: ``data.jsonl:17: messages[1].content: duplicate key 'content' (...)``.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Generator, Iterator
from pathlib import Path
from typing import Any


class ConversationError(ValueError):
    """An input line that is not a valid record: not strict JSON here, not a valid conversation in
    :mod:`packsft.conversation`.

    Attributes:
        path: the input file.
        line: 1-based line number in ``path`` (0 when unknown).
        field: dotted path of the offending field (``messages[2].content``), or ``""`` for the whole line.
        reason: what is wrong, without the location.
    """

    def __init__(self, path: str | Path, line: int, field: str, reason: str):
        self.path, self.line, self.field, self.reason = str(path), line, field, reason
        where = f"{self.path}:{line}" if line else self.path
        super().__init__(f"{where}: {field + ': ' if field else ''}{reason}")


def iter_jsonl_lines(path: str | Path) -> Iterator[tuple[int, str | None, str | None]]:
    """Stream a JSONL file line by line without holding it in memory.

    Blank (whitespace-only) lines are skipped. CRLF line endings are accepted, and so is a UTF-8 byte order
    mark at the start of the file (skipped, as by Python's ``utf-8-sig`` codec; Windows tools write one).

    Args:
        path: the file.

    Yields:
        ``(line_number, text, error)``: 1-based line number; the decoded line, or ``None`` with ``error``
        set when the bytes are not valid UTF-8.

    Raises:
        FileNotFoundError: when ``path`` does not exist.
    """
    for number, _, text, error in iter_jsonl_lines_sized(path):
        yield number, text, error


def iter_jsonl_lines_sized(path: str | Path, max_bytes: int | None = None, _chunk: int = 1 << 20, *,
                           start: int = 0, end: int | None = None
                           ) -> Generator[tuple[int, int, str | None, str | None], None, int]:
    """Like :func:`iter_jsonl_lines`, with each line's size in bytes and an optional size limit.

    A line longer than ``max_bytes`` (newline excluded) is never held in memory whole: it is skipped in
    chunks of ``_chunk`` bytes and yielded with ``text=None`` and an ``error``. Blank lines are skipped, but
    their bytes are added to the next yielded line's size (so the sizes sum to the file size, for progress).

    Args:
        start, end: read only the lines that start in bytes ``[start, end)`` (``start`` at a line start);
            line numbers then count from ``start`` (1 = the line at ``start``).

    Yields:
        ``(line_number, nbytes, text, error)``.

    Returns:
        The number of lines read, blank ones included (the generator's return value).

    Raises:
        FileNotFoundError: when ``path`` does not exist.
    """
    pending = 0
    with open(path, "rb") as f:
        number = 0
        if start:
            f.seek(start)
        elif f.read(3) == b"\xef\xbb\xbf":  # a byte order mark: skipped, its bytes counted with line 1's
            pending = 3
        else:
            f.seek(0)
        pos = f.tell()
        while end is None or pos < end:
            raw = f.readline() if max_bytes is None else f.readline(max_bytes + 2)
            if not raw:
                break
            number += 1
            nbytes = len(raw)
            if max_bytes is None or len(raw.rstrip(b"\r\n")) <= max_bytes:
                pos += nbytes
            if max_bytes is not None and len(raw.rstrip(b"\r\n")) > max_bytes:
                tail = raw[-2:]  # the line's last bytes, across reads (a "\r\n" can be split between two)
                while not raw.endswith(b"\n"):
                    raw = f.readline(_chunk)
                    if not raw:
                        break
                    nbytes += len(raw)
                    tail = (tail + raw)[-2:]
                pos += nbytes
                ending = len(tail) - len(tail.rstrip(b"\r\n"))  # the line ending, not counted against the limit
                yield number, pending + nbytes, None, (f"line has {nbytes - ending} bytes, more than "
                                                       f"--max-conversation-bytes {max_bytes}; not tokenized")
                pending = 0
                continue
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                yield number, pending + nbytes, None, f"not valid UTF-8 ({e.reason} at byte {e.start})"
                pending = 0
                continue
            if text.strip():
                yield number, pending + nbytes, text, None
                pending = 0
            else:
                pending += nbytes
    return number


def loads_line(text: str | None, path: str | Path, line: int, decode_error: str | None = None) -> Any:
    """The JSON value of one input line, as :func:`iter_jsonl_lines` yields it (``text``, ``decode_error``).

    Raises:
        ConversationError: ``decode_error`` is set (not UTF-8), the line is not strict JSON (:func:`loads_strict`:
            :mod:`json`'s message and column, its trailing newline removed so that an error at its end is on this
            line; the field of a non-finite number or a duplicated key), or a string holds a lone surrogate.
    """
    if decode_error:
        raise ConversationError(path, line, "", decode_error)
    body = text.rstrip("\r\n")
    try:
        value = loads_strict(body)
    except (ValueError, RecursionError) as e:  # json.JSONDecodeError, NonFiniteNumber, DuplicateKey are ValueErrors
        raise ConversationError(path, line, *_not_json(text, body, e)) from e
    if "\\u" in text and _SURROGATE_ESCAPE.search(text):  # "\ud800" alone decodes to a str no UTF-8 can hold
        field = _find_in(value, _unencodable)
        if field is not None:
            raise ConversationError(path, line, field, "a \\u escape of a lone UTF-16 surrogate (D800-DFFF not in "
                                    "a high-low pair) is not text")
    return value


def _not_json(text: str, body: str, e: Exception) -> tuple[str, str]:
    """``(field, reason)`` of a line whose :func:`loads_strict` raised ``e`` (``body``: ``text`` less its line end)."""
    if isinstance(e, NonFiniteNumber):
        return _find_in(_TRACING_JSON.decode(body), _is_constant) or "", NON_FINITE
    if isinstance(e, DuplicateKey):
        return _duplicate_field(body) or e.key, str(e)
    if isinstance(e, json.JSONDecodeError):
        hint = ""
        if text.startswith("\ufeff"):
            hint = "; the line starts with a byte-order mark (U+FEFF), as where two files were concatenated"
        elif "\r" in body and not e.msg.startswith("Invalid control character"):
            hint = "; the line holds a carriage return (\\r): a file with old Mac (CR-only) line ends reads as one line"
        return "", f"not valid JSON: {e.msg} (column {e.colno}){hint}"
    if isinstance(e, RecursionError):
        return "", "not valid JSON: nested too deeply"
    return "", f"not valid JSON here: {e}"  # an integer of more digits than int() converts (sys.set_int_max_str_digits)


_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


class DuplicateKey(ValueError):
    """A JSON object holding one key twice: :mod:`json` keeps the last value, so the first would be lost unseen."""

    def __init__(self, key: str):
        super().__init__(f"duplicate key {key!r} (JSON keeps only its last value; the others would be lost)")
        self.key = key


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict:
    value = dict(pairs)
    if len(value) != len(pairs):
        seen = set()
        for key, _ in pairs:
            if key in seen:
                raise DuplicateKey(key)
            seen.add(key)
    return value


_DUPLICATE = object()
"""The value a duplicated key is decoded to by :func:`_duplicate_field`, to be found and named."""


def _mark_duplicates(pairs: list[tuple[str, Any]]) -> dict:
    try:
        return _unique_keys(pairs)
    except DuplicateKey as e:
        return {**dict(pairs), e.key: _DUPLICATE}


def _duplicate_field(text: str) -> str | None:
    """The field (``messages[1].content``) of the first duplicated key of ``text``, a line that holds one."""
    return _find_in(json.JSONDecoder(object_pairs_hook=_mark_duplicates).decode(text), lambda v: v is _DUPLICATE)


class NonFiniteNumber(ValueError):
    """JSON text holding ``NaN``, ``Infinity``, ``-Infinity`` or a number beyond float range (``1e999``)."""


NON_FINITE = ("NaN / Infinity, or a number beyond float range, is not JSON (Python's json reads it, strict readers "
              "refuse the rows): write a finite number or a string")


def _finite_float(text: str) -> float:
    """A JSON number's value (``parse_float``), or ``NaN`` / ``Infinity`` / ``-Infinity`` (``parse_constant``):
    :class:`NonFiniteNumber` unless finite."""
    value = float(text)
    if not math.isfinite(value):
        raise NonFiniteNumber(text)
    return value


_STRICT_JSON = json.JSONDecoder(parse_float=_finite_float, parse_constant=_finite_float,
                                object_pairs_hook=_unique_keys)


def loads_strict(text: str) -> Any:
    """``json.loads`` (the same C scanner) of standard JSON only, each key once per object.

    Raises:
        NonFiniteNumber: ``text`` holds ``NaN`` / ``Infinity`` (which :mod:`json` accepts) or a number that is
            infinite as a float.
        DuplicateKey: an object of ``text`` holds a key twice (:mod:`json` would keep the last value).
        json.JSONDecodeError, ValueError, RecursionError: as :func:`json.loads`.
    """
    return _STRICT_JSON.decode(text)


class _Constant(str):
    """A non-finite number of an input line, decoded as its text to be found and named."""


def _traced_float(text: str) -> float | _Constant:
    value = float(text)
    return _Constant(text) if math.isinf(value) else value


_TRACING_JSON = json.JSONDecoder(parse_float=_traced_float, parse_constant=_Constant)
"""Decodes non-finite numbers to :class:`_Constant`, to name the field of the first one."""


def _is_constant(value: Any) -> bool:
    return isinstance(value, _Constant)


def _unencodable(value: Any) -> bool:
    """A str that UTF-8 cannot encode (a lone surrogate)."""
    if not isinstance(value, str):
        return False
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def _find_in(value: Any, bad: Callable[[Any], bool]) -> str | None:
    """The field (``messages[1].content``; ``""`` for ``value`` itself) of the first key or value in ``value`` for
    which ``bad`` is true, else None; ``""`` too when ``value`` is nested too deeply to walk."""
    try:
        return _find(value, "", bad)
    except RecursionError:
        return ""


def _find(value: Any, where: str, bad: Callable[[Any], bool]) -> str | None:
    if bad(value):
        return where
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        bad_key = isinstance(key, str) and bad(key)
        if bad_key:
            key = key.encode("utf-8", "backslashreplace").decode("utf-8")  # named with its \\udXXX
        sub = f"{where}[{key}]" if isinstance(key, int) else f"{where}.{key}" if where else key
        if bad_key:
            return sub
        found = _find(item, sub, bad)
        if found is not None:
            return found
    return None


def json_type(value: Any) -> str:
    """JSON name of a decoded value's type (``null``, ``array``, ``object``, ...) for error messages."""
    names = {type(None): "null", list: "array", dict: "object", str: "string", bool: "boolean", int: "number",
             float: "number"}
    return names.get(type(value), type(value).__name__)
