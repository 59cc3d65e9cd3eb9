"""Conversations: reading OpenAI ``messages`` JSONL with line numbers, validating it, splitting packed rows.

An input record is one JSON object per line (``docs/formats.md``)::

    {"messages": [{"role": "system"|"user"|"assistant"|"tool", "content": str | null, ...}, ...],
     "tools": [{"type": "function", "function": {"name": str, "description": str, "parameters": {...}}}]}

``content`` may be null or absent only on an assistant turn that carries ``tool_calls``. An assistant turn
may carry ``"weight": 0`` (context only, not trained) or ``1``. A ``system`` message may only come first. A
record may carry ``chat_template_kwargs`` (an object passed to ``apply_chat_template`` for it). A packed
row (``.jsonl.packed``) holds several conversations one after another, each starting with a ``system``
message that carries the conversation's ``tools`` and ``chat_template_kwargs``; :func:`split_row` cuts it
back into conversations.

Every error is a :class:`ConversationError` that names the file, the 1-based line and the field, e.g.
``data.jsonl:17: messages[2].role: unknown role 'bot' (expected one of system, user, assistant, tool)``.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROLES = ("system", "user", "assistant", "tool")


class ConversationError(ValueError):
    """A record that is not a valid conversation.

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


@dataclass(frozen=True)
class Conversation:
    """One validated conversation.

    Attributes:
        messages: the messages, each a dict with at least ``role`` and ``content``; the first one is
            ``system`` (added by :func:`parse_record` when the input has none).
        tools: OpenAI function schemas for this conversation, or ``None``.
        path: input file it came from.
        line: 1-based line number in ``path``.
        meta: the record's other keys.
        chat_template_kwargs: this conversation's ``apply_chat_template`` keyword arguments, or ``None``.
    """

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None
    path: str = ""
    line: int = 0
    meta: dict[str, Any] = field(default_factory=dict)
    chat_template_kwargs: dict[str, Any] | None = None

    def to_row_messages(self) -> list[dict[str, Any]]:
        """Messages as written into a packed row: ``tools`` and ``chat_template_kwargs`` ride on the system message.

        Returns:
            A new list of message dicts; the first is the system message.
        """
        msgs = [dict(m) for m in self.messages]
        if self.tools:
            msgs[0]["tools"] = self.tools
        if self.chat_template_kwargs:
            msgs[0]["chat_template_kwargs"] = self.chat_template_kwargs
        return msgs


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
        ConversationError: ``decode_error`` is set (not UTF-8), or the line is not valid JSON (the message
            and column of :mod:`json`'s error, its trailing newline removed so that an error at its end is
            on this line).
    """
    if decode_error:
        raise ConversationError(path, line, "", decode_error)
    try:
        value = loads_strict(text.rstrip("\r\n"))
    except NonFiniteNumber:
        field = _find_in(_TRACING_JSON.decode(text.rstrip("\r\n")), _is_constant)
        raise ConversationError(path, line, field or "", NON_FINITE) from None
    except DuplicateKey as e:
        raise ConversationError(path, line, _duplicate_field(text.rstrip("\r\n")) or e.key, str(e)) from None
    except json.JSONDecodeError as e:
        hint = ""
        if text.startswith("\ufeff"):
            hint = "; the line starts with a byte-order mark (U+FEFF), as where two files were concatenated"
        elif "\r" in text.rstrip("\r\n") and not e.msg.startswith("Invalid control character"):
            hint = "; the line holds a carriage return (\\r): a file with old Mac (CR-only) line ends reads as one line"
        raise ConversationError(path, line, "", f"not valid JSON: {e.msg} (column {e.colno}){hint}") from e
    except RecursionError as e:
        raise ConversationError(path, line, "", "not valid JSON: nested too deeply") from e
    except ValueError as e:   # an integer of more digits than int() converts (sys.set_int_max_str_digits)
        raise ConversationError(path, line, "", f"not valid JSON here: {e}") from e
    if "\\u" in text and _SURROGATE_ESCAPE.search(text):  # "\ud800" alone decodes to a str no UTF-8 can hold
        field = _find_in(value, _unencodable)
        if field is not None:
            raise ConversationError(path, line, field, "a \\u escape of a lone UTF-16 surrogate (D800-DFFF not in "
                                    "a high-low pair) is not text")
    return value


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
    value = float(text)
    if math.isinf(value):
        raise NonFiniteNumber(text)
    return value


def _refuse_constant(text: str):
    raise NonFiniteNumber(text)


_STRICT_JSON = json.JSONDecoder(parse_float=_finite_float, parse_constant=_refuse_constant,
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


def _fail(path: str | Path, line: int, field: str, reason: str) -> ConversationError:
    return ConversationError(path, line, field, reason)


def _check_tools(tools: Any, path: str | Path, line: int, prefix: str = "tools") -> None:
    if not isinstance(tools, list):
        raise _fail(path, line, prefix, f"must be a list of function schemas, got {json_type(tools)}")
    for i, tool in enumerate(tools):
        where = f"{prefix}[{i}]"
        if not isinstance(tool, dict):
            raise _fail(path, line, where, f"must be an object, got {json_type(tool)}")
        if tool.get("type", "function") != "function":
            raise _fail(path, line, f"{where}.type", f"only 'function' tools are supported, got {tool['type']!r}")
        fn = tool.get("function")
        if not isinstance(fn, dict):
            raise _fail(path, line, f"{where}.function", "must be an object with a 'name'")
        if not isinstance(fn.get("name"), str) or not fn["name"]:
            raise _fail(path, line, f"{where}.function.name", "must be a non-empty string")
        params = fn.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise _fail(path, line, f"{where}.function.parameters", "must be a JSON-schema object")


def _check_kwargs(kwargs: Any, path: str | Path, line: int, where: str) -> None:
    if not isinstance(kwargs, dict):
        raise _fail(path, line, where, f"must be an object of apply_chat_template keyword arguments, got "
                                       f"{json_type(kwargs)}")


def _check_tool_calls(calls: Any, path: str | Path, line: int, where: str) -> None:
    if not isinstance(calls, list) or not calls:
        raise _fail(path, line, where, "must be a non-empty list")
    for j, call in enumerate(calls):
        cw = f"{where}[{j}]"
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict):
            raise _fail(path, line, f"{cw}.function", "must be an object with 'name' and 'arguments'")
        if not isinstance(fn.get("name"), str) or not fn["name"]:
            raise _fail(path, line, f"{cw}.function.name", "must be a non-empty string")
        args = fn.get("arguments", {})
        if isinstance(args, str):
            try:
                args = loads_strict(args)
            except NonFiniteNumber:
                raise _fail(path, line, f"{cw}.function.arguments", f"is a string holding {NON_FINITE}") from None
            except json.JSONDecodeError as e:
                raise _fail(path, line, f"{cw}.function.arguments", f"is a string but not JSON ({e.msg})") from e
            except DuplicateKey as e:
                raise _fail(path, line, f"{cw}.function.arguments", f"is a string whose JSON has a {e}") from None
            except (ValueError, RecursionError) as e:  # nested too deeply, an integer of too many digits
                raise _fail(path, line, f"{cw}.function.arguments",
                            f"is a string but not JSON here ({e or 'nested too deeply'})") from e
        if not isinstance(args, dict):
            raise _fail(path, line, f"{cw}.function.arguments",
                        f"must be a JSON object or a string holding one, got {json_type(args)}")


def validate_messages(messages: Any, path: str | Path = "<input>", line: int = 0) -> None:
    """Check roles, contents, tool calls and ordering of one conversation's messages.

    Rules: roles are ``system``, ``user``, ``assistant``, ``tool``; ``content`` is a string, or null or absent
    only on an assistant turn with ``tool_calls`` (as OpenAI's chat format allows); ``weight`` is 0 or 1, on
    assistant turns only; ``system`` only as the first message; a ``tool`` message follows an assistant turn
    with ``tool_calls`` (or another ``tool`` message); at least one non-system message.

    Raises:
        ConversationError: naming ``path``, ``line`` and the field (``messages[i].role`` ...).
    """
    if not isinstance(messages, list):
        raise _fail(path, line, "messages", f"must be a list, got {json_type(messages)}")
    if not any(isinstance(m, dict) and m.get("role") != "system" for m in messages):
        raise _fail(path, line, "messages", "needs at least one user, assistant or tool message")
    previous = None
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise _fail(path, line, where, f"must be an object, got {json_type(m)}")
        role = m.get("role")
        if "role" not in m:
            raise _fail(path, line, f"{where}.role", f"missing (expected one of {', '.join(ROLES)})")
        if role not in ROLES:
            raise _fail(path, line, f"{where}.role", f"unknown role {role!r} (expected one of {', '.join(ROLES)})")
        content = m.get("content")
        has_calls = role == "assistant" and m.get("tool_calls") not in (None, [])
        if content is None:
            if not has_calls:
                raise _fail(path, line, f"{where}.content",
                            "is null; null content is allowed only on an assistant turn with tool_calls"
                            if "content" in m else
                            "missing; content may be left out only on an assistant turn with tool_calls")
        elif not isinstance(content, str):
            parts = isinstance(content, list)
            why = " (lists of content parts are not supported; join the text parts)" if parts else ""
            raise _fail(path, line, f"{where}.content", f"must be a string, got {json_type(content)}{why}")
        if "weight" in m:
            if role != "assistant":
                raise _fail(path, line, f"{where}.weight", f"only assistant turns may carry a weight, not {role}")
            if m["weight"] not in (0, 1) or isinstance(m["weight"], bool):
                raise _fail(path, line, f"{where}.weight", f"must be 0 or 1, got {m['weight']!r}")
        if has_calls:
            _check_tool_calls(m["tool_calls"], path, line, f"{where}.tool_calls")
        elif "tool_calls" in m and m["tool_calls"] not in (None, []):
            raise _fail(path, line, f"{where}.tool_calls", f"only assistant turns may carry tool_calls, not {role}")
        if role == "system" and i != 0:
            raise _fail(path, line, f"{where}.role",
                        "a system message may only come first (a later one would split the conversation)")
        if role == "tool" and previous not in ("tool_call", "tool"):
            raise _fail(path, line, f"{where}.role", "a tool message must follow an assistant turn with tool_calls")
        for key, check in (("tools", _check_tools), ("chat_template_kwargs", _check_kwargs)):
            if key not in m:
                continue
            if i != 0 or role != "system":  # a template reads neither from another message: it would be dropped
                raise _fail(path, line, f"{where}.{key}", f"only the record or its first (system) message may "
                                                         f"carry {key}, not {role} message {i}")
            check(m[key], path, line, f"{where}.{key}")
        previous = "tool_call" if has_calls else role


def parse_record(
    record: Any,
    path: str | Path = "<input>",
    line: int = 0,
    *,
    input_key: str | None = None,
    output_key: str | None = None,
    default_system_prompt: str = "",
) -> Conversation:
    """Turn one decoded JSON record into a validated :class:`Conversation`.

    Args:
        record: the decoded JSON value of one line.
        path, line: where it came from, for error messages.
        input_key, output_key: when both are given, the record is a prompt/response pair (NeMo RL's
            ``ResponseDataset``): ``record[input_key]`` becomes the user turn and ``record[output_key]``
            the assistant turn. Otherwise ``record["messages"]`` is used.
        default_system_prompt: content of the system message given to a conversation that has none
            (every conversation in a packed row starts with a system message, so rows split back into them).

    Returns:
        The conversation; its first message is ``system``. ``chat_template_kwargs`` (an object) becomes
        :attr:`Conversation.chat_template_kwargs`; keys other than ``messages``/``tools`` are kept in ``meta``.

    Raises:
        ConversationError: on any invalid field, naming ``path``, ``line`` and the field.
    """
    if not isinstance(record, dict):
        raise _fail(path, line, "", f"a record must be a JSON object, got {json_type(record)}")
    if input_key or output_key:
        if not (input_key and output_key):
            raise ValueError("input_key and output_key must be given together")
        for key in (input_key, output_key):
            if not isinstance(record.get(key), str):
                raise _fail(path, line, key, "missing or not a string")
        messages = [{"role": "user", "content": record[input_key]},
                    {"role": "assistant", "content": record[output_key]}]
        if record.get("system") is not None:
            if not isinstance(record["system"], str):
                raise _fail(path, line, "system", f"must be a string, got {json_type(record['system'])}")
            messages.insert(0, {"role": "system", "content": record["system"]})
    else:
        if "messages" not in record:
            raise _fail(path, line, "messages", "missing (or pass input/output keys for prompt/response records)")
        messages = record["messages"]
    validate_messages(messages, path, line)
    tools = record.get("tools")
    if tools is not None:
        _check_tools(tools, path, line)
    kwargs = record.get("chat_template_kwargs")
    if kwargs is not None:
        _check_kwargs(kwargs, path, line, "chat_template_kwargs")
    messages = [dict(m) for m in messages]
    if messages[0]["role"] != "system":
        messages.insert(0, {"role": "system", "content": default_system_prompt})
    else:
        if "tools" in messages[0]:
            if tools and messages[0]["tools"] and tools != messages[0]["tools"]:
                raise _fail(path, line, "messages[0].tools", "differs from the record's tools (one would be "
                            "lost): give the schemas once")
            tools = tools or messages[0]["tools"]
            del messages[0]["tools"]
        if "chat_template_kwargs" in messages[0]:
            kwargs = {**messages[0].pop("chat_template_kwargs"), **(kwargs or {})}
    meta = {k: v for k, v in record.items() if k not in ("messages", "tools")}
    return Conversation(messages=messages, tools=tools or None, path=str(path), line=line, meta=meta,
                        chat_template_kwargs=kwargs or None)


def split_row(messages: list[dict[str, Any]], path: str | Path = "<row>", line: int = 0, *,
              validate: bool = True) -> list[Conversation]:
    """Split a packed row's messages into conversations at each ``system`` message.

    Args:
        messages: the row's ``messages``; the first must be ``system``.
        path, line: the packed file and 1-based row line, for errors.
        validate: check every conversation (:func:`validate_messages`); ``False`` for a row already checked
            (the loader checks each row once, when it indexes the file).

    Returns:
        One :class:`Conversation` per system message, with its ``tools`` and ``chat_template_kwargs`` taken
        from that system message.

    Raises:
        ConversationError: when the row does not start with a system message or a conversation is invalid.
    """
    if not isinstance(messages, list) or not messages:
        raise _fail(path, line, "messages", "a packed row needs a non-empty messages list")
    if not isinstance(messages[0], dict) or messages[0].get("role") != "system":
        raise _fail(path, line, "messages[0].role", "a packed row must start with a system message")
    starts = [i for i, m in enumerate(messages) if isinstance(m, dict) and m.get("role") == "system"]
    conversations = []
    for k, (s, e) in enumerate(zip(starts, starts[1:] + [len(messages)])):
        msgs = [dict(m) for m in messages[s:e]]
        tools = msgs[0].pop("tools", None)
        kwargs = msgs[0].pop("chat_template_kwargs", None)
        if validate:
            try:
                validate_messages(msgs, path, line)
                if tools is not None:
                    _check_tools(tools, path, line, f"messages[{s}].tools")
                if kwargs is not None:
                    _check_kwargs(kwargs, path, line, f"messages[{s}].chat_template_kwargs")
            except ConversationError as err:
                raise _fail(path, line, f"conversation {k}: {err.field}", err.reason) from err
        conversations.append(Conversation(messages=msgs, tools=tools, path=str(path), line=line,
                                          chat_template_kwargs=kwargs))
    return conversations
