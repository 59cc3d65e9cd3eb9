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

import functools
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

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


class Each(NamedTuple):
    """A rule on a list: every item passes ``rules`` (its field: ``[i]``, then the failed rule's own)."""

    rules: tuple


def first_failed(value: Any, rules: tuple) -> tuple[str, str] | None:
    """``(field, reason)`` of the first of ``rules`` (in order: a later one may assume the earlier) ``value`` fails."""
    for rule in rules:
        if isinstance(rule, Each):
            for i, item in enumerate(value):
                failed = first_failed(item, rule.rules)
                if failed:
                    return f"[{i}]{failed[0]}", failed[1]
        elif not rule[1](value):
            return rule[0], rule[2] if isinstance(rule[2], str) else rule[2](value)
    return None


def check_value(value: Any, rules: tuple, path: str | Path, line: int, where: str) -> None:
    """Raise :class:`~packsft.jsonl.ConversationError` naming ``where`` and the field of the first of ``rules``
    (:data:`Rule` or :class:`Each`) that ``value`` fails."""
    failed = first_failed(value, rules)
    if failed:
        raise ConversationError(path, line, where + failed[0], failed[1])


RECORD_OBJECT: Rule = ("", lambda r: isinstance(r, dict),
                      lambda r: f"a record must be a JSON object, got {json_type(r)}")
"""The first rule of every record format: a line holding ``[1, 2]`` is not a record."""


def text_rule(key: str, note: str = "") -> Rule:
    """The rule: ``record[key]`` is a string (``note`` ends the reason, e.g. ``" (Alpaca records)"``)."""
    return key, lambda r: isinstance(r.get(key), str), f"missing or not a string{note}"


def optional_text_rule(key: str, note: str = "") -> Rule:
    """The rule: ``record[key]`` is a string, absent or null (any other value would be left out unseen)."""
    return (key, lambda r: isinstance(r.get(key), (str, type(None))),
            lambda r: f"must be a string, got {json_type(r[key])}{note}")


_MESSAGES_RECORD_RULES = (
    RECORD_OBJECT,
    ("messages", lambda r: "messages" in r, "missing (records of another shape: set their format, or an adapter)"),
)
"""What a ``messages`` record must be before its messages are checked (:func:`validate_messages`)."""


@functools.lru_cache(maxsize=8)
def _pair_record_rules(input_key: str, output_key: str) -> tuple[Rule, ...]:
    """What a prompt/response record must be: both keys strings, an optional ``system`` string."""
    return RECORD_OBJECT, text_rule(input_key), text_rule(output_key), optional_text_rule("system")


_ROW_RULES = (
    ("", lambda v: isinstance(v, list) and bool(v), "a packed row needs a non-empty messages list"),
    ("[0].role", lambda v: isinstance(v[0], dict) and v[0].get("role") == "system",
     "a packed row must start with a system message"),
)
"""What a packed row's ``messages`` must be before :func:`split_row` cuts it at its system messages."""


def _name_ok(fn: dict) -> bool:
    return isinstance(fn.get("name"), str) and bool(fn["name"])


def _arguments_problem(call: dict) -> str | None:
    """Why a tool call's ``function.arguments`` is neither an object nor a string :func:`loads_strict` reads as
    one, or ``None``."""
    args = call["function"].get("arguments", {})
    if isinstance(args, str):
        try:
            args = loads_strict(args)
        except NonFiniteNumber:
            return f"is a string holding {NON_FINITE}"
        except json.JSONDecodeError as e:
            return f"is a string but not JSON ({e.msg})"
        except DuplicateKey as e:
            return f"is a string whose JSON has a {e}"
        except (ValueError, RecursionError) as e:  # nested too deeply, too many digits
            return f"is a string but not JSON here ({e or 'nested too deeply'})"
    return None if isinstance(args, dict) else f"must be a JSON object or a string holding one, got {json_type(args)}"


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

_TOOLS_RULES = (
    ("", lambda v: isinstance(v, list), lambda v: f"must be a list of function schemas, got {json_type(v)}"),
    Each(_TOOL_RULES),
)
"""What a record's (or a packed conversation's) ``tools`` must be."""

_KWARGS_RULES = (("", lambda v: isinstance(v, dict),
                 lambda v: f"must be an object of apply_chat_template keyword arguments, got {json_type(v)}"),)
"""What ``chat_template_kwargs`` must be."""

_TOOL_CALLS_RULES = (
    ("", lambda v: isinstance(v, list) and bool(v), "must be a non-empty list"),
    Each((
        (".function", lambda c: isinstance(c, dict) and isinstance(c.get("function"), dict),
         "must be an object with 'name' and 'arguments'"),
        (".function.name", lambda c: _name_ok(c["function"]), "must be a non-empty string"),
        (".function.arguments", lambda c: _arguments_problem(c) is None, _arguments_problem),
    )),
)
"""What an assistant turn's ``tool_calls`` must be."""

