"""Record shapes the packer reads, turned into OpenAI ``messages`` records before validation.

``--format messages`` (default) and ``input-output`` (``--input-key``/``--output-key``) are read as they are;
``sharegpt`` (``{"conversations": [{"from": "human"|"gpt"|"system"|..., "value": ...}]}``) and ``alpaca``
(``{"instruction", "input"?, "output", "system"?, "history"?}``) are converted here, a field they know but
cannot use rejecting the record (nothing is left out unseen); ``--adapter pkg.module:fn`` names any
callable ``fn(record: dict) -> {"messages": [...], "tools": [...]?}``, imported from ``PYTHONPATH``. An adapter
that raises rejects that line into the report, like any validation error. Examples: ``docs/packing.md``.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import json
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from packsft.conversation import RECORD_OBJECT, Each, first_failed, optional_text_rule, text_rule
from packsft.jsonl import NON_FINITE, NonFiniteNumber, json_type, loads_strict

RECORD_FORMATS = ("messages", "input-output", "sharegpt", "alpaca")
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "chatgpt": "assistant",
                  "bing": "assistant", "system": "system", "tool": "tool", "observation": "tool",
                  "function_response": "tool", "function_call": "assistant"}
"""ShareGPT ``from`` values and the role each becomes. ``function_call`` turns (LLaMA-Factory's tool-calling
ShareGPT: a JSON ``{"name", "arguments"}`` or a list of them) become assistant ``tool_calls``."""


class RecordFormatError(ValueError):
    """A record that does not have the shape of its format (the message names the field)."""


def _check(value: Any, rules: tuple, where: str = "") -> None:
    """Raise :class:`RecordFormatError` ``field: reason`` for the first of ``rules`` (rows of
    :data:`packsft.conversation.Rule` or :class:`~packsft.conversation.Each`, read by
    :func:`~packsft.conversation.first_failed`) that ``value`` fails; ``where`` prefixes the field."""
    failed = first_failed(value, rules)
    if failed:
        field, reason = where + failed[0], failed[1]
        raise RecordFormatError(f"{field}: {reason}" if field else reason)


_SHAREGPT_RULES = (
    RECORD_OBJECT,
    ("conversations", lambda r: isinstance(r.get("conversations"), list), "missing or not a list (ShareGPT records)"),
    optional_text_rule("system", " (ShareGPT records)"),
)
"""What a ShareGPT record must be (its turns: :data:`_TURNS_RULES`)."""

_TURNS_RULES = (Each((
    ("", lambda t: isinstance(t, dict) and "from" in t and "value" in t, "needs 'from' and 'value'"),
    (".from", lambda t: str(t["from"]).lower() in SHAREGPT_ROLES,
     lambda t: f"{t['from']!r} is not one of {sorted(SHAREGPT_ROLES)}"),
)),)
"""What each of a ShareGPT record's ``conversations`` must be."""


def _call_ok(call: Any) -> bool:
    return isinstance(call, dict) and isinstance(call.get("name"), str)


_FUNCTION_CALLS_RULES = (
    ("", lambda calls: all(map(_call_ok, calls)),
     lambda calls: 'a function_call needs {"name": str, "arguments": ...}, '
                   f"got {next(c for c in calls if not _call_ok(c))!r:.80}"),
)
"""What the calls of a ShareGPT ``function_call`` turn (one, or a list of them) must be."""

_ALPACA_RULES = (
    RECORD_OBJECT,
    text_rule("instruction", " (Alpaca records)"),
    text_rule("output", " (Alpaca records)"),
    optional_text_rule("input", " (Alpaca records)"),
    optional_text_rule("system", " (Alpaca records)"),
    ("history", lambda r: isinstance(r.get("history"), (list, type(None))),
     lambda r: f"must be a list of [prompt, response] pairs, got {json_type(r['history'])}"),
)
"""What an Alpaca record must be (its ``history`` pairs: :data:`_HISTORY_RULES`)."""

_HISTORY_RULES = (Each((
    ("", lambda p: isinstance(p, list) and len(p) == 2 and all(isinstance(t, str) for t in p),
     lambda p: f"must be a [prompt, response] pair of strings, got {p!r:.80}"),
)),)


