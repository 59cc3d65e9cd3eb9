"""Pack inputs from Hugging Face datasets saved on disk, Parquet and Arrow files: the same rows as from JSONL,
errors located by row index, the input's identity in the sidecar, a clear error without the extra."""

import json
import sys

import pytest

datasets = pytest.importorskip("datasets")
pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

from packsft.packing import cli  # noqa: E402
from packsft.packing.config import PackConfig, PackError  # noqa: E402
from packsft.packing.pipeline import run_pack  # noqa: E402
from packsft.packing.shards import plan_shards  # noqa: E402
from packsft.packing.sources import SourceError, iter_source  # noqa: E402
from packsft.sidecar import read_sidecar  # noqa: E402
from packsft.token_cache import cache_paths  # noqa: E402

CALL = {"id": "call00000", "type": "function", "function": {"name": "add", "arguments": "{\"a\": 2, \"b\": 3}"}}
TOOL = {"type": "function", "function": {"name": "add", "description": "Add two numbers.",
                                         "parameters": {"type": "object", "properties": {"a": {"type": "number"}}}}}
# Key order as Arrow's schema gives it back (role, content, tool_calls, tool_call_id, weight), so the bytes can match.
RECORDS = [
    {"messages": [{"role": "user", "content": "What is 2+3?"},
                  {"role": "assistant", "content": None, "tool_calls": [CALL]},
                  {"role": "tool", "content": "5", "tool_call_id": "call00000"},
                  {"role": "assistant", "content": "It is 5."}], "tools": [TOOL]},
    {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                  {"role": "assistant", "content": "Hello!", "weight": 0}, {"role": "user", "content": "Again"},
                  {"role": "assistant", "content": "Hello again!"}]},
    {"messages": [{"role": "user", "content": "Capital of France?"}, {"role": "assistant", "content": "Paris."}]},
]


def _pack(tmp_path, tokenizer_dir, inputs, name="o", tokenizer="smollm2-135m-instruct", **cfg):
    """Pack ``inputs``; SmolLM2's tokenizer loads fastest, Qwen2.5's template renders tool calls."""
    out = tmp_path / f"{name}.jsonl.packed"
    cfg = {"max_seq_len": 256, **cfg}
    report = run_pack(PackConfig(inputs=[str(p) for p in inputs], output=str(out), tokenizer=str(tokenizer_dir(
        tokenizer)), progress=False, histogram="", **cfg))
    return report, out


def _jsonl(path, records):
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))
    return path


@pytest.mark.slow
def test_every_row_source_packs_the_rows_jsonl_gives(tmp_path, tokenizer_dir):
    ds = datasets.Dataset.from_list(RECORDS)
    ds.save_to_disk(str(tmp_path / "ds"))
    datasets.DatasetDict({"train": ds, "test": ds.select([0])}).save_to_disk(str(tmp_path / "dd"))
    ds.to_parquet(str(tmp_path / "t.parquet"))
    with pa.OSFile(str(tmp_path / "t_file.arrow"), "wb") as f:       # Arrow IPC *file* format (Feather v2)
        with pa.ipc.new_file(f, ds.data.table.schema) as w:
            w.write_table(ds.data.table)
    stream = next((tmp_path / "ds").glob("data-*.arrow"))            # datasets' own IPC *stream* file
    jsonl = _jsonl(tmp_path / "t.jsonl", RECORDS)
    _, ref = _pack(tmp_path, tokenizer_dir, [jsonl], "ref", "qwen2.5")
    expected = ref.read_bytes()
    assert b'"tool_calls": null' not in expected and expected.count(b'"content": null') == 1
    report, out = _pack(tmp_path, tokenizer_dir, [tmp_path / "ds"], "ds", "qwen2.5")
    assert out.read_bytes() == expected
    assert report.packed_conversations == 3 and not report.rejected and not report.warnings
    # the packer's rows are a function of these texts: every other source yields the same ones
    texts = [t for _, _, t, _ in iter_source(tmp_path / "ds")]
    assert texts == [json.dumps(r, ensure_ascii=False) for r in RECORDS]
    for src, split in ((tmp_path / "dd", "train"), (tmp_path / "t.parquet", None), (stream, None),
                       (tmp_path / "t_file.arrow", None)):
        items = list(iter_source(src, split=split))
        assert [t for _, _, t, _ in items] == texts, src
        assert [(i, n) for i, n, _, _ in items] == [(i, len(t.encode())) for i, t in enumerate(texts)], src
    _pack(tmp_path, tokenizer_dir, [tmp_path / "dd", tmp_path / "t.parquet"], "dd", split="train")
    meta = read_sidecar(tmp_path / "dd.jsonl.packed")
    ident = meta["input_identity"][str(tmp_path / "dd")]
    assert meta["split"] == "train" and ident["kind"] == "dataset" and ident["split"] == "train"
    assert ident["num_rows"] == 3 and ident["fingerprint"] == json.loads((tmp_path / "dd/train/state.json")
                                                                          .read_text())["_fingerprint"]
    assert [f["name"] for f in ident["files"]][:3] == ["dataset_dict.json", "train/state.json",
                                                       "train/dataset_info.json"]
    assert all(len(f["blake2b"]) == 40 and f["size"] > 0 for f in ident["files"])
    parquet = meta["input_identity"][str(tmp_path / "t.parquet")]
    assert parquet["kind"] == "parquet" and parquet["num_rows"] == 3
    assert parquet["files"][0]["size"] == (tmp_path / "t.parquet").stat().st_size
    assert "input_identity" not in read_sidecar(ref)


