"""Fuzz the packer with random and mutated JSONL: it never crashes, accounts for every line, writes complete sets."""

import json
from pathlib import Path

import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, example, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from test_dataset import load_cached, packer_loads_each_tokenizer_once  # noqa: E402, F401 - fixture

from packsft.data.dataset import PackedSFTDataset  # noqa: E402
from packsft.packing.config import PackConfig, PackError  # noqa: E402
from packsft.packing.pipeline import run_pack  # noqa: E402
from packsft.sidecar import check_rows_file, read_sidecar  # noqa: E402

TOK = "smollm2-135m-instruct"
L = 64
MAX_BYTES = 3000

text = st.text(st.characters(blacklist_categories=("Cs",)), max_size=40)
scalar = st.one_of(st.none(), st.booleans(), st.integers(-3, 3), st.floats(allow_nan=False), text)
junk = st.recursive(scalar, lambda c: st.lists(c, max_size=3) | st.dictionaries(text, c, max_size=3), max_leaves=6)
role = st.sampled_from(["system", "user", "assistant", "tool", "bot", "", "USER"]) | text
message = st.fixed_dictionaries(
    {"role": role, "content": st.one_of(text, st.just("long " * 120), st.none(), junk)},
    optional={"weight": st.sampled_from([0, 1, 2, True]),
              "tool_calls": st.just([{"type": "function", "function": {"name": "f", "arguments": "{}"}}]) | junk})
good = st.lists(st.tuples(text.filter(str.strip), text.filter(str.strip)), min_size=1, max_size=3).map(
    lambda turns: {"messages": [m for u, a in turns for m in ({"role": "user", "content": u},
                                                              {"role": "assistant", "content": a})]})
record = st.one_of(good, st.fixed_dictionaries({"messages": st.lists(message, max_size=5)}),
                   st.dictionaries(text, junk, max_size=3), junk)


def _encode(rec) -> bytes:
    return json.dumps(rec, ensure_ascii=False).encode("utf-8")


line = st.one_of(
    record.map(_encode),
    good.map(lambda r: _encode(r)[:-1]),  # truncated JSON
    good.map(lambda r: _encode(r).replace(b'"', b"'", 1)),  # mutated
    st.binary(max_size=60).map(lambda b: b.replace(b"\n", b"")),  # bytes, often not UTF-8
    good.map(lambda r: _encode(r).decode().encode("utf-16")).map(lambda b: b.replace(b"\n", b"")),  # UTF-16
    st.just(b"   "),  # blank
    good.map(lambda r: _encode({"messages": r["messages"] + [{"role": "user", "content": "x" * MAX_BYTES}]})),
)


@pytest.mark.slow
@settings(max_examples=30, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                 HealthCheck.too_slow])
@given(lines=st.lists(line, min_size=1, max_size=12), oversize=st.sampled_from(["own-row", "drop"]),
       crlf=st.booleans())
@example(lines=[b'{"messages": [{"role": "user", "content": ""}]}'], oversize="own-row", crlf=False)  # trains nothing
def test_random_jsonl_is_packed_or_reported_line_by_line(tmp_path_factory, tokenizer_dir, lines, oversize, crlf):
    d = tmp_path_factory.mktemp("fuzz")
    src = d / "in.jsonl"
    src.write_bytes(b"".join(x + (b"\r\n" if crlf else b"\n") for x in lines))
    numbered = [k for k, raw in enumerate(lines, start=1) if not _blank(raw)]
    out = d / "o.jsonl.packed"
    cfg = PackConfig(inputs=[str(src)], output=str(out), tokenizer=str(tokenizer_dir(TOK)), max_seq_len=L,
                     oversize=oversize, progress=False, histogram="", max_conversation_bytes=MAX_BYTES)
    try:
        report = run_pack(cfg)
    except PackError as e:  # nothing packable, or nothing trained in what is: no output at all
        assert str(e).startswith(("no conversation to pack", "nothing to train")), e
        assert sorted(p.name for p in Path(d).iterdir()) == [".o.jsonl.packed.lock", "in.jsonl"]
        return
    rejected = [r["line"] for r in report.rejected]
    dropped = [o["line"] for o in report.oversize if o["action"] == "dropped"]
    assert report.input_conversations == len(numbered)
    assert sorted(rejected + dropped) == sorted(set(rejected + dropped)) and set(rejected + dropped) <= set(numbered)
    assert report.packed_conversations == len(numbered) - len(rejected) - len(dropped) > 0
    assert all(r["reason"] for r in report.rejected)
    meta = read_sidecar(out)
    assert check_rows_file(meta, out, verify_hash=True)
    assert meta["counts"]["packed_conversations"] == report.packed_conversations
    ds = PackedSFTDataset(out, load_cached(tokenizer_dir(TOK)), "chat-template", L)
    assert len(ds) == report.rows
    assert sum(len(ds.tokenize_row(i)) for i in range(len(ds))) == report.packed_conversations
    for i in range(len(ds)):
        assert ds[i]["tokens"].shape == (L,)


def _blank(raw: bytes) -> bool:
    try:
        return not raw.decode("utf-8").strip()
    except UnicodeDecodeError:
        return False
