import json

import pytest

from packsft.conversation import (
    NON_FINITE,
    ConversationError,
    DuplicateKey,
    NonFiniteNumber,
    iter_jsonl_lines,
    iter_jsonl_lines_sized,
    loads_line,
    loads_strict,
    parse_record,
    split_row,
    validate_messages,
)


def _err(record, **kw):
    with pytest.raises(ConversationError) as e:
        parse_record(record, "in.jsonl", 7, **kw)
    return e.value


def test_missing_system_gets_default_and_tools_ride_on_it():
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    conv = parse_record({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}],
                         "tools": tools}, "in.jsonl", 3, default_system_prompt="Be brief.")
    assert conv.messages[0] == {"role": "system", "content": "Be brief."}
    assert (conv.path, conv.line) == ("in.jsonl", 3)
    row = conv.to_row_messages()
    assert row[0]["tools"] == tools and "tools" not in conv.messages[0]
    back = split_row(row + row)
    assert len(back) == 2 and back[1].tools == tools and back[1].messages == conv.messages
    again = {"messages": row, "tools": tools}   # a row's conversation given its tools twice: the same, kept
    assert parse_record(again, "in.jsonl", 3).tools == tools
    other = [{"type": "function", "function": {"name": "g", "parameters": {"type": "object"}}}]
    err = _err({"messages": row, "tools": other})   # two lists: one would be lost
    assert (err.field, err.reason) == ("messages[0].tools", "differs from the record's tools (one would be lost): "
                                                            "give the schemas once")


