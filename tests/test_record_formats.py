"""Record shapes at pack time: ShareGPT, Alpaca and user adapters become messages records; failures are reported
per line; the adapter's import path and file hash are recorded in the sidecar."""

import json
import sys

import pytest

from packsft.packing.config import PackConfig
from packsft.packing.pipeline import run_pack
from packsft.record_formats import (
    RecordFormatError,
    alpaca_to_messages,
    import_adapter,
    record_converter,
    sharegpt_to_messages,
    source_field,
)
from packsft.sidecar import read_sidecar

SHAREGPT = {"conversations": [{"from": "system", "value": "Be brief."}, {"from": "human", "value": "Hi"},
                              {"from": "gpt", "value": "Hello!"}]}
ALPACA = {"instruction": "Add the numbers.", "input": "2 and 3", "output": "5"}
ADAPTER = '''
def to_messages(record):
    if record.get("q") == "boom":
        raise KeyError("no answer")
    if record.get("q") == "exit":
        raise SystemExit(3)
    if record.get("q") == "tuple":
        return {"messages": ({"role": "user", "content": "x"},)}
    return {"messages": [{"role": "user", "content": record["q"]}, {"role": "assistant", "content": record["a"]}]}
'''


def test_sharegpt_and_alpaca_become_messages():
    assert sharegpt_to_messages(SHAREGPT)["messages"] == [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"}]
    assert alpaca_to_messages(ALPACA)["messages"] == [
        {"role": "user", "content": "Add the numbers.\n\n2 and 3"}, {"role": "assistant", "content": "5"}]
    assert alpaca_to_messages({"instruction": "Hi", "output": "Yo", "input": ""})["messages"][0]["content"] == "Hi"
    with pytest.raises(RecordFormatError, match=r"conversations\[0\].from: 'robot'"):
        sharegpt_to_messages({"conversations": [{"from": "robot", "value": "x"}]})
    with pytest.raises(RecordFormatError, match="output: missing"):
        alpaca_to_messages({"instruction": "x"})
    for fmt, line in (("alpaca", [1, 2]), ("sharegpt", "text"), ("alpaca", None)):  # a traceback, exit 1 before
        with pytest.raises(RecordFormatError, match="^a record must be a JSON object, got (array|string|null)$"):
            record_converter(fmt, None)(line)
    with pytest.raises(ValueError, match="does not resolve"):
        import_adapter("no_such_pkg.mod:fn")
    with pytest.raises(ValueError, match="not an import path"):
        import_adapter("fn")


def _pack(tmp_path, tokenizer_dir, lines, **cfg):
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps(x) + "\n" for x in lines))
    out = tmp_path / "o.jsonl.packed"
    report = run_pack(PackConfig(inputs=[str(src)], output=str(out), tokenizer=str(tokenizer_dir("qwen2.5")),
                                 max_seq_len=256, progress=False, histogram="", **cfg))
    return report, out


def test_pack_sharegpt_and_alpaca(tmp_path, tokenizer_dir):
    report, out = _pack(tmp_path, tokenizer_dir, [SHAREGPT, {"conversations": "nope"}], record_format="sharegpt")
    assert report.packed_conversations == 1 and report.rejected[0]["line"] == 2
    assert "conversations: missing or not a list" in report.rejected[0]["reason"]
    assert read_sidecar(out)["record_format"] == "sharegpt"
    report, _ = _pack(tmp_path, tokenizer_dir, [ALPACA, ALPACA], record_format="alpaca")
    assert report.packed_conversations == 2 and not report.rejected


def _adapter_module(tmp_path, monkeypatch, name: str, source: str) -> None:
    """Make ``source`` importable as module ``name`` (a folder on ``sys.path``, no stale import)."""
    pkg = tmp_path / "adapters"
    pkg.mkdir(exist_ok=True)
    (pkg / f"{name}.py").write_text(source)
    monkeypatch.syspath_prepend(str(pkg))
    sys.modules.pop(name, None)