_WEIGHT_RULES = (("", lambda w: w in (0, 1) and not isinstance(w, bool), lambda w: f"must be 0 or 1, got {w!r}"),)


def _has_calls(m: dict) -> bool:
    return m.get("role") == "assistant" and m.get("tool_calls") not in (None, [])


def _unknown_role(m: dict) -> str:
    return f"unknown role {m['role']!r}" if "role" in m else "missing"


_MESSAGE_RULES = (
    ("", lambda m: isinstance(m, dict), lambda m: f"must be an object, got {json_type(m)}"),
    (".role", lambda m: m.get("role") in ROLES,
     lambda m: f"{_unknown_role(m)} (expected one of {', '.join(ROLES)})"),
    (".content", lambda m: m.get("content") is not None or _has_calls(m),
     lambda m: "is null; null content is allowed only on an assistant turn with tool_calls" if "content" in m else
     "missing; content may be left out only on an assistant turn with tool_calls"),
    (".content", lambda m: isinstance(m.get("content"), (str, type(None))),
     lambda m: f"must be a string, got {json_type(m['content'])}"
               + (" (lists of content parts are not supported; join the text parts)"
                  if isinstance(m["content"], list) else "")),
)
"""What each message must be, on its own (its place in the conversation: :func:`validate_messages`)."""

_MESSAGES_RULES = (
    ("", lambda v: isinstance(v, list), lambda v: f"must be a list, got {json_type(v)}"),
    ("", lambda v: any(isinstance(m, dict) and m.get("role") != "system" for m in v),
     "needs at least one user, assistant or tool message"),
)


def _first_system(i: int, role: str) -> bool:
    return i == 0 and role == "system"


def _assistant(i: int, role: str) -> bool:
    return role == "assistant"


_CARRIED = {
    "weight": ((), _assistant, "only assistant turns may carry a weight, not {role}", _WEIGHT_RULES),
    "tool_calls": ((None, []), _assistant, "only assistant turns may carry tool_calls, not {role}", _TOOL_CALLS_RULES),
    # a template reads neither from another message: it would be dropped
    "tools": ((), _first_system, "only the record or its first (system) message may carry tools, not {role} "
                                 "message {i}", _TOOLS_RULES),
    "chat_template_kwargs": ((), _first_system, "only the record or its first (system) message may carry "
                                                "chat_template_kwargs, not {role} message {i}", _KWARGS_RULES),
}
"""The optional keys of a message: ``key: (values that count as absent, which message i of a role may carry it,
reason when another does, the rules of its value)``."""


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
    check_value(messages, _MESSAGES_RULES, path, line, "messages")
    previous = None
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        check_value(m, _MESSAGE_RULES, path, line, where)
        role = m["role"]
        for key, (absent, may, reason, rules) in _CARRIED.items():
            if key not in m or m[key] in absent:
                continue
            if not may(i, role):
                raise ConversationError(path, line, f"{where}.{key}", reason.format(role=role, i=i))
            check_value(m[key], rules, path, line, f"{where}.{key}")
        if role == "system" and i != 0:
            raise ConversationError(path, line, f"{where}.role",
                                    "a system message may only come first (a later one would split the conversation)")
        if role == "tool" and previous not in ("tool_call", "tool"):
            raise ConversationError(path, line, f"{where}.role",
                                    "a tool message must follow an assistant turn with tool_calls")
        previous = "tool_call" if _has_calls(m) else role


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
    check_value(record, _pair_record_rules(input_key, output_key) if input_key else _MESSAGES_RECORD_RULES,
                path, line, "")
    if input_key:
        messages = [{"role": "user", "content": record[input_key]},
                    {"role": "assistant", "content": record[output_key]}]
        if record.get("system") is not None:
            messages.insert(0, {"role": "system", "content": record["system"]})
    else:
        messages = record["messages"]
    validate_messages(messages, path, line)
    tools = record.get("tools")
    if tools is not None:
        check_value(tools, _TOOLS_RULES, path, line, "tools")
    kwargs = record.get("chat_template_kwargs")
    if kwargs is not None:
        check_value(kwargs, _KWARGS_RULES, path, line, "chat_template_kwargs")
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
    check_value(messages, _ROW_RULES, path, line, "messages")
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
                    check_value(tools, _TOOLS_RULES, path, line, f"messages[{s}].tools")
                if kwargs is not None:
                    check_value(kwargs, _KWARGS_RULES, path, line, f"messages[{s}].chat_template_kwargs")
            except ConversationError as err:
                raise ConversationError(path, line, f"conversation {k}: {err.field}", err.reason) from err
        conversations.append(Conversation(messages=msgs, tools=tools, path=str(path), line=line,
                                          chat_template_kwargs=kwargs))
    return conversations
