"""Conversations: validating OpenAI ``messages`` records (line numbers in every error), splitting packed rows.

An input record is one JSON object per line (``docs/formats.md``)::

    {"messages": [{"role": "system"|"user"|"assistant"|"tool", "content": str | null, ...}, ...],
     "tools": [{"type": "function", "function": {"name": str, "description": str, "parameters": {...}}}]}

``content`` may be null or absent only on an assistant turn that carries ``tool_calls``. An assistant turn
may carry ``"weight": 0`` (context only, not trained) or ``1``. A ``system`` message may only come first. A
record may carry ``chat_template_kwargs`` (an object passed to ``apply_chat_template`` for it). A packed
row (``.jsonl.packed``) holds several conversations one after another, each starting with a ``system``
message that carries the conversation's ``tools`` and ``chat_template_kwargs``; :func:`split_row` cuts it
back into conversations.

Every error is a :class:`~packsft.jsonl.ConversationError` that names the file, the 1-based line and the field,
e.g. ``data.jsonl:17: messages[2].role: unknown role 'bot' (expected one of system, user, assistant, tool)``.
Reading the lines and their strict JSON: :mod:`packsft.jsonl`.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from packsft.jsonl import NON_FINITE, ConversationError, DuplicateKey, NonFiniteNumber, json_type, loads_strict

ROLES = ("system", "user", "assistant", "tool")


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


Rule = tuple[str, Callable[[Any], bool], Any]
"""A field check: ``(field, the value passes, reason)``; ``reason`` is text or a function of the value."""


def _first_failed(value: Any, rules: tuple[Rule, ...]) -> tuple[str, str] | None:
    """``(field, reason)`` of the first of ``rules`` (in order: a later one may assume the earlier) ``value`` fails."""
    for where, ok, reason in rules:
        if not ok(value):
            return where, reason if isinstance(reason, str) else reason(value)
    return None


def _name_ok(fn: dict) -> bool:
    return isinstance(fn.get("name"), str) and bool(fn["name"])


_TOOL_RULES: tuple[Rule, ...] = (
    ("", lambda t: isinstance(t, dict), lambda t: f"must be an object, got {json_type(t)}"),
    (".type", lambda t: t.get("type", "function") == "function",
     lambda t: f"only 'function' tools are supported, got {t['type']!r}"),
    (".function", lambda t: isinstance(t.get("function"), dict), "must be an object with a 'name'"),
    (".function.name", lambda t: _name_ok(t["function"]), "must be a non-empty string"),
    (".function.parameters", lambda t: isinstance(t["function"].get("parameters", {}), (dict, type(None))),
     "must be a JSON-schema object"),
)
"""What each entry of ``tools`` must be (an OpenAI function schema)."""

_TOOL_CALL_RULES: tuple[Rule, ...] = (
    (".function", lambda c: isinstance(c, dict) and isinstance(c.get("function"), dict),
     "must be an object with 'name' and 'arguments'"),
    (".function.name", lambda c: _name_ok(c["function"]), "must be a non-empty string"),
)
"""What each entry of an assistant turn's ``tool_calls`` must be (its ``arguments``: :func:`_check_tool_calls`)."""


def _check_tools(tools: Any, path: str | Path, line: int, prefix: str = "tools") -> None:
    if not isinstance(tools, list):
        raise ConversationError(path, line, prefix, f"must be a list of function schemas, got {json_type(tools)}")
    for i, tool in enumerate(tools):
        failed = _first_failed(tool, _TOOL_RULES)
        if failed:
            raise ConversationError(path, line, f"{prefix}[{i}]{failed[0]}", failed[1])


def _check_kwargs(kwargs: Any, path: str | Path, line: int, where: str) -> None:
    if not isinstance(kwargs, dict):
        raise ConversationError(path, line, where, f"must be an object of apply_chat_template keyword arguments, "
                                                   f"got {json_type(kwargs)}")


def _check_weight(weight: Any, path: str | Path, line: int, where: str) -> None:
    if weight not in (0, 1) or isinstance(weight, bool):
        raise ConversationError(path, line, where, f"must be 0 or 1, got {weight!r}")


def _arguments_error(e: Exception) -> str:
    """Why a tool call's ``arguments`` string is not what :func:`loads_strict` reads (it raised ``e``)."""
    if isinstance(e, NonFiniteNumber):
        return f"is a string holding {NON_FINITE}"
    if isinstance(e, json.JSONDecodeError):
        return f"is a string but not JSON ({e.msg})"
    if isinstance(e, DuplicateKey):
        return f"is a string whose JSON has a {e}"
    return f"is a string but not JSON here ({e or 'nested too deeply'})"  # nested too deeply, too many digits


def _check_tool_calls(calls: Any, path: str | Path, line: int, where: str) -> None:
    if not isinstance(calls, list) or not calls:
        raise ConversationError(path, line, where, "must be a non-empty list")
    for j, call in enumerate(calls):
        cw = f"{where}[{j}]"
        failed = _first_failed(call, _TOOL_CALL_RULES)
        if failed:
            raise ConversationError(path, line, cw + failed[0], failed[1])
        args = call["function"].get("arguments", {})
        if isinstance(args, str):
            try:
                args = loads_strict(args)
            except (ValueError, RecursionError) as e:
                raise ConversationError(path, line, f"{cw}.function.arguments", _arguments_error(e)) from e
        if not isinstance(args, dict):
            raise ConversationError(path, line, f"{cw}.function.arguments",
                                    f"must be a JSON object or a string holding one, got {json_type(args)}")


def _first_system(i: int, role: str) -> bool:
    return i == 0 and role == "system"