def test_adapter_from_pythonpath_reports_failures_per_line(tmp_path, tokenizer_dir, monkeypatch):
    _adapter_module(tmp_path, monkeypatch, "my_adapter", ADAPTER)
    lines = [{"q": "2+2?", "a": "4"}, {"q": "boom"}, {"q": "hi", "a": "yo"}, {"q": "exit"}, {"q": "tuple"}]
    report, out = _pack(tmp_path, tokenizer_dir, lines, adapter="my_adapter:to_messages")
    assert report.packed_conversations == 2
    assert [(r["line"], "adapter my_adapter:to_messages failed: " in r["reason"]) for r in report.rejected[:2]] \
        == [(2, True), (4, True)]                      # an exception and a SystemExit: the line, not the run
    assert report.rejected[2]["line"] == 5 and report.rejected[2]["reason"].endswith(
        "must return a dict with a 'messages' list, got 'messages' tuple")
    meta = read_sidecar(out)
    assert meta["adapter"] == "my_adapter:to_messages" and len(meta["adapter_sha256"]) == 16
    with pytest.raises(ValueError, match="--adapter replaces --format"):
        _pack(tmp_path, tokenizer_dir, [ALPACA], adapter="my_adapter:to_messages", record_format="alpaca")


def test_an_adapter_in_a_package_is_identified_by_every_file_of_the_package(tmp_path, monkeypatch):
    from packsft.record_formats import adapter_identity

    pkg = tmp_path / "qa_pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("from qa_pkg.helpers import turn\n\n"
                                     "def to_messages(r):\n    return {'messages': [turn('user', r['q'])]}\n")
    (pkg / "helpers.py").write_text("def turn(role, text):\n    return {'role': role, 'content': text}\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    first, in_module = adapter_identity("qa_pkg:to_messages"), adapter_identity("qa_pkg.helpers:turn")
    (pkg / "helpers.py").write_text((pkg / "helpers.py").read_text() + "# edited\n")
    assert adapter_identity("qa_pkg:to_messages")["adapter_sha256"] != first["adapter_sha256"]
    (pkg / "__init__.py").write_text((pkg / "__init__.py").read_text() + "# edited\n")   # a module's package too
    assert adapter_identity("qa_pkg.helpers:turn")["adapter_sha256"] != in_module["adapter_sha256"]
    for name in ("qa_pkg", "qa_pkg.helpers"):
        sys.modules.pop(name, None)


def test_sharegpt_function_call_turns_become_tool_calls():
    record = {"conversations": [
        {"from": "human", "value": "Weather in Paris?"},
        {"from": "function_call", "value": json.dumps({"name": "get_weather", "arguments": {"city": "Paris"}})},
        {"from": "observation", "value": "{\"temp\": 21}"},
        {"from": "gpt", "value": "21 degrees."}], "tools": json.dumps([{"name": "get_weather"}])}
    msgs = sharegpt_to_messages(record)["messages"]
    assert [m["role"] for m in msgs] == ["user", "assistant", "tool", "assistant"]
    assert msgs[1]["tool_calls"] == [{"type": "function",
                                      "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]
    with pytest.raises(RecordFormatError, match=r"conversations\[0\].value: a function_call value must be JSON"):
        sharegpt_to_messages({"conversations": [{"from": "function_call", "value": "get_weather(Paris)"}]})
    with pytest.raises(RecordFormatError, match=r'conversations\[0\].value: a function_call needs \{"name"'):
        sharegpt_to_messages({"conversations": [{"from": "function_call", "value": "[1]"}]})
    with pytest.raises(RecordFormatError, match=r"conversations\[0\].value: holds NaN / Infinity"):   # json reads it
        sharegpt_to_messages({"conversations": [{"from": "function_call",
                                                 "value": '{"name": "f", "arguments": {"a": NaN}}'}]})


def test_fields_a_format_knows_are_used_or_rejected_never_dropped():
    """A non-string Alpaca ``input``/``system`` or ShareGPT ``system`` rejects the record (they were left out of the
    conversation unseen); Alpaca ``history`` (LLaMA-Factory's multi-turn) becomes the earlier turns; a ShareGPT
    turn's ``weight`` stays on its message."""
    for record, field in (({**ALPACA, "input": 42}, "input"), ({**ALPACA, "input": ["a"]}, "input"),
                          ({**ALPACA, "system": 123}, "system")):
        with pytest.raises(RecordFormatError, match=f"^{field}: must be a string, got "):
            alpaca_to_messages(record)
    with pytest.raises(RecordFormatError, match="^system: must be a string, got array"):
        sharegpt_to_messages({**SHAREGPT, "system": ["not", "text"]})
    assert alpaca_to_messages({**ALPACA, "input": None, "system": None})["messages"] == [
        {"role": "user", "content": "Add the numbers."}, {"role": "assistant", "content": "5"}]
    multi = {"instruction": "And now?", "output": "c", "system": "S", "history": [["q1", "a"], ["q2", "b"]]}
    assert alpaca_to_messages(multi)["messages"] == [
        {"role": "system", "content": "S"}, {"role": "user", "content": "q1"}, {"role": "assistant", "content": "a"},
        {"role": "user", "content": "q2"}, {"role": "assistant", "content": "b"},
        {"role": "user", "content": "And now?"}, {"role": "assistant", "content": "c"}]
    for history, match in (("q1", "^history: must be a list"), ([["q1"]], r"^history\[0\]: must be a"),
                           ([["q", "a"], ["q", 7]], r"^history\[1\]: must be a")):
        with pytest.raises(RecordFormatError, match=match):
            alpaca_to_messages({**multi, "history": history})
    weighted = {"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a", "weight": 0},
                                  {"from": "human", "value": "q2"}, {"from": "gpt", "value": "b"}]}
    assert [m.get("weight") for m in sharegpt_to_messages(weighted)["messages"]] == [None, 0, None, None]


def test_llama_factory_tools_as_json_text_and_bare_schemas_become_openai_tools():
    schema = {"name": "f", "description": "d", "parameters": {"type": "object", "properties": {}}}
    wrapped = [{"type": "function", "function": schema}]
    for tools in (json.dumps([schema]), [schema], wrapped, json.dumps(wrapped)):
        assert sharegpt_to_messages({**SHAREGPT, "tools": tools})["tools"] == wrapped
        assert alpaca_to_messages({**ALPACA, "tools": tools})["tools"] == wrapped
    with pytest.raises(RecordFormatError, match="^tools: a string must be the JSON of a list"):
        sharegpt_to_messages({**SHAREGPT, "tools": "f(x)"})
    for empty in ("", " "):  # LLaMA-Factory's "no tools"
        assert "tools" not in sharegpt_to_messages({**SHAREGPT, "tools": empty})
        assert "tools" not in alpaca_to_messages({**ALPACA, "tools": empty})
    for deep in ("[" * 100_000, "[" + "1" * 5000 + "]"):  # json raises RecursionError / ValueError: a rejection
        with pytest.raises(RecordFormatError, match=r"^tools: a string must be the JSON of a list of .* \("):
            sharegpt_to_messages({**SHAREGPT, "tools": deep})
    with pytest.raises(RecordFormatError, match="^tools: holds NaN"):
        alpaca_to_messages({**ALPACA, "tools": '[{"name": "f", "parameters": {"default": NaN}}]'})


def test_pack_llama_factory_records_tools_history_and_weights(tmp_path, tokenizer_dir):
    """LLaMA-Factory ShareGPT tool records (tools as JSON text of bare schemas) and multi-turn Alpaca pack; a
    ShareGPT ``weight: 0`` turn is not trained."""
    from packsft.data.dataset import PackedSFTDataset
    from packsft.tokenizer import load_tokenizer

    schema = {"name": "get_weather", "description": "Weather of a city",
              "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}
    tool_record = {"conversations": [
        {"from": "human", "value": "Weather in Paris?"},
        {"from": "function_call", "value": json.dumps({"name": "get_weather", "arguments": {"city": "Paris"}})},
        {"from": "observation", "value": "{\"temp\": 21}"}, {"from": "gpt", "value": "21 degrees."}],
        "tools": json.dumps([schema])}
    weighted = {"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "MASKED", "weight": 0},
                                  {"from": "human", "value": "q2"}, {"from": "gpt", "value": "TRAINED"}]}
    report, out = _pack(tmp_path, tokenizer_dir, [tool_record, weighted], record_format="sharegpt")
    assert report.packed_conversations == 2 and not report.rejected, report.rejected
    tok = load_tokenizer(tokenizer_dir("qwen2.5"))
    sample = PackedSFTDataset(str(out), tok, "chat-template", 256)[0]
    assert "Weather of a city" in tok.decode(sample["tokens"].tolist())  # the tools are rendered into the prompt
    labels = tok.decode(sample["labels"][sample["loss_mask"] > 0].tolist())
    assert "TRAINED" in labels and "MASKED" not in labels and "21 degrees." in labels, labels
    report, _ = _pack(tmp_path, tokenizer_dir, [{"instruction": "i", "output": "o", "history": [["q", "a"]]},
                                                {"instruction": "i", "output": "o", "input": 3}],
                      record_format="alpaca")
    assert report.packed_conversations == 1 and report.rejected[0]["line"] == 2
    assert report.rejected[0]["reason"].startswith("input: must be a string"), report.rejected
    with pytest.raises(ValueError, match="--input-key/--output-key read prompt/response records"):
        _pack(tmp_path, tokenizer_dir, [SHAREGPT], record_format="sharegpt", input_key="q", output_key="a")


def test_validation_errors_name_the_input_records_own_fields():
    assert source_field("sharegpt", {"conversations": []}, "messages[2].content") == "conversations[2].value"
    assert source_field("sharegpt", {"system": "s", "conversations": []}, "messages[2].role") == "conversations[1].from"
    assert source_field("sharegpt", {"system": "s", "conversations": []}, "messages[0].content") == "system"
    assert source_field("alpaca", {}, "messages[1].content") == "output"
    assert source_field("alpaca", {"system": "s"}, "messages[1].content") == "instruction"
    history = {"system": "s", "history": [["q", "a"], ["q", "a"]]}
    assert [source_field("alpaca", history, f"messages[{i}].content") for i in range(7)] == [
        "system", "history[0][0]", "history[0][1]", "history[1][0]", "history[1][1]", "instruction", "output"]
    assert source_field("messages", {}, "messages[1].content") == "messages[1].content"
    assert source_field("sharegpt", {}, "tools") == "tools"


def test_pack_reports_sharegpt_errors_by_conversations_index(tmp_path, tokenizer_dir):
    bad = {"conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": 7}]}
    report, _ = _pack(tmp_path, tokenizer_dir, [SHAREGPT, bad], record_format="sharegpt")
    assert report.rejected[0]["line"] == 2 and report.rejected[0]["reason"].startswith("conversations[1].value"), \
        report.rejected