def sharegpt_to_messages(record: Any) -> dict[str, Any]:
    """``{"conversations": [{"from", "value", "weight"?}], "system"?, "tools"?}`` -> ``{"messages", "tools"?}``.

    A turn's ``weight`` is kept on its message (validated as any message's). ``tools`` may be given as JSON
    text and as bare function schemas ``{"name", "description", "parameters"}`` (LLaMA-Factory writes both); each
    becomes an OpenAI ``{"type": "function", "function": {...}}`` entry.

    Raises:
        RecordFormatError: not an object, no ``conversations`` list, a turn without ``from``/``value``, an unknown
            ``from``, a ``system`` that is not a string, or ``tools`` text that is not JSON.
    """
    _check(record, _SHAREGPT_RULES)
    _check(record["conversations"], _TURNS_RULES, "conversations")
    system = record.get("system")
    messages = [{"role": "system", "content": system}] if system is not None else []
    for i, turn in enumerate(record["conversations"]):
        role = SHAREGPT_ROLES[str(turn["from"]).lower()]
        if str(turn["from"]).lower() == "function_call":
            message = {"role": "assistant", "content": "", "tool_calls": _sharegpt_tool_calls(turn["value"], i)}
        else:
            message = {"role": role, "content": turn["value"]}
        if "weight" in turn:
            message["weight"] = turn["weight"]
        messages.append(message)
    return _with_tools({"messages": messages}, record)


def _with_tools(out: dict[str, Any], record: dict[str, Any]) -> dict[str, Any]:
    """``out`` with the record's ``tools`` (:func:`_record_tools`) when it has some."""
    tools = _record_tools(record["tools"]) if record.get("tools") is not None else None
    return {**out, "tools": tools} if tools is not None else out


def _record_tools(tools: Any) -> Any:
    """OpenAI ``tools`` of a ShareGPT or Alpaca record's ``tools``: JSON text decoded (an empty string is no
    tools: None), bare function schemas wrapped (other shapes are returned as they are, for the validation to
    name)."""
    if isinstance(tools, str):
        if not tools.strip():  # LLaMA-Factory's "no tools"
            return None
        tools = _decoded(tools, "tools", "a string must be the JSON of a list of function schemas")
    if isinstance(tools, list):
        tools = [{"type": "function", "function": t} if isinstance(t, dict) and "type" not in t and "name" in t
                 else t for t in tools]
    return tools


def _sharegpt_tool_calls(value: Any, i: int) -> list[dict[str, Any]]:
    """OpenAI ``tool_calls`` of a ShareGPT ``function_call`` turn's value (JSON text or already decoded)."""
    where = f"conversations[{i}].value"
    if isinstance(value, str):
        value = _decoded(value, where, 'a function_call value must be JSON {"name": ..., "arguments": {...}}')
    calls = value if isinstance(value, list) else [value]
    _check(calls, _FUNCTION_CALLS_RULES, where)
    return [{"type": "function", "function": {"name": c["name"], "arguments": c.get("arguments", {})}} for c in calls]


def _decoded(text: str, where: str, expected: str) -> Any:
    """The strict JSON value of ``text``, a field's string.

    Raises:
        RecordFormatError: not JSON (``where: expected (reason)``), too deep or large for :mod:`json`, or holding
            a non-finite number.
    """
    try:
        return loads_strict(text)
    except (ValueError, RecursionError) as e:  # json.JSONDecodeError and NonFiniteNumber are ValueErrors
        raise RecordFormatError(f"{where}: {_not_json(e, expected)}") from e


def _not_json(e: Exception, expected: str) -> str:
    """Why a field's string is not what :func:`loads_strict` reads (it raised ``e``)."""
    if isinstance(e, NonFiniteNumber):
        return f"holds {NON_FINITE}"
    if isinstance(e, json.JSONDecodeError):
        return f"{expected} ({e.msg})"
    return f"{expected} (not valid JSON here: {e or 'nested too deeply'})"  # too deep, an integer of too many digits


_MESSAGE_FIELD = re.compile(r"^messages\[(\d+)\](.*)$")


