
import pytest

from packsft.conversation import ConversationError, parse_record, split_row, validate_messages
from packsft.jsonl import DuplicateKey, loads_line, loads_strict


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
