"""Bounded work per conversation: a 50 MB line costs the packer and the loader what an ordinary line costs."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from packsft.data.dataset import PackedSFTDataset
from packsft.packing.config import MAX_CONVERSATION_BYTES, PackConfig
from packsft.packing.pipeline import run_pack
from packsft.packing.truncation import own_row_window

REPO = Path(__file__).resolve().parents[2]
TOK = "smollm2-135m-instruct"
MEASURE = """
import json, resource, sys, time
from packsft.packing import cli
t = time.perf_counter()
rc = cli.main(sys.argv[1:])
print(json.dumps({"rc": rc, "s": time.perf_counter() - t,
                  "rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
"""


def _line(i: int) -> str:
    return json.dumps({"messages": [{"role": "user", "content": f"q{i} " + "why " * 30},
                                    {"role": "assistant", "content": f"a{i} " + "ok " * 20}]})


def _big_line(nbytes: int) -> str:
    return json.dumps({"messages": [{"role": "user", "content": "tell me " + "words and more words " * (nbytes // 21)},
                                    {"role": "assistant", "content": "fine " * 100}]})


def _measure(src: Path, out: Path, tok: Path, *extra: str) -> dict:
    argv = ["--input", str(src), "--output", str(out), "--tokenizer", str(tok), "--max-seq-length", "1024",
            "--no-progress", "--histogram", "", *extra]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    t = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", MEASURE, *argv], capture_output=True, text=True, env=env,
                          cwd=REPO, timeout=600)
    return {**json.loads(done.stdout.strip().splitlines()[-1]), "wall_s": time.perf_counter() - t}


@pytest.mark.slow
def test_a_50mb_line_costs_the_packer_and_the_loader_what_an_ordinary_line_costs(tmp_path, tokenizer_dir):
    tok = tokenizer_dir(TOK)
    lines = [_line(i) for i in range(20)]
    small = tmp_path / "small.jsonl"
    small.write_text("\n".join(lines) + "\n")
    big = tmp_path / "big.jsonl"
    big.write_text("\n".join(lines[:10] + [_big_line(50_000_000)] + lines[11:]) + "\n")
    assert big.stat().st_size > 50_000_000
    ordinary = _measure(small, tmp_path / "s.jsonl.packed", tok)
    rejected = _measure(big, tmp_path / "r.jsonl.packed", tok)  # default --max-conversation-bytes: 4 MiB
    cut = _measure(big, tmp_path / "c.jsonl.packed", tok, "--max-conversation-bytes", str(64 << 20))
    print({"ordinary": ordinary, "rejected": rejected, "cut": cut})
    for m in (ordinary, rejected, cut):
        assert m["rc"] == 0
        assert m["rss_mb"] <= 2 * ordinary["rss_mb"], (m, ordinary)
        # the packer process, start to exit. Since the start no longer imports torch (seconds, not tens), the
        # 50 MB line's own fixed cost (one json.loads of 50 MB, a few cut tokenizations of ~L tokens) shows:
        # bounded by 2x an ordinary run or 20 s, where tokenizing the line whole would take minutes.
        assert m["wall_s"] <= 2 * max(ordinary["wall_s"], 10.0), (m, ordinary)
    report = json.loads((tmp_path / "r.jsonl.packed.report.json").read_text())
    assert [(r["line"], "more than --max-conversation-bytes 4194304" in r["reason"]) for r in report["rejected"]] \
        == [(11, True)]
    report = json.loads((tmp_path / "c.jsonl.packed.report.json").read_text())
    low, high = own_row_window(1024)
    [entry] = report["oversize"]
    assert entry["line"] == 11 and entry["cut_by_packer"] and low <= entry["tokens"] <= high
    assert entry["input_bytes"] == len(_big_line(50_000_000)) + 1
    # the stored row is small, and reading it costs what any row costs
    packed = tmp_path / "c.jsonl.packed"
    assert packed.stat().st_size < 100_000
    ds = PackedSFTDataset(packed, tok, "chat-template", 1024)
    t = time.perf_counter()
    items = [ds[i] for i in range(len(ds))]
    assert time.perf_counter() - t < 5.0
    assert all(item["tokens"].shape == (1024,) for item in items)


def test_max_conversation_bytes_rejects_before_parsing_and_is_exact(tmp_path, tokenizer_dir):
    assert MAX_CONVERSATION_BYTES == 4 << 20
    good = _line(0)
    src = tmp_path / "in.jsonl"
    src.write_text("\n".join([good, _line(1) + " " * 50, "{not json" + " " * 300, good]) + "\n")
    limit = len(good.encode()) + 10
    report = run_pack(PackConfig(inputs=[str(src)], output=str(tmp_path / "o.jsonl.packed"),
                                 tokenizer=str(tokenizer_dir(TOK)), max_seq_len=256, progress=False, histogram="",
                                 max_conversation_bytes=limit))
    assert [(r["line"], f"more than --max-conversation-bytes {limit}" in r["reason"]) for r in report.rejected] \
        == [(2, True), (3, True)]
    assert report.rejected[0]["reason"].startswith(f"line has {len(_line(1)) + 50} bytes,")  # not its newline
    assert report.packed_conversations == 2


@pytest.mark.parametrize("train_on", ["all", "last"])
def test_own_row_cut_keeps_a_prefix_within_the_window(tmp_path, tokenizer_dir, train_on):
    tok = tokenizer_dir(TOK)
    turns = []
    for i in range(40):
        turns += [{"role": "user", "content": f"question {i} " + "why " * 20},
                  {"role": "assistant", "content": f"answer {i} " + "because " * 20}]
    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps({"messages": turns}) + "\n" + _line(0) + "\n")
    out = tmp_path / "o.jsonl.packed"
    report = run_pack(PackConfig(inputs=[str(src)], output=str(out), tokenizer=str(tok), max_seq_len=256,
                                 progress=False, histogram="", train_on=train_on))
    [entry] = report.oversize
    low, high = own_row_window(256)
    assert entry["cut_by_packer"] and low <= entry["tokens"] <= high
    rows = [json.loads(line)["messages"] for line in out.read_text().splitlines()]
    stored = next(r for r in rows if len(r) > 3)
    if train_on == "last":  # the kept assistant turns are marked context only
        assert all(m.get("weight") == 0 for m in stored if m["role"] == "assistant")
        stored = [{k: v for k, v in m.items() if k != "weight"} for m in stored]
    assert stored[1:-1] == turns[: len(stored) - 2]
    assert turns[len(stored) - 2]["content"].startswith(stored[-1]["content"])
    ds = PackedSFTDataset(out, tok, "chat-template", 256)
    item = ds[next(i for i, r in enumerate(rows) if len(r) > 3)]
    if train_on == "all":
        assert item["num_trained_tokens"] > 0
    else:  # the last assistant turn lies beyond the cut: nothing is trained, as the loader's truncation would
        assert item["num_trained_tokens"] == 0
        assert [w["kind"] for w in report.warnings] == ["truncation_removes_training"]


def test_the_row_writer_reads_the_spools_without_keeping_them_resident(tmp_path):
    """Rows gather conversations from anywhere in the spools; the writer's resident set stays that of one group of
    rows (a memory map of the spools kept every page it touched: about 800 bytes per conversation)."""
    import random
    from types import SimpleNamespace

    import numpy as np
    import psutil

    from packsft.packing.rows import write_row_range

    n, size = 48_000, 1024  # 47 MiB of spool, one conversation per KiB
    path = tmp_path / "spool"
    with open(path, "wb") as f:
        for i in range(n):
            f.write(b"[" + str(i).encode().rjust(size - 2, b" ") + b"]")
    order = np.asarray(random.Random(0).sample(range(n), n), dtype=np.int64)  # rows read all over the spool
    starts = np.arange(0, n, 4, dtype=np.int64)
    counted = SimpleNamespace(spools=[str(path)], token_spools=None, spool=np.zeros(n, np.int64),
                              offset=np.arange(n, dtype=np.int64) * size, size=np.full(n, size, np.int64))
    written, peak, me = [0], [0], psutil.Process()

    def sink(data: bytes) -> None:  # called once per group, while the spools are open
        written[0] += len(data)
        peak[0] = max(peak[0], me.memory_info().rss)

    before = me.memory_info().rss
    write_row_range(order, starts, counted, 0, len(starts), SimpleNamespace(write=sink), None, np, block=1024)
    assert written[0] > n * (size - 2) and peak[0] - before < 16 << 20, peak[0] - before


def test_own_row_cut_never_puts_tool_calls_after_a_cut_content(tmp_path, tokenizer_dir):
    """A turn's tool calls follow its content in the rendering: cutting the content and keeping the calls would
    train a reply the assistant never gave ("Let" + the calls). The row must train what the loader's truncation
    of the whole conversation trains."""
    from packsft.prompt_formats import Tokenization, get_prompt_format, tokenize_conversation
    from packsft.tokenizer import load_tokenizer

    tok_dir = tokenizer_dir("qwen2.5")
    tools = [{"type": "function", "function": {"name": "weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}}]
    calls = [{"id": f"call0000{i}", "type": "function", "function": {
        "name": "weather", "arguments": json.dumps({"city": f"City number {i} in the list of cities to look up"})}}
        for i in range(6)]
    messages = [{"role": "system", "content": ""}, {"role": "user", "content": "Weather?"},
                {"role": "assistant", "content": "Let me think. " + " ".join(f"word{i}" for i in range(2000)),
                 "tool_calls": calls}]
    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps({"messages": messages, "tools": tools}) + "\n")
    out = tmp_path / "o.jsonl.packed"
    L = 256
    run_pack(PackConfig(inputs=[str(src)], output=str(out), tokenizer=str(tok_dir), max_seq_len=L,
                        progress=False, histogram=""))
    tok = load_tokenizer(tok_dir)
    tokens, targets = tokenize_conversation(messages, Tokenization.of(tok, get_prompt_format("chat-template", tok)),
                                            tools)
    item = PackedSFTDataset(out, tok, "chat-template", L)[0]
    assert item["tokens"].tolist() == tokens[:L]
    assert item["labels"].tolist()[: L - 1] == targets[1:L]