def source_field(record_format: str, record: Any, field: str) -> str:
    """The field of the input ``record`` that a validation error on the converted ``field`` is about.

    ``messages[i].content`` of a ShareGPT record is ``conversations[j].value`` (``j = i`` less one when the
    record's top-level ``system`` became message 0), ``.role`` is ``.from``; of an Alpaca record, the user turn is
    ``instruction`` and the assistant's ``output``. Other formats and fields are returned unchanged.
    """
    m = _MESSAGE_FIELD.match(field or "")
    if m is None or not isinstance(record, dict):
        return field
    i, rest = int(m.group(1)), m.group(2)
    if record_format == "sharegpt":
        has_system = isinstance(record.get("system"), str)
        if has_system and i == 0:
            return "system"
        rest = {".content": ".value", ".role": ".from"}.get(rest, rest)
        return f"conversations[{i - has_system}]{rest}"
    if record_format == "alpaca":
        offset = isinstance(record.get("system"), str)
        history = record.get("history") if isinstance(record.get("history"), list) else []
        if i < offset:
            return "system"
        k = i - offset
        if k < 2 * len(history):
            return f"history[{k // 2}][{k % 2}]"
        return {0: "instruction", 1: "output"}.get(k - 2 * len(history), field)
    return field


def alpaca_to_messages(record: Any) -> dict[str, Any]:
    """``{"instruction", "input"?, "output", "system"?, "history"?, "tools"?}`` -> the earlier turns of
    ``history`` (a list of ``[prompt, response]`` pairs, LLaMA-Factory's multi-turn Alpaca), then one user turn
    (instruction, a blank line, input) and the assistant's output (Stanford Alpaca's fields); ``tools`` as in
    :func:`sharegpt_to_messages`.

    Raises:
        RecordFormatError: not an object; ``instruction`` or ``output`` missing or not a string; ``input`` or
            ``system`` given and not a string; ``history`` not a list of pairs of strings.
    """
    _check(record, _ALPACA_RULES)
    history = record.get("history") or []
    _check(history, _HISTORY_RULES, "history")
    system, extra = record.get("system"), record.get("input")
    messages = [{"role": "system", "content": system}] if system is not None else []
    for prompt, response in history:
        messages += [{"role": "user", "content": prompt}, {"role": "assistant", "content": response}]
    prompt = record["instruction"] + (f"\n\n{extra}" if extra else "")
    messages += [{"role": "user", "content": prompt}, {"role": "assistant", "content": record["output"]}]
    return _with_tools({"messages": messages}, record)


def import_named(path: str, option: str, example: str, kind: Callable[[Any], bool] = callable,
                 noun: str = "a callable") -> Any:
    """The object a user names by import path, ``pkg.module:name`` or ``pkg.module.name`` (``--adapter``, the
    loader's ``sampler_class_path``), from ``PYTHONPATH``; or by file, ``path/to/file.py:name`` (a package's
    ``path/to/pkg/__init__.py:name`` imports it as the package ``pkg``, so its relative imports work).

    Args:
        option: how the path was given, the messages' prefix (``"--adapter "``, ``"sampler_class_path="``).
        example: an import path of the right form, for the message.
        kind, noun: what the object must be (``kind(obj)`` true), and its name in the message.

    Raises:
        ValueError: not an import path, the module or attribute is missing, or ``kind(obj)`` is false.
    """
    module_name, sep, attr = path.partition(":")
    if not sep:
        module_name, _, attr = path.rpartition(".")
    if not module_name or not attr:
        raise ValueError(f"{option}{path!r} is not an import path like '{example}'")
    try:
        obj = getattr(_import_file(Path(module_name)) if sep and module_name.endswith(".py") else
                      importlib.import_module(module_name), attr)
    except (ImportError, AttributeError, OSError) as err:
        raise ValueError(f"{option}{path!r} does not resolve ({err}); is its folder on PYTHONPATH?") from err
    if not kind(obj):
        raise ValueError(f"{option}{path!r} is a {type(obj).__name__}, not {noun}")
    return obj