@pytest.mark.parametrize(
    "record, field, words",
    [
        ([1, 2], "", "JSON object"),
        ({"foo": 1}, "messages", "missing"),
        ({"messages": "hi"}, "messages", "must be a list"),
        ({"messages": [{"role": "system", "content": "x"}]}, "messages", "at least one"),
        ({"messages": [{"role": "user", "content": "x"}, {"role": "bot", "content": "x"}]}, "messages[1].role",
         "unknown role 'bot'"),
        ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content", "must be a string, got number"),
        ({"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}]}]}, "messages[0].content",
         "got array (lists of content parts"),
        ({"messages": [{"content": "a"}]}, "messages[0].role", "missing"),
        (None, "", "JSON object, got null"),
        ({"messages": [{"role": "user", "content": None}]}, "messages[0].content", "is null;"),
        ({"messages": [{"role": "user"}]}, "messages[0].content",
         "missing; content may be left out only on an assistant turn with tool_calls"),
        ({"messages": [{"role": "user", "content": "a"}, {"role": "assistant"}]}, "messages[1].content", "missing;"),
        ({"messages": [{"role": "user", "content": "a"}, {"role": "system", "content": "b"}]}, "messages[1].role",
         "only come first"),
        ({"messages": [{"role": "user", "content": "a"}, {"role": "tool", "content": "b"}]}, "messages[1].role",
         "must follow"),
        ({"messages": [{"role": "user", "content": "a"},
                       {"role": "assistant", "content": None,
                        "tool_calls": [{"function": {"name": "f", "arguments": "{not json"}}]}]},
         "messages[1].tool_calls[0].function.arguments", "not JSON"),
        ({"messages": [{"role": "user", "content": "a"}], "tools": [{"type": "function", "function": {}}]},
         "tools[0].function.name", "non-empty"),
        ({"messages": [{"role": "user", "content": "a"}], "tools": {"f": 1}}, "tools", "must be a list"),
        ({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": None}]},
         "messages[1].content", "null content is allowed only on an assistant turn with tool_calls"),
        ({"messages": [{"role": "user", "content": "a", "weight": 0}]}, "messages[0].weight",
         "only assistant turns may carry a weight"),
        ({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b", "weight": 0.5}]},
         "messages[1].weight", "must be 0 or 1"),
        ({"messages": [{"role": "user", "content": "a"}], "chat_template_kwargs": [1]}, "chat_template_kwargs",
         "must be an object"),
        # a template reads tools and kwargs from the record (its first message): elsewhere they were dropped
        ({"messages": [{"role": "user", "content": "a", "tools": [{"type": "function", "function": {"name": "f"}}]},
                       {"role": "assistant", "content": "b"}]},
         "messages[0].tools", "only the record or its first (system) message may carry tools, not user message 0"),
        ({"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "a"},
                       {"role": "assistant", "content": "b", "chat_template_kwargs": {"x": 1}}]},
         "messages[2].chat_template_kwargs", "may carry chat_template_kwargs, not assistant message 2"),
    ],
)
def test_invalid_records_name_file_line_and_field(record, field, words):
    e = _err(record)
    assert (e.path, e.line, e.field) == ("in.jsonl", 7, field)
    assert words in e.reason
    assert str(e).startswith(f"in.jsonl:7: {field + ': ' if field else ''}")


def test_tool_calls_with_string_or_object_arguments_are_valid():
    for args in ('{"x": 1}', {"x": 1}):
        msgs = [{"role": "user", "content": "a"},
                {"role": "assistant", "content": None,
                 "tool_calls": [{"id": "call00001", "type": "function", "function": {"name": "f", "arguments": args}}]},
                {"role": "tool", "tool_call_id": "call00001", "content": "2"},
                {"role": "assistant", "content": "done"}]
        validate_messages(msgs)
        del msgs[1]["content"]                                 # OpenAI: null or left out beside tool_calls
        validate_messages(msgs)


def test_prompt_response_records():
    conv = parse_record({"prompt": "2+2?", "response": "4", "system": "math"}, input_key="prompt",
                        output_key="response")
    assert [m["role"] for m in conv.messages] == ["system", "user", "assistant"]
    assert conv.messages[0]["content"] == "math"
    assert _err({"prompt": "2+2?"}, input_key="prompt", output_key="response").field == "response"
    err = _err({"prompt": "2+2?", "response": "4", "system": 3}, input_key="prompt", output_key="response")
    assert (err.field, err.reason) == ("system", "must be a string, got number")   # was dropped unseen


def test_jsonl_reader_keeps_line_numbers_crlf_blank_and_bad_utf8(tmp_path):
    p = tmp_path / "x.jsonl"
    good = json.dumps({"messages": [{"role": "user", "content": "é 🙂"}]}, ensure_ascii=False)
    p.write_bytes(good.encode() + b"\r\n\r\n   \n" + b"\xff\xfe\n" + good.encode())
    rows = list(iter_jsonl_lines(p))
    assert [r[0] for r in rows] == [1, 4, 5]
    assert rows[1][1] is None and "UTF-8" in rows[1][2]
    assert json.loads(rows[0][1])["messages"][0]["content"] == "é 🙂"


def test_jsonl_reader_skips_a_byte_order_mark_at_the_start_of_the_file_only(tmp_path):
    p = tmp_path / "bom.jsonl"
    good = json.dumps({"messages": [{"role": "user", "content": "hi"}]}).encode()
    p.write_bytes(b"\xef\xbb\xbf" + good + b"\n" + b"\xef\xbb\xbf" + good + b"\n")
    rows = list(iter_jsonl_lines_sized(p))
    assert rows[0][2] == good.decode() + "\n"  # parsed as JSON by the packer
    assert rows[1][2].startswith("\ufeff")  # not at the start of the file: kept, and rejected as invalid JSON
    assert sum(r[1] for r in rows) == p.stat().st_size
    half = len(good) + 4  # a shard that starts at line 2 keeps its bytes as they are
    assert [r[2] for r in iter_jsonl_lines_sized(p, start=half)] == [rows[1][2]]
    # the size limit applies to the line without the mark: at the limit it is read whole, one byte over it is
    # reported as too long (not cut in two)
    at = list(iter_jsonl_lines_sized(p, max_bytes=len(good)))
    assert [r[0] for r in at] == [1, 2] and at[0][2] == rows[0][2] and at[0][3] is None
    assert at[1][2] is None and "more than" in at[1][3]  # line 2's mark is a character of it: 3 bytes over
    over = list(iter_jsonl_lines_sized(p, max_bytes=len(good) - 1))
    assert [r[0] for r in over] == [1, 2] and over[0][2] is None and "more than" in over[0][3]
    assert sum(r[1] for r in over) == p.stat().st_size


@pytest.mark.parametrize("ending", [b"\n", b"\r\n", b""])
def test_an_overlong_line_is_reported_with_its_bytes_without_the_line_ending(tmp_path, ending):
    """The first read of an overlong line ends between its "\r" and "\n" (limit + 2 bytes) or within it; the count
    is the same as without a line ending."""
    p = tmp_path / "long.jsonl"
    for n in (21, 22, 23, 40):
        p.write_bytes(b"{}\n" + b"x" * n + ending)  # the last line, with or without its line ending
        rows = list(iter_jsonl_lines_sized(p, max_bytes=20))
        assert rows[1][2] is None and rows[1][3].startswith(f"line has {n} bytes, more than"), (n, rows[1][3])
        assert len(rows) == 2 and sum(r[1] for r in rows) == p.stat().st_size


def test_loads_line_names_the_file_and_line_of_what_is_not_json():
    assert loads_line('{"a": 1}\r\n', "x.jsonl", 3) == {"a": 1}
    for text, error, reason in (('{"a": 1\n', None, "not valid JSON: Expecting ',' delimiter (column 8)"),
                                ("[" * 100_000, None, "not valid JSON: nested too deeply"),
                                (None, "not valid UTF-8 (invalid start byte at byte 0)",
                                 "not valid UTF-8 (invalid start byte at byte 0)"),
                                ('\ufeff{"a": 1}\n', None, "not valid JSON: Expecting value (column 1); the line "
                                 "starts with a byte-order mark (U+FEFF), as where two files were concatenated"),
                                ('{"a": 1}\r{"a": 2}\r', None, "not valid JSON: Extra data (column 10); the line "
                                 "holds a carriage return (\\r): a file with old Mac (CR-only) line ends reads as "
                                 "one line"),
                                ('{"a": "x\ry"}\n', None, "not valid JSON: Invalid control character at (column 9)")):
        with pytest.raises(ConversationError) as e:
            loads_line(text, "x.jsonl", 3, error)
        assert str(e.value) == f"x.jsonl:3: {reason}"


def test_loads_line_rejects_lone_surrogate_escapes_naming_the_field():
    """JSON's "\\ud800" alone decodes to a str that UTF-8 cannot encode (the tokenizer raised TypeError on it)."""
    bad = "a \\u escape of a lone UTF-16 surrogate (D800-DFFF not in a high-low pair) is not text"
    for text, field in ((r'{"messages": [{"role": "user", "content": "x\ud800"}]}', "messages[0].content: "),
                        (r'{"tools": [{"k\uDC00": 1}]}', "tools[0].k\\udc00: "),
                        (r'"\udfff"', "")):
        with pytest.raises(ConversationError) as e:
            loads_line(text, "x.jsonl", 3)
        assert str(e.value) == f"x.jsonl:3: {field}{bad}"
    pair = r'{"a\\u": "\ud83d\ude00 and \\ud800"}'  # a surrogate pair, and an escaped backslash before "ud800"
    assert loads_line(pair, "x.jsonl", 3) == {"a\\u": "\U0001F600 and \\ud800"}


def test_loads_line_rejects_nan_and_infinity_naming_the_field():
    """Python's json reads a bare NaN / Infinity; the rows would then hold them, which strict readers refuse."""
    bad = NON_FINITE
    for text, field in (('{"tools": [{"function": {"parameters": {"default": NaN}}}]}',
                         "tools[0].function.parameters.default: "),
                        ('{"messages": [{"role": "user", "content": "x", "w": -Infinity}]}', "messages[0].w: "),
                        ('[1, Infinity]', "[1]: "), ("NaN", ""),
                        ('{"a": {"b": [0.5, 1e999]}}', "a.b[1]: "), ('{"a": -1E400}', "a: ")):   # inf as floats
        with pytest.raises(ConversationError) as e:
            loads_line(text, "x.jsonl", 3)
        assert str(e.value) == f"x.jsonl:3: {field}{bad}"
    ok = '{"content": "NaN and Infinity are words here", "x": 1.5e300}'
    assert loads_line(ok, "x.jsonl", 3) == {"content": "NaN and Infinity are words here", "x": 1.5e300}
    assert type(loads_line(ok, "x.jsonl", 3)["content"]) is str
    with pytest.raises(NonFiniteNumber):
        loads_strict('{"arguments": {"a": NaN}}')
    assert loads_strict('{"a": 1e308, "b": 10000000000000000000000000}') == {"a": 1e308, "b": 10**25}
    with pytest.raises(ConversationError, match="x.jsonl:3: not valid JSON here: Exceeds the limit"):
        loads_line('{"a": ' + "9" * 5000 + "}", "x.jsonl", 3)          # int() refuses more than 4300 digits


def test_tool_call_arguments_as_a_string_must_be_finite_json():
    messages = [{"role": "user", "content": "q"},
                {"role": "assistant", "content": None,
                 "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": '{"a": NaN}'}}]},
                {"role": "tool", "content": "1"}, {"role": "assistant", "content": "a"}]
    with pytest.raises(ConversationError, match=r"tool_calls\[0\].function.arguments: is a string holding NaN"):
        validate_messages(messages, "x.jsonl", 2)


