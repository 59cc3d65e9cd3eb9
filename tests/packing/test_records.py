"""packsft.packing.records.parse_line: one input line to a conversation, errors naming the input's own field."""

import json

import pytest

from packsft.jsonl import ConversationError
from packsft.packing.records import parse_line
from packsft.record_formats import record_converter


def test_a_sharegpt_line_is_converted_and_its_error_names_the_sharegpt_field():
    line = json.dumps({"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}]})
    conv, record, source = parse_line("in.jsonl", 3, line, None, record_converter("sharegpt", None), "sharegpt")
    assert [m["role"] for m in conv.messages] == ["system", "user", "assistant"]     # a system message first
    assert source["conversations"][0]["value"] == "hi"
    assert record["messages"][1]["content"] == "yo"
    bad = json.dumps({"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": 7}]})
    with pytest.raises(ConversationError) as err:
        parse_line("in.jsonl", 3, bad, None, record_converter("sharegpt", None), "sharegpt")
    assert (err.value.line, err.value.field) == (3, "conversations[1].value")


def test_media_is_refused_only_for_text_only_inputs():
    line = json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}],
                       "media": [{"type": "image", "member": "0.jpg"}]})
    assert parse_line("in.jsonl", 1, line, None)[0].messages[-1]["content"] == "yo"   # a system message first
    with pytest.raises(ConversationError, match=r"^ds:1: media: the sample has media \(1 item\(s\)\); read as text "
                                                r"only here \(image-text samples train a LLaVA model"):
        parse_line("ds", 1, line, None, text_only=True)