def _import_file(file: Path):
    """The module of the Python file ``file`` (a package when it is an ``__init__.py``), kept in ``sys.modules``
    under its name so that worker processes and pickles find it again."""
    package = file.name == "__init__.py"
    name = file.parent.name if package else f"packsft_plugin_{file.stem}"
    if name in sys.modules and getattr(sys.modules[name], "__file__", None) == str(file.resolve()):
        return sys.modules[name]
    if not file.is_file():
        raise FileNotFoundError(f"no Python file {file}")
    spec = importlib.util.spec_from_file_location(name, file.resolve(), submodule_search_locations=[
        str(file.resolve().parent)] if package else None)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def import_adapter(path: str, option: str = "--adapter ") -> Callable[[dict[str, Any]], dict[str, Any]]:
    """The ``--adapter`` function named ``pkg.module:fn`` (or ``pkg.module.fn``); raises as :func:`import_named`
    (``option``: how the messages name the setting)."""
    return import_named(path, option, "my_pkg.my_module:to_messages")


def adapter_identity(path: str) -> dict[str, str]:
    """``{"adapter": path, "adapter_sha256": <hash>}`` for the sidecar and the Energon loader's fingerprint: the
    SHA-256 (hex, 16 characters) of the file defining the function or, when that file is part of a package, of
    every ``.py`` file of its top-level package (names and contents, in order)."""
    fn = import_adapter(path)
    try:
        file = Path(inspect.getfile(fn))
        root = file.parent if (file.parent / "__init__.py").is_file() else None
        while root is not None and (root.parent / "__init__.py").is_file():
            root = root.parent                                   # the top-level package: its helpers count too
        source = file.read_bytes() if root is None else b"".join(
            f"{f.relative_to(root)}\0".encode() + f.read_bytes() + b"\0" for f in sorted(root.rglob("*.py")))
    except (TypeError, OSError):
        source = repr(fn).encode()
    return {"adapter": path, "adapter_sha256": hashlib.sha256(source).hexdigest()[:16]}


def record_converter(record_format: str, adapter: str | None,
                     option: str = "--adapter ") -> Callable[[Any], Any] | None:
    """The function that turns one decoded record into a ``messages`` record, or None when none is needed.

    Args:
        record_format: one of :data:`RECORD_FORMATS` (``PackConfig`` checks it, as ``--format``'s choices), and
            ``messages`` with an ``adapter`` (``PackConfig.relations``).

    Raises:
        ValueError: an adapter that does not import (:func:`import_named`).
    """
    if adapter:
        return _checked(import_adapter(adapter, option), adapter)
    return {"sharegpt": sharegpt_to_messages, "alpaca": alpaca_to_messages}.get(record_format)


def _returned(out: Any) -> str:
    """What an adapter returned in place of a dict with a ``messages`` list, for the message."""
    return (type(out).__name__ if not isinstance(out, dict) else "no 'messages' key" if "messages" not in out
            else f"'messages' {type(out['messages']).__name__}")


def _checked(fn: Callable, name: str) -> Callable[[Any], Any]:
    """The adapter ``fn`` (import path ``name``) as a converter: its failure, a result without a ``messages``
    list or one that is not JSON raises :class:`RecordFormatError`."""
    returns = (("", lambda out: isinstance(out, dict) and isinstance(out.get("messages"), list),
                lambda out: f"adapter {name} must return a dict with a 'messages' list, got {_returned(out)}"),)

    def convert(record: Any) -> Any:
        try:
            out = fn(record)
        except (Exception, SystemExit) as err:  # noqa: BLE001 - the user's adapter: any failure rejects the line
            raise RecordFormatError(f"adapter {name} failed: {type(err).__name__}: {err}") from err
        _check(out, returns)
        try:  # the row is written as JSON and read back from it: pack what the loader will read
            return json.loads(_STRICT_ROW_JSON(out))
        except (TypeError, ValueError, RecursionError) as err:  # e.g. a numpy int64, a set, a datetime, a NaN
            raise RecordFormatError(f"adapter {name} returned a record that is not JSON: {err}") from err
    return convert


ROW_JSON = json.JSONEncoder(ensure_ascii=False).encode
"""JSON text of a record or row as the packer writes it (one encoder for all: ``json.dumps`` builds one per call)."""
_STRICT_ROW_JSON = json.JSONEncoder(ensure_ascii=False, allow_nan=False).encode
""":data:`ROW_JSON` refusing NaN and infinities (``ValueError``), which strict JSON readers refuse."""