def test_a_key_given_twice_is_refused_naming_its_field():
    """json keeps the last of two equal keys: the first value (a whole conversation) would be lost unseen."""
    dup = " (JSON keeps only its last value; the others would be lost)"
    for text, field in (('{"messages": [], "messages": [{"role": "user", "content": "b"}]}', "messages"),
                        ('{"messages": [{"role": "user", "content": "a", "content": "b"}]}',
                         "messages[0].content"),
                        ('{"a": {"b": [1, {"c": 1, "d": {}, "c": 2}]}}', "a.b[1].c")):
        with pytest.raises(ConversationError) as e:
            loads_line(text, "x.jsonl", 3)
        key = field.rsplit(".", 1)[-1]
        assert str(e.value) == f"x.jsonl:3: {field}: duplicate key '{key}'{dup}"
    with pytest.raises(DuplicateKey):
        loads_strict('{"a": 1, "a": 1}')
    assert loads_strict('{"a": {"k": 1}, "b": {"k": 2}}') == {"a": {"k": 1}, "b": {"k": 2}}  # per object
    messages = [{"role": "user", "content": "q"},
                {"role": "assistant", "content": None,
                 "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": '{"x": 1, "x": 2}'}}]},
                {"role": "tool", "content": "1"}, {"role": "assistant", "content": "a"}]
    with pytest.raises(ConversationError, match=r"tool_calls\[0\].function.arguments: is a string whose JSON has a "
                                                "duplicate key 'x'"):
        validate_messages(messages, "x.jsonl", 2)


def test_split_row_errors_name_the_conversation():
    with pytest.raises(ConversationError, match="must start with a system"):
        split_row([{"role": "user", "content": "a"}], "rows.packed", 3)
    with pytest.raises(ConversationError, match="conversation 1: messages"):
        split_row([{"role": "system", "content": ""}, {"role": "user", "content": "a"},
                   {"role": "system", "content": ""}], "rows.packed", 3)


def test_weight_and_chat_template_kwargs_ride_in_the_row():
    from packsft.conversation import split_row

    record = {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b", "weight": 0},
                           {"role": "user", "content": "c"}, {"role": "assistant", "content": "d", "weight": 1}],
              "chat_template_kwargs": {"enable_thinking": False}}
    conv = parse_record(record, "in.jsonl", 3)
    assert conv.chat_template_kwargs == {"enable_thinking": False}
    row = conv.to_row_messages()
    assert row[0]["chat_template_kwargs"] == {"enable_thinking": False} and row[2]["weight"] == 0
    back = split_row(row + row)
    assert [c.chat_template_kwargs for c in back] == [{"enable_thinking": False}] * 2
    assert back[0].messages == conv.messages and "chat_template_kwargs" not in back[0].messages[0]