NON_JSON_ADAPTER = '''
import numpy as np

def to_messages(record):
    user = {"role": "user", "content": record["q"]}
    if record["q"] == "numpy":
        user["id"] = np.int64(7)                       # e.g. a value taken from a pandas frame
    if record["q"] == "set":
        user["tags"] = {"a", "b"}
    if record["q"] == "nan":
        user["score"] = float("nan")                   # json.dumps writes NaN, which strict readers refuse
    return {"messages": [user, {"role": "assistant", "content": "yes"}]}
'''


def test_adapter_returning_non_json_values_rejects_the_line(tmp_path, tokenizer_dir, monkeypatch):
    _adapter_module(tmp_path, monkeypatch, "non_json_adapter", NON_JSON_ADAPTER)
    report, out = _pack(tmp_path, tokenizer_dir, [{"q": "ok"}, {"q": "numpy"}, {"q": "set"}, {"q": "nan"}],
                        adapter="non_json_adapter:to_messages")
    assert report.packed_conversations == 1                 # before: TypeError traceback, no output at all
    assert [(r["line"], "returned a record that is not JSON" in r["reason"]) for r in report.rejected] \
        == [(2, True), (3, True), (4, True)]
    assert len(out.read_text().splitlines()) == 1


def test_an_adapter_named_by_its_file_is_loaded_from_it(tmp_path):
    from packsft.record_formats import adapter_identity

    (tmp_path / "qa.py").write_text("def to_messages(r):\n"
                                    "    return {'messages': [{'role': 'user', 'content': r['q']}, "
                                    "{'role': 'assistant', 'content': r['a']}]}\n")
    pkg = tmp_path / "qa_files_pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("from .helpers import to_messages  # noqa: F401\n")
    (pkg / "helpers.py").write_text("def to_messages(r):\n    return {'messages': []}\n")
    by_file = import_adapter(f"{tmp_path / 'qa.py'}:to_messages")
    assert by_file({"q": "1?", "a": "1"})["messages"][1] == {"role": "assistant", "content": "1"}
    assert import_adapter(f"{pkg / '__init__.py'}:to_messages")({})["messages"] == []   # its relative import works
    assert len(adapter_identity(f"{tmp_path / 'qa.py'}:to_messages")["adapter_sha256"]) == 16
    with pytest.raises(ValueError, match=r"^--adapter '\S+nope.py:f' does not resolve \(no Python file "):
        import_adapter(f"{tmp_path / 'nope.py'}:f")
    for name in ("packsft_plugin_qa", "qa_files_pkg", "qa_files_pkg.helpers"):
        sys.modules.pop(name, None)