def test_real_tool_records_read_back_from_parquet_up_to_key_order(tmp_path, shared_data):
    """Arrow unifies the struct of every message and tool schema (nulls for the fields a record lacks); the
    records read back equal the JSONL ones, only key order follows the schema."""
    path = shared_data / "tools" / "glaive_toolcall_en_demo.messages.jsonl"
    records = [json.loads(x) for x in path.read_text().splitlines()[:60]]
    datasets.Dataset.from_list(records).to_parquet(str(tmp_path / "g.parquet"))
    texts = [t for _, _, t, _ in iter_source(tmp_path / "g.parquet")]
    assert [json.loads(t) for t in texts] == records
    assert sum(t != json.dumps(r, ensure_ascii=False) for t, r in zip(texts, records)) > 0  # order does differ


@pytest.mark.slow
def test_record_formats_and_adapters_read_rows(tmp_path, tokenizer_dir, monkeypatch):
    sharegpt = [{"conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello!"}]}]
    alpaca = [{"instruction": "Add.", "input": "2 and 3", "output": "5"}, {"instruction": "Hi", "input": None,
                                                                            "output": "Yo"}]
    qa = [{"q": "2+2?", "a": "4"}, {"q": "boom", "a": ""}]
    pkg = tmp_path / "adapters"
    pkg.mkdir()
    (pkg / "row_adapter.py").write_text(
        "def to_messages(r):\n    if r['q'] == 'boom':\n        raise KeyError('no answer')\n"
        "    return {'messages': [{'role': 'user', 'content': r['q']}, {'role': 'assistant', 'content': r['a']}]}\n")
    monkeypatch.syspath_prepend(str(pkg))
    sys.modules.pop("row_adapter", None)
    for name, records, cfg in (("sharegpt", sharegpt, {"record_format": "sharegpt"}),
                               ("alpaca", alpaca, {"record_format": "alpaca"}),
                               ("io", qa[:1], {"record_format": "input-output", "input_key": "q", "output_key": "a"}),
                               ("adapter", qa, {"adapter": "row_adapter:to_messages"})):
        pq.write_table(pa.Table.from_pylist(records), str(tmp_path / f"{name}.parquet"))  # null `input` too
        ref_report, ref = _pack(tmp_path, tokenizer_dir, [_jsonl(tmp_path / f"{name}.jsonl", records)], "r", **cfg)
        report, out = _pack(tmp_path, tokenizer_dir, [tmp_path / f"{name}.parquet"], name, **cfg)
        assert out.read_bytes() == ref.read_bytes(), name
        assert report.packed_conversations == ref_report.packed_conversations >= 1, name
    assert report.rejected == [{"input": str(tmp_path / "adapter.parquet"), "row": 1,
                                "reason": ref_report.rejected[0]["reason"]}]
    assert ref_report.rejected[0]["line"] == 2          # JSONL: 1-based line; rows: 0-based index