def _assistant(i: int, role: str) -> bool:
    return role == "assistant"


_CARRIED = {
    "weight": ((), _assistant, "only assistant turns may carry a weight, not {role}", _check_weight),
    "tool_calls": ((None, []), _assistant, "only assistant turns may carry tool_calls, not {role}", _check_tool_calls),
    # a template reads neither from another message: it would be dropped
    "tools": ((), _first_system, "only the record or its first (system) message may carry tools, not {role} "
                                 "message {i}", _check_tools),
    "chat_template_kwargs": ((), _first_system, "only the record or its first (system) message may carry "
                                                "chat_template_kwargs, not {role} message {i}", _check_kwargs),
}
"""The optional keys of a message: ``key: (values that count as absent, which message i of a role may carry it,
reason when another does, the check of its value)``."""


def validate_messages(messages: Any, path: str | Path = "<input>", line: int = 0) -> None:
    """Check roles, contents, tool calls and ordering of one conversation's messages.

    Rules: roles are ``system``, ``user``, ``assistant``, ``tool``; ``content`` is a string, or null or absent
    only on an assistant turn with ``tool_calls`` (as OpenAI's chat format allows); the optional keys
    (``weight``: 0 or 1, ``tool_calls``, ``tools``, ``chat_template_kwargs``) only on the messages
    :data:`_CARRIED` allows; ``system`` only as the first message; a ``tool`` message follows an assistant turn
    with ``tool_calls`` (or another ``tool`` message); at least one non-system message.

    Raises:
        ConversationError: naming ``path``, ``line`` and the field (``messages[i].role`` ...).
    """
    if not isinstance(messages, list):
        raise ConversationError(path, line, "messages", f"must be a list, got {json_type(messages)}")
    if not any(isinstance(m, dict) and m.get("role") != "system" for m in messages):
        raise ConversationError(path, line, "messages", "needs at least one user, assistant or tool message")
    previous = None
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise ConversationError(path, line, where, f"must be an object, got {json_type(m)}")
        role = m.get("role")
        if role not in ROLES:
            what = f"unknown role {role!r}" if "role" in m else "missing"
            raise ConversationError(path, line, f"{where}.role", f"{what} (expected one of {', '.join(ROLES)})")
        content = m.get("content")
        has_calls = role == "assistant" and m.get("tool_calls") not in (None, [])
        if content is None and not has_calls:
            raise ConversationError(path, line, f"{where}.content",
                                    "is null; null content is allowed only on an assistant turn with tool_calls"
                                    if "content" in m else
                                    "missing; content may be left out only on an assistant turn with tool_calls")
        if content is not None and not isinstance(content, str):
            parts = isinstance(content, list)
            why = " (lists of content parts are not supported; join the text parts)" if parts else ""
            raise ConversationError(path, line, f"{where}.content", f"must be a string, got {json_type(content)}{why}")
        for key, (absent, may, reason, check) in _CARRIED.items():
            if key not in m or m[key] in absent:
                continue
            if not may(i, role):
                raise ConversationError(path, line, f"{where}.{key}", reason.format(role=role, i=i))
            check(m[key], path, line, f"{where}.{key}")
        if role == "system" and i != 0:
            raise ConversationError(path, line, f"{where}.role",
                                    "a system message may only come first (a later one would split the conversation)")
        if role == "tool" and previous not in ("tool_call", "tool"):
            raise ConversationError(path, line, f"{where}.role",
                                    "a tool message must follow an assistant turn with tool_calls")
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
        input_key, output_key: both or neither (``PackConfig`` checks); when given, the record is a prompt/response
            pair (NeMo RL's ``ResponseDataset``): ``record[input_key]`` becomes the user turn and
            ``record[output_key]`` the assistant turn. Otherwise ``record["messages"]`` is used.
        default_system_prompt: content of the system message given to a conversation that has none
            (every conversation in a packed row starts with a system message, so rows split back into them).

    Returns:
        The conversation; its first message is ``system``. ``chat_template_kwargs`` (an object) becomes
        :attr:`Conversation.chat_template_kwargs`; keys other than ``messages``/``tools`` are kept in ``meta``.

    Raises:
        ConversationError: on any invalid field, naming ``path``, ``line`` and the field.
    """
    if not isinstance(record, dict):
        raise ConversationError(path, line, "", f"a record must be a JSON object, got {json_type(record)}")
    if input_key:
        missing = next((key for key in (input_key, output_key) if not isinstance(record.get(key), str)), None)
        if missing is not None:
            raise ConversationError(path, line, missing, "missing or not a string")
        messages = [{"role": "user", "content": record[input_key]},
                    {"role": "assistant", "content": record[output_key]}]
        if record.get("system") is not None:
            if not isinstance(record["system"], str):
                raise ConversationError(path, line, "system", f"must be a string, got {json_type(record['system'])}")
            messages.insert(0, {"role": "system", "content": record["system"]})
    else:
        if "messages" not in record:
            raise ConversationError(path, line, "messages",
                                    "missing (or pass input/output keys for prompt/response records)")
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
                raise ConversationError(path, line, "messages[0].tools", "differs from the record's tools (one would "
                                        "be lost): give the schemas once")
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
        raise ConversationError(path, line, "messages", "a packed row needs a non-empty messages list")
    if not isinstance(messages[0], dict) or messages[0].get("role") != "system":
        raise ConversationError(path, line, "messages[0].role", "a packed row must start with a system message")
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
                raise ConversationError(path, line, f"conversation {k}: {err.field}", err.reason) from err
        conversations.append(Conversation(messages=msgs, tools=tools, path=str(path), line=line,
                                          chat_template_kwargs=kwargs))
    return conversations
