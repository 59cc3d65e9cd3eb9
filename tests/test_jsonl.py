"""packsft.jsonl: JSONL lines with their numbers and sizes, strict JSON, errors naming file, line and field."""

import json

import pytest

from packsft.jsonl import (
    NON_FINITE,
    ConversationError,
    NonFiniteNumber,
    iter_jsonl_lines,
    iter_jsonl_lines_sized,
    loads_line,
    loads_strict,
)


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