@pytest.mark.slow
def test_bad_rows_are_reported_by_row_index(tmp_path, tokenizer_dir, capsys):
    records = [RECORDS[2], RECORDS[2],
               {"messages": [{"role": "user", "content": "x"}, {"role": "bot", "content": "y"}]},
               {"messages": [{"role": "user", "content": "long " * 200}, {"role": "assistant", "content": "ok"}]},
               {"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y", "weight": 0}]}]
    src = tmp_path / "data" / "train-00000.parquet"
    src.parent.mkdir()
    pq.write_table(pa.Table.from_pylist(records), str(src), row_group_size=2)
    with pytest.warns(UserWarning, match=rf"{src}: row 4: conversation has no trained token"):
        report, _ = _pack(tmp_path, tokenizer_dir, [src], max_conversation_bytes=600)
    size = len(json.dumps(records[3]))
    assert [(r["row"], r["reason"].split(":")[0]) for r in report.rejected] == [
        (2, "messages[1].role"), (3, f"row's JSON has {size} bytes, more than --max-conversation-bytes 600; not "
                                     "tokenized")]
    assert all("line" not in r for r in report.rejected + report.warnings)
    assert [(w["row"], w["kind"]) for w in report.warnings] == [(4, "no_trained_token")]
    assert f"rejected {src}: row 2: messages[1].role: unknown role 'bot'" in report.summary()
    with pytest.raises(PackError, match=rf"{src}: row 2: messages\[1\].role: unknown role 'bot'"):
        _pack(tmp_path, tokenizer_dir, [src], strict=True)
    with pytest.raises(PackError, match=rf"{src}: row 3: conversation has \d+ tokens"):
        _pack(tmp_path, tokenizer_dir, [src], oversize="error", max_seq_len=64)
    blob = tmp_path / "blob.parquet"
    pq.write_table(pa.table({"messages": [RECORDS[2]["messages"]], "image": [b"\xff\xd8\xff"]}), str(blob))
    assert [t[2:] for t in iter_source(blob)] == [(None, "the row holds binary data that is not UTF-8 text; "
                                                         "not tokenized")]
    (tmp_path / "broken.parquet").write_bytes(b"PAR1 not really")
    assert cli.main(["--input", str(tmp_path / "broken.parquet"), "--output", str(tmp_path / "b.jsonl.packed"),
                     "--tokenizer", str(tokenizer_dir("smollm2-135m-instruct")), "--max-seq-length", "256",
                     "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert f"error: {tmp_path / 'broken.parquet'}: before its first row: cannot be read as a Parquet file" in err


def test_dataset_dict_needs_a_split_and_folders_must_be_datasets(tmp_path, tokenizer_dir, capsys):
    ds = datasets.Dataset.from_list(RECORDS)
    datasets.DatasetDict({"train": ds, "validation": ds}).save_to_disk(str(tmp_path / "dd"))
    args = ["--output", str(tmp_path / "o.jsonl.packed"), "--tokenizer", str(tokenizer_dir("smollm2-135m-instruct")),
            "--max-seq-length", "256", "--no-progress", "--histogram", ""]
    assert cli.main(["--input", str(tmp_path / "dd"), *args]) == 2
    assert "is a DatasetDict (splits: train, validation): pick one with --split NAME" in capsys.readouterr().err
    assert cli.main(["--input", str(tmp_path / "dd"), "--split", "test", *args]) == 2
    assert "--split 'test': " in capsys.readouterr().err
    assert cli.main(["--input", str(tmp_path / "dd"), "--split", "validation", *args]) == 0
    ds.to_parquet(str(tmp_path / "t.parquet"))
    assert cli.main(["--input", str(tmp_path / "t.parquet"), "--split", "train", *args]) == 2
    assert "no --input is a DatasetDict folder" in capsys.readouterr().err
    (tmp_path / "plain").mkdir()
    assert cli.main(["--input", str(tmp_path / "plain"), *args]) == 2
    assert "without state.json or dataset_dict.json" in capsys.readouterr().err


@pytest.mark.parametrize("kind", ["gzip", "zstd-like", "parquet"])
def test_a_compressed_or_columnar_file_given_as_jsonl_is_refused(tmp_path, kind):
    """Its bytes were split at newlines into fake lines, each rejected as not UTF-8: next to a JSONL file the run
    exited 0 with a wrong input count."""
    import gzip

    path = tmp_path / "chats.jsonl.gz"
    text = _jsonl(tmp_path / "t.jsonl", RECORDS).read_bytes()
    if kind == "gzip":
        path.write_bytes(gzip.compress(text))
    elif kind == "zstd-like":
        path.write_bytes(b"\x28\xb5\x2f\xfd" + text)        # zstd's frame magic
    else:
        datasets.Dataset.from_list(RECORDS).to_parquet(str(path))
    cfg = PackConfig(inputs=[str(tmp_path / "t.jsonl"), str(path)], output=str(tmp_path / "o.jsonl.packed"),
                     tokenizer="unused", max_seq_len=256)
    word = {"gzip": "gzip-compressed", "zstd-like": "zstd-compressed", "parquet": "a Parquet file"}[kind]
    with pytest.raises(SourceError, match=f"--input {path}: {word}, not JSONL text"):
        cfg.validate()


@pytest.mark.parametrize("missing", ["pyarrow", "datasets"])
def test_missing_extra_names_it(tmp_path, monkeypatch, missing):
    ds = datasets.Dataset.from_list(RECORDS)
    ds.save_to_disk(str(tmp_path / "ds"))
    ds.to_parquet(str(tmp_path / "t.parquet"))
    _jsonl(tmp_path / "t.jsonl", RECORDS)
    monkeypatch.setitem(sys.modules, missing, None)                 # `import missing` now raises ImportError
    src = tmp_path / ("t.parquet" if missing == "pyarrow" else "ds")
    cfg = PackConfig(inputs=[str(src)], output=str(tmp_path / "o.jsonl.packed"), tokenizer="unused", max_seq_len=256)
    with pytest.raises(SourceError, match=r"needs the packsft\[datasets\] extra: pip install"):
        cfg.validate()
    PackConfig(inputs=[str(tmp_path / "t.jsonl")], output=str(tmp_path / "o.jsonl.packed"), tokenizer="unused",
               max_seq_len=256).validate()                          # JSONL needs neither


@pytest.mark.slow
def test_row_sources_among_jsonl_shards_pack_the_same_with_workers(tmp_path, tokenizer_dir):
    """A row source is one shard of its own between the JSONL inputs' byte shards: rows, token cache, sidecar
    and report entries (by line and by row) are the same with 0 and 2 workers; an unreadable row source read by
    a worker fails the run naming it."""
    bad = {"messages": [{"role": "user", "content": "x"}, {"role": "bot", "content": "y"}]}
    first = _jsonl(tmp_path / "a.jsonl", [RECORDS[2], RECORDS[1]] * 6 + [bad] + [RECORDS[2]] * 6)
    rows = tmp_path / "b.parquet"
    pq.write_table(pa.Table.from_pylist([RECORDS[2], bad, RECORDS[1]]), str(rows), row_group_size=2)
    last = _jsonl(tmp_path / "c.jsonl", [RECORDS[1], bad])
    got = []
    for workers in (0, 2):
        report, out = _pack(tmp_path / f"w{workers}", tokenizer_dir, [first, rows, last], num_workers=workers,
                            shard_bytes=400)
        got.append((out.read_bytes(), out.with_name(out.name + ".meta.json").read_bytes(),
                    *(p.read_bytes() for p in cache_paths(out)), report.rejected, report.per_input))
    assert got[0] == got[1]
    assert len(plan_shards([str(first), str(rows), str(last)], 400)) >= 5
    assert [(r["input"], r.get("line"), r.get("row")) for r in got[0][-2]] == [
        (str(first), 13, None), (str(rows), None, 1), (str(last), 2, None)]
    (tmp_path / "broken.parquet").write_bytes(b"PAR1 not really")
    with pytest.raises(SourceError, match=r"broken.parquet: before its first row: cannot be read as a Parquet file"):
        _pack(tmp_path, tokenizer_dir, [first, tmp_path / "broken.parquet"], "broken", num_workers=2)
