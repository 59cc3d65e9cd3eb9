import functools
import json
import os
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from packsft.conversation import parse_record, split_row
from packsft.layout import conversation_cost
from packsft.packing.config import PackConfig, PackError
from packsft.packing.pipeline import run_pack
from packsft.packing.shards import plan_shards
from packsft.packing.truncation import own_row_window
from packsft.prompt_formats import Tokenization, count_conversation_tokens, get_prompt_format
from packsft.token_cache import cache_paths
from packsft.tokenizer import load_tokenizer

REPO = Path(__file__).resolve().parents[2]


def _head(src: Path, dst: Path, n: int) -> Path:
    with open(src) as f, open(dst, "w") as g:
        for _, line in zip(range(n), f):
            g.write(line)
    return dst


@functools.cache
def _tokenizer(path: str):
    """The tokenizer at ``path``, loaded once for this file's own counts (the packer runs load theirs)."""
    return load_tokenizer(path)


@pytest.fixture(scope="module", autouse=True)
def _forget_tokenizers():
    yield
    _tokenizer.cache_clear()


def _canon(messages) -> str:
    return json.dumps(messages, sort_keys=True, ensure_ascii=False)


def _check_invariants(cfg: PackConfig, report):
    """Every input line is in exactly one row or in the report; rows fit; counts are the loader's."""
    tok = _tokenizer(cfg.tokenizer)
    fmt = get_prompt_format(cfg.prompt_format, tok, pad_token=cfg.pad_token)
    rejected = {(r["input"], r["line"]) for r in report.rejected}
    dropped = {(o["input"], o["line"]) for o in report.oversize if o["action"] == "dropped"}
    cut = {(o["input"], o["line"]) for o in report.oversize if o.get("cut_by_packer")}
    cut_originals = []  # own-row conversations the packer cut: stored as a cut of these (_is_cut_of)
    expected = Counter()
    n_lines = 0
    for path in cfg.inputs:
        with open(path, encoding="utf-8-sig") as f:
            for line_no, text in enumerate(f, start=1):
                if not text.strip():
                    continue
                n_lines += 1
                if (path, line_no) in rejected or (path, line_no) in dropped:
                    continue
                conv = parse_record(json.loads(text), path, line_no,
                                    default_system_prompt=cfg.default_system_prompt)
                if (path, line_no) in cut:
                    cut_originals.append(conv.to_row_messages())
                    continue
                expected[_canon(conv.to_row_messages())] += 1
    assert report.input_conversations == n_lines
    got = Counter()
    real = 0
    with open(cfg.output, encoding="utf-8") as f:
        rows = [json.loads(line) for line in f]
    assert len(rows) == report.rows
    for row in rows:
        assert list(row) == ["messages"]
        convs = split_row(row["messages"])
        lengths = [count_conversation_tokens(c.messages, Tokenization.of(tok, fmt), c.tools) for c in convs]
        cost = sum(conversation_cost(n, cfg.context_parallel_size) for n in lengths)
        assert cost <= cfg.max_seq_len or len(convs) == 1  # an oversize conversation gets its own row
        real += sum(min(n, cfg.max_seq_len) for n in lengths)
        for c, n in zip(convs, lengths):
            stored = c.to_row_messages()
            match = next((k for k, o in enumerate(cut_originals) if _is_cut_of(stored, o)), None)
            if match is not None and _canon(stored) not in expected:
                low, high = own_row_window(cfg.max_seq_len)
                assert len(convs) == 1 and low <= n <= high, (n, low, high)
                cut_originals.pop(match)
                continue
            got[_canon(stored)] += 1
    assert got == expected
    assert cut_originals == []  # every cut conversation is stored, once
    assert real == report.real_tokens
    assert report.padding_tokens == report.rows * cfg.max_seq_len - report.real_tokens


def _is_cut_of(stored, original) -> bool:
    """``stored`` is a prefix of ``original``'s messages, its last one with a prefix of the content."""
    if not 0 < len(stored) <= len(original):
        return False
    for k, (s, o) in enumerate(zip(stored, original)):
        if k < len(stored) - 1 and s != o:
            return False
    s, o = stored[-1], original[len(stored) - 1]
    rest = lambda m: {key: v for key, v in m.items() if key != "content"}  # noqa: E731
    return rest(s) == rest(o) and (s.get("content") or "") == (o.get("content") or "")[:len(s.get("content") or "")]


@pytest.mark.slow
@pytest.mark.parametrize(
    "tokenizer, fmt, datasets, cp",
    [
        ("qwen2.5", "chat-template", ["chat/gsm8k_test", "tools/glaive_toolcall_en_demo"], 1),
        ("smollm2-135m-instruct", "chat-template", ["chat/chitchat", "tools/bfcl_v4_ast"], 2),
        ("mistral-nemo", "identity", ["chat/hh_rlhf_harmless_base_test", "tools/glaive_toolcall_en_demo"], 4),
        ("nemotron-h-layout-tekken", "nemotron-nano-v2", ["chat/gpteacher", "tools/glaive_toolcall_en_demo"], 1),
        ("nemotron-h-layout-tekken", "nemotron-h-aligned", ["chat/gsm8k_train", "chat/chitchat"], 2),
    ],
)
def test_real_data_every_conversation_lands_once(tmp_path, shared_data, tokenizer, fmt, datasets, cp):
    inputs = [str(_head(shared_data / f"{d}.messages.jsonl", tmp_path / f"{i}.jsonl", 80))
              for i, d in enumerate(datasets)]
    cfg = PackConfig(inputs=inputs, output=str(tmp_path / "rows.jsonl.packed"),
                     tokenizer=str(shared_data / "tokenizers" / tokenizer), max_seq_len=2048, prompt_format=fmt,
                     context_parallel_size=cp, progress=False, histogram="")
    report = run_pack(cfg)
    assert report.rows > 0 and report.packed_conversations > 0
    _check_invariants(cfg, report)
    meta = json.loads(Path(cfg.output + ".meta.json").read_text())
    assert meta["context_parallel_size"] == cp and meta["prompt_format"]["name"] == fmt
    assert meta["counts"]["rows"] == report.rows


def _write_lines(path: Path, lines: list) -> Path:
    with open(path, "wb") as f:
        for line in lines:
            f.write((line if isinstance(line, str) else json.dumps(line, ensure_ascii=False)).encode() + b"\r\n")
    return path


EDGE_LINES = [
    {"messages": [{"role": "user", "content": "héllo 🙂"}, {"role": "assistant", "content": "ça va 東京"}]},
    "{not json",
    {"messages": [{"role": "user", "content": "a"}, {"role": "wizard", "content": "b"}]},
    {"messages": [{"role": "user", "content": 3}]},
    {"messages": [{"role": "user", "content": "   "}, {"role": "assistant", "content": "ok"}]},
    {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "  "}]},
    {"messages": [{"role": "system", "content": "sys"}, {"role": "user", "content": "q"},
                  {"role": "assistant", "content": None,
                   "tool_calls": [{"id": "call00001", "type": "function",
                                   "function": {"name": "f", "arguments": {"x": 1}}}]},
                  {"role": "tool", "tool_call_id": "call00001", "content": "2"},
                  {"role": "assistant", "content": "two"}],
     "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]},
    {"messages": [{"role": "user", "content": "q"},
                  {"role": "assistant", "content": None,
                   "tool_calls": [{"function": {"name": "f", "arguments": "{\"x\": 1}"}}]},
                  {"role": "tool", "content": "2"}, {"role": "assistant", "content": "two"}]},
    "",
    {"messages": [{"role": "user", "content": "long " * 400}, {"role": "assistant", "content": "x"}]},
    r'{"messages": [{"role": "user", "content": "x\ud800"}, {"role": "assistant", "content": "y"}]}',
    '{"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}], "tools": '
    '[{"type": "function", "function": {"name": "f", "parameters": {"type": "number", "default": NaN}}}]}',
]


def test_edge_cases_get_their_documented_result(tmp_path, tokenizer_dir):
    src = _write_lines(tmp_path / "edge.jsonl", EDGE_LINES)
    src.write_bytes(b"\xef\xbb\xbf" + src.read_bytes())  # a byte order mark (Windows tools) before line 1
    cfg = PackConfig(inputs=[str(src)], output=str(tmp_path / "o.jsonl.packed"),
                     tokenizer=str(tokenizer_dir("qwen2.5")), max_seq_len=256, progress=False, histogram="")
    report = run_pack(cfg)
    reasons = {r["line"]: r["reason"] for r in report.rejected}
    assert "not valid JSON" in reasons[2]
    assert "messages[1].role: unknown role 'wizard'" in reasons[3]
    assert "messages[0].content: must be a string" in reasons[4]
    assert "chat-template: messages[1]: empty assistant turn" in reasons[6]  # the input's own index
    assert reasons[11].startswith("messages[0].content: a \\u escape of a lone UTF-16 surrogate")
    assert reasons[12].startswith("tools[0].function.parameters.default: NaN / Infinity, or a number beyond")
    assert set(reasons) == {2, 3, 4, 6, 11, 12}
    assert [(o["line"], o["action"]) for o in report.oversize] == [(10, "own row, truncated by the loader")]
    # its only assistant turn lies beyond the cut: warned at pack time
    assert [(w["line"], w["kind"]) for w in report.warnings] == [(10, "truncation_removes_training")]
    assert report.input_conversations == 11  # the blank line is not a conversation
    _check_invariants(cfg, report)


def test_oversize_drop_and_error_and_strict(tmp_path, tokenizer_dir):
    src = _write_lines(tmp_path / "edge.jsonl", EDGE_LINES)
    base = dict(inputs=[str(src)], tokenizer=str(tokenizer_dir("qwen2.5")), max_seq_len=256, progress=False,
                histogram="")
    report = run_pack(PackConfig(output=str(tmp_path / "d.jsonl.packed"), oversize="drop", **base))
    assert [(o["line"], o["action"]) for o in report.oversize] == [(10, "dropped")]
    assert report.packed_conversations == 4
    with pytest.raises(PackError, match=r"edge.jsonl:10: conversation has \d+ tokens"):
        run_pack(PackConfig(output=str(tmp_path / "e.jsonl.packed"), oversize="error", **base))
    with pytest.raises(PackError, match=r"edge.jsonl:2: not valid JSON: .*strict"):
        run_pack(PackConfig(output=str(tmp_path / "s.jsonl.packed"), strict=True, **base))
    assert not (tmp_path / "e.jsonl.packed").exists() and not (tmp_path / "s.jsonl.packed").exists()


def test_prompt_response_records_and_default_system_prompt(tmp_path, tokenizer_dir):
    src = _write_lines(tmp_path / "pr.jsonl", [{"prompt": "2+2?", "response": "4"}, {"prompt": "hi"}])
    cfg = PackConfig(inputs=[str(src)], output=str(tmp_path / "o.jsonl.packed"), input_key="prompt",
                     output_key="response", default_system_prompt="You are terse.",
                     tokenizer=str(tokenizer_dir("qwen2.5")), max_seq_len=128, progress=False, histogram="")
    report = run_pack(cfg)
    assert [r["reason"] for r in report.rejected] == ["response: missing or not a string"]
    row = json.loads(Path(cfg.output).read_text())
    assert row["messages"][0] == {"role": "system", "content": "You are terse."}


def test_bad_settings_are_clear(tmp_path, tokenizer_dir):
    src = _write_lines(tmp_path / "a.jsonl", EDGE_LINES[:1])
    base = dict(inputs=[str(src)], output=str(tmp_path / "o.jsonl.packed"), tokenizer=str(tokenizer_dir("qwen2.5")))
    with pytest.raises(ValueError, match="multiple of 2 \\* context_parallel_size"):
        run_pack(PackConfig(max_seq_len=100, context_parallel_size=8, **base))
    with pytest.raises(ValueError, match="--algorithm"):
        run_pack(PackConfig(max_seq_len=128, algorithm="magic", **base))
    with pytest.raises(ValueError, match="no such file"):
        run_pack(PackConfig(max_seq_len=128, **{**base, "inputs": [str(tmp_path / "nope.jsonl")]}))
    os.symlink(tmp_path / "nope.jsonl", tmp_path / "link.jsonl")
    with pytest.raises(ValueError, match="link.jsonl: a broken symbolic link"):
        run_pack(PackConfig(max_seq_len=128, **{**base, "inputs": [str(tmp_path / "link.jsonl")]}))
    if hasattr(os, "mkfifo"):
        os.mkfifo(tmp_path / "pipe.jsonl")
        with pytest.raises(ValueError, match="pipe.jsonl: not a regular file .* write the stream to a file first"):
            run_pack(PackConfig(max_seq_len=128, **{**base, "inputs": [str(tmp_path / "pipe.jsonl")]}))
    with pytest.raises(ValueError, match="is a directory"):
        run_pack(PackConfig(max_seq_len=128, **{**base, "output": str(tmp_path)}))
    with pytest.raises(ValueError, match="max_seq_len must be positive"):
        run_pack(PackConfig(max_seq_len=0, **base))
    for huge in ((1 << 24) + 2, 10**15):  # before: MemoryError or OverflowError tracebacks
        with pytest.raises(ValueError, match="above packsft's limit of 16,777,216 tokens a row"):
            run_pack(PackConfig(max_seq_len=huge, **base))
    for name, key, value in (("--default-system-prompt", "default_system_prompt", "\udcff"),  # a shell's \xff
                             ("--chat-template-kwargs", "chat_template_kwargs", {"k": "\ud800"})):
        with pytest.raises(ValueError, match=f"{name}: not valid text"):
            run_pack(PackConfig(max_seq_len=128, **{key: value}, **base))


def test_outputs_that_would_replace_each_other_or_a_folder_or_device_are_refused(tmp_path, tokenizer_dir):
    src = _write_lines(tmp_path / "a.jsonl", EDGE_LINES[:1])
    out = tmp_path / "o.jsonl.packed"
    base = dict(inputs=[str(src)], output=str(out), tokenizer=str(tokenizer_dir("qwen2.5")), max_seq_len=128,
                progress=False, histogram="")
    # before: rc 0, and the report was silently replaced by the rows, the sidecar or the token cache
    for clash in (out, Path(str(out) + ".meta.json"), Path(str(out) + ".tokens.npy"), tmp_path / "." / out.name):
        with pytest.raises(ValueError, match="is also the .* path: one output would replace the other"):
            run_pack(PackConfig(**{**base, "report": str(clash)}))
    with pytest.raises(ValueError, match="--histogram .* is also the --report path"):
        run_pack(PackConfig(**{**base, "report": str(tmp_path / "r.json"), "histogram": str(tmp_path / "r.json")}))
    # before: a traceback after all the work, leaving a publish journal every later run and load tripped over
    (tmp_path / "adir").mkdir()
    with pytest.raises(ValueError, match="--report .*adir is a directory"):
        run_pack(PackConfig(**{**base, "report": str(tmp_path / "adir")}))
    # before: the rename replaced the device or pipe with a regular file (as root, /dev/null itself)
    if hasattr(os, "mkfifo"):
        os.mkfifo(tmp_path / "fifo")
        with pytest.raises(ValueError, match="--output .*fifo is not a regular file"):
            run_pack(PackConfig(**{**base, "output": str(tmp_path / "fifo")}))
        with pytest.raises(ValueError, match="--histogram .*fifo is not a regular file"):
            run_pack(PackConfig(**{**base, "histogram": str(tmp_path / "fifo")}))
        os.symlink(tmp_path / "fifo", tmp_path / "link")        # as /dev/stdout links to a terminal or pipe
        with pytest.raises(ValueError, match="--report .*link is not a regular file"):
            run_pack(PackConfig(**{**base, "report": str(tmp_path / "link")}))
        os.unlink(tmp_path / "link")
    # before: packed twice, and the report's per-input counts of the file doubled
    with pytest.raises(ValueError, match="--input .*a.jsonl is given twice"):
        run_pack(PackConfig(**{**base, "inputs": [str(src), str(tmp_path / "." / "a.jsonl")]}))
    # an input named as the rows' index: packing kept it, the loader's first read replaced it
    index = _write_lines(tmp_path / "o.jsonl.packed.idx", EDGE_LINES[:1])
    with pytest.raises(ValueError, match=r"--input .*o.jsonl.packed.idx is the path of the loader's row index of "):
        run_pack(PackConfig(**{**base, "inputs": [str(index)]}))
    index.unlink()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.jsonl", "adir", "fifo"]
    assert run_pack(PackConfig(**base)).packed_conversations == 1


def test_nothing_to_pack_is_an_error_not_an_empty_file(tmp_path, tokenizer_dir):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    bad = _write_lines(tmp_path / "bad.jsonl", ["{nope", [1], '{"messages": ['])
    for src, n in ((empty, 0), (bad, 3)):
        out = tmp_path / f"{src.stem}.jsonl.packed"
        with pytest.raises(PackError, match=rf"no conversation to pack: {n} input line\(s\) in \S*{src.name}, "
                                            rf"{n} rejected") as e:
            run_pack(PackConfig(inputs=[str(src)], output=str(out), tokenizer=str(tokenizer_dir("qwen2.5")),
                                max_seq_len=128, progress=False, histogram=""))
        assert not out.exists()
    # the reasons come with the error, file and line each
    assert re.search(r"\n  rejected \S*bad.jsonl:1: not valid JSON: .* \(column 2\)\n  rejected \S*bad.jsonl:2: ",
                     str(e.value)), str(e.value)
    assert "bad.jsonl:3: not valid JSON: Expecting value (column 15)" in str(e.value)  # the end of its own line
    # every reason once, with its count (reasons that differ in their numbers, a message index, are one)
    user = {"role": "user", "content": "q"}
    lines = [{"messages": [user, {"role": "assistant", "content": i}]} for i in range(30)]   # content not a string
    lines += [{"messages": [user] * (2 + i % 3) + [{"role": "bot", "content": "a"}]} for i in range(5)]
    lines += [{"messages": [user, {"role": "assistant", "content": "a", "weight": w}]} for w in range(2, 11)]
    many = _write_lines(tmp_path / "many.jsonl", [json.dumps(x) for x in lines])
    with pytest.raises(PackError) as e:
        run_pack(PackConfig(inputs=[str(many)], output=str(tmp_path / "m.packed"), max_seq_len=128,
                            tokenizer=str(tokenizer_dir("qwen2.5")), progress=False, histogram=""))
    got = str(e.value).splitlines()[1:]
    assert got[0] == (f"  rejected {many}:1 and 29 more line(s) like it: messages[1].content: must be a string, "
                      "got number")
    assert got[1] == f"  rejected {many}:36 and 8 more line(s) like it: messages[1].weight: must be 0 or 1, got 2"
    assert got[2].startswith(f"  rejected {many}:31 and 4 more line(s) like it: messages[2].role: ")  # the most first
    assert len(got) == 3


def _cli(args, env_extra):
    env = {**os.environ, **env_extra}
    return subprocess.run([sys.executable, str(REPO / "tools" / "pack_megatron_sft_jsonl.py"), *args],
                          capture_output=True, text=True, env=env, cwd=tmp_cwd(), timeout=300)


def tmp_cwd():
    return str(REPO)


@pytest.mark.slow
def test_output_identical_across_hash_seeds_and_worker_counts(tmp_path, shared_data):
    src = _head(shared_data / "chat" / "hh_rlhf_harmless_base_test.messages.jsonl", tmp_path / "in.jsonl", 400)
    outs = []
    for k, (seed, workers) in enumerate([("1", "0"), ("2", "2")]):
        out = tmp_path / f"o{k}" / "o.jsonl.packed"  # one name: the sidecar names the token cache files
        r = _cli(["--input", str(src), "--output", str(out), "--tokenizer", str(shared_data / "tokenizers/qwen2.5"),
                  "--max-seq-length", "2048", "--num-workers", workers, "--no-progress", "--histogram", ""],
                 {"PYTHONHASHSEED": seed})
        assert r.returncode == 0, r.stderr
        assert "efficiency" in r.stdout
        meta = json.loads(Path(str(out) + ".meta.json").read_text())
        outs.append((out.read_bytes(), meta, [p.read_bytes() for p in cache_paths(out)]))
    assert outs[0][0] == outs[1][0]
    assert outs[0][1] == outs[1][1]
    assert outs[0][2] == outs[1][2]


@pytest.mark.skipif(sys.platform != "linux", reason="workers are forked on Linux only")
def test_forked_workers_use_the_packers_tokenizer_and_give_the_same_rows(tmp_path, shared_data, monkeypatch):
    from packsft.packing import local_engine
    from packsft.prompt_formats import spec

    src = _head(shared_data / "chat" / "gsm8k_test.messages.jsonl", tmp_path / "in.jsonl", 300)
    tok = str(shared_data / "tokenizers" / "smollm2-135m-instruct")
    rows = []
    for workers in (0, 2):
        main, real = os.getpid(), spec.load_tokenizer

        def load_in_main_only(path, main=main, real=real):  # a forked worker inherits this and must not call it
            if os.getpid() != main:
                raise AssertionError("a worker loaded the tokenizer again")
            return real(path)

        monkeypatch.setattr(spec, "load_tokenizer", load_in_main_only)
        out = tmp_path / f"w{workers}" / "o.jsonl.packed"
        run_pack(PackConfig(inputs=[str(src)], output=str(out), tokenizer=tok, max_seq_len=1024, num_workers=workers,
                            shard_bytes=20_000, progress=False, histogram=""))
        rows.append(out.read_bytes())
    assert local_engine.worker_start_method() == "fork"
    assert rows[0] == rows[1]


def test_no_more_workers_than_shards(tmp_path, shared_data, monkeypatch):
    import concurrent.futures

    sizes = []
    real = concurrent.futures.ProcessPoolExecutor

    def recording(max_workers, **kw):
        sizes.append(max_workers)
        return real(max_workers, **kw)

    monkeypatch.setattr(concurrent.futures, "ProcessPoolExecutor", recording)
    src = _head(shared_data / "chat" / "gsm8k_test.messages.jsonl", tmp_path / "in.jsonl", 20)
    shards = len(plan_shards([str(src)], 5_000))
    assert 1 < shards < 8
    run_pack(PackConfig(inputs=[str(src)], output=str(tmp_path / "o.jsonl.packed"),
                        tokenizer=str(shared_data / "tokenizers" / "smollm2-135m-instruct"), max_seq_len=1024,
                        num_workers=8, shard_bytes=5_000, progress=False, histogram=""))
    assert sizes == [shards]


def test_dead_worker_message_names_the_killed_worker_not_the_ones_the_pool_stopped(tmp_path):
    from types import SimpleNamespace

    from packsft.packing.local_engine import dead_worker_message
    from packsft.packing.shards import Shard

    shards = [Shard(0, 0, 0, 100), Shard(1, 0, 100, 200)]
    (tmp_path / "worker.11").write_text("1 done")  # killed after finishing its shard
    (tmp_path / "worker.12").write_text("0")  # stopped by the pool mid-shard
    (tmp_path / "worker.13").write_text("0")
    procs = {11: SimpleNamespace(exitcode=-9), 12: SimpleNamespace(exitcode=-15), 13: SimpleNamespace(exitcode=-9)}
    cfg = PackConfig(inputs=["in.jsonl"], output="o.jsonl.packed", tokenizer="t", max_seq_len=8)
    msg = dead_worker_message(cfg, shards, str(tmp_path), SimpleNamespace(_processes=procs))
    assert "worker process 11 died (killed by SIGKILL) while idle, after shard 1 of in.jsonl" in msg
    assert "worker process 13 died (killed by SIGKILL) while reading shard 0 of in.jsonl (bytes 0-100)" in msg
    assert "1 worker process(es) ended by SIGTERM (the pool stops the others when one dies)" in msg
    assert "process 12" not in msg


def test_cli_exit_code_and_message_on_bad_input(tmp_path, tokenizer_dir):
    src = _write_lines(tmp_path / "a.jsonl", ["{bad"])
    r = _cli(["--input", str(src), "--output", str(tmp_path / "o.jsonl.packed"), "--tokenizer",
              str(tokenizer_dir("qwen2.5")), "--max-seq-length", "128", "--strict", "--no-progress"], {})
    assert r.returncode == 2
    assert "a.jsonl:1: not valid JSON" in r.stderr


def test_outputs_are_written_with_report_and_histogram(tmp_path, tokenizer_dir):
    src = _write_lines(tmp_path / "a.jsonl", EDGE_LINES)
    cfg = PackConfig(inputs=[str(src)], output=str(tmp_path / "o.jsonl.packed"),
                     tokenizer=str(tokenizer_dir("qwen2.5")), max_seq_len=512, progress=False,
                     report=str(tmp_path / "rep.json"))
    report = run_pack(cfg)
    rep = json.loads((tmp_path / "rep.json").read_text())
    assert rep["rows"] == report.rows and rep["rejected"] == report.rejected
    png = Path(report.outputs["histogram"])
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert oct(os.stat(cfg.output).st_mode & 0o777) != oct(0o600)
    assert "efficiency" in report.summary() and not list(tmp_path.glob(".*.tmp"))


def test_sequence_parallel_rows_are_checked_and_recorded(tmp_path, tokenizer_dir):
    src = _write_lines(tmp_path / "a.jsonl", EDGE_LINES[:1])
    out = tmp_path / "sp.jsonl.packed"
    r = _cli(["--input", str(src), "--output", str(out), "--tokenizer", str(tokenizer_dir("qwen2.5")),
              "--max-seq-length", "132", "--context-parallel-size", "2", "--tensor-model-parallel-size", "8",
              "--sequence-parallel", "--no-progress", "--histogram", ""], {})
    assert r.returncode == 2 and "lcm(2 * context_parallel_size, context_parallel_size * tensor" in r.stderr
    r = _cli(["--input", str(src), "--output", str(out), "--tokenizer", str(tokenizer_dir("qwen2.5")),
              "--max-seq-length", "128", "--context-parallel-size", "2", "--tensor-model-parallel-size", "8",
              "--sequence-parallel", "--no-progress", "--histogram", ""], {})
    assert r.returncode == 0, r.stderr
    assert json.loads(Path(str(out) + ".meta.json").read_text())["sequence_parallel_size"] == 8


MASK_LINES = [
    {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "One.", "weight": 0},
                  {"role": "user", "content": "b"}, {"role": "assistant", "content": "Two."}]},
    {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "Only.", "weight": 0}]},
    {"messages": [{"role": "user", "content": "c"}, {"role": "assistant", "content": ""},
                  {"role": "user", "content": "d"}, {"role": "assistant", "content": "Kept."}],
     "chat_template_kwargs": {"enable_thinking": True}},
    {"messages": [{"role": "user", "content": "e"}, {"role": "assistant", "content": "Three."},
                  {"role": "user", "content": "f"}, {"role": "assistant", "content": "Four."}]},
]


@pytest.mark.parametrize("train_on", ["all", "last"])
def test_masks_and_kwargs_are_recorded_and_honoured_by_the_loader(tmp_path, tokenizer_dir, train_on):
    from packsft.data.dataset import PackedSFTDataset
    from packsft.sidecar import SidecarError, read_sidecar

    tok_dir = str(tokenizer_dir("qwen2.5"))
    src = _write_lines(tmp_path / "m.jsonl", MASK_LINES)
    out = tmp_path / "m.jsonl.packed"
    report = run_pack(PackConfig(inputs=[str(src)], output=str(out), tokenizer=tok_dir, max_seq_len=512,
                                 train_on=train_on, chat_template_kwargs={"enable_thinking": False},
                                 progress=False, histogram=""))
    assert not report.rejected and report.packed_conversations == 4
    assert [(w["line"], w["kind"]) for w in report.warnings] == [(2, "no_trained_token")]
    meta = read_sidecar(out)
    assert meta["format_version"] == 2 and meta["counts"]["warnings"] == {"no_trained_token": 1}
    assert meta["prompt_format"]["train_on"] == train_on and meta["prompt_format"]["append_eos"] is False
    assert meta["prompt_format"]["chat_template_kwargs"] == {"enable_thinking": False}
    rows = [json.loads(line)["messages"] for line in out.read_text().splitlines()]
    assert any(m.get("weight") == 0 for r in rows for m in r)               # the row keeps the field
    assert any(m.get("chat_template_kwargs") == {"enable_thinking": True} for r in rows for m in r)
    ds = PackedSFTDataset(out, tok_dir, "chat-template", 512, require_sidecar=True)   # options from the sidecar
    assert ds.prompt_format.train_on == train_on
    tok = ds.tokenizer
    trained = tok.decode([int(t) for r in range(len(ds)) for t in ds[r]["labels"] if t != -100])
    want = {"all": ["Two.", "Kept.", "Three.", "Four."], "last": ["Two.", "Kept.", "Four."]}[train_on]
    assert sorted(trained.split("<|im_end|>")[:-1]) == sorted(want)
    other = "last" if train_on == "all" else "all"   # the refusals are the sidecar's: the loaded tokenizer is reused
    with pytest.raises(SidecarError, match=f"prompt_format.train_on: packed for '{train_on}', loader has '{other}'"):
        PackedSFTDataset(out, tok, "chat-template", 512, train_on=other)
    with pytest.raises(SidecarError, match="prompt_format.chat_template_kwargs"):
        PackedSFTDataset(out, tok, "chat-template", 512, chat_template_kwargs={"enable_thinking": True})


def test_template_without_stop_signal_warns_once_with_its_name(tmp_path, tokenizer_dir):
    from packsft.packing.config import PackWarning

    glm = ("{% for m in messages %}<|{{ m.role }}|>\n{{ m.content }}{% endfor %}"
           "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
    src = _write_lines(tmp_path / "g.jsonl", MASK_LINES[3:] * 3)
    base = dict(inputs=[str(src)], tokenizer=str(tokenizer_dir("qwen2.5")), max_seq_len=256, chat_template=glm,
                progress=False, histogram="")
    report = run_pack(PackConfig(output=str(tmp_path / "on.jsonl.packed"), **base))
    assert not report.warnings                                   # EOS appended by default: nothing to warn about
    with pytest.warns(PackWarning, match="writes nothing after an assistant turn's content") as caught:
        report = run_pack(PackConfig(output=str(tmp_path / "off.jsonl.packed"), append_eos=False, **base))
    assert [w["kind"] for w in report.warnings] == ["no_stop_signal"] and len(caught) == 1
    assert "qwen2.5 chat template" in report.warnings[0]["message"]


def test_cli_parses_masks_kwargs_and_append_eos():
    from packsft.packing.cli import parse_args

    base = ["--input", "x.jsonl", "--output", "o.jsonl.packed", "--tokenizer", "t", "--max-seq-length", "64"]
    cfg = parse_args(base + ["--train-on", "last", "--chat-template-kwargs", '{"enable_thinking": false}',
                             "--no-append-eos", "--prompt-format", "passthrough"])
    assert (cfg.train_on, cfg.chat_template_kwargs, cfg.append_eos, cfg.prompt_format) == \
        ("last", {"enable_thinking": False}, False, "passthrough")
    assert parse_args(base).append_eos is None
    with pytest.raises(SystemExit):
        parse_args(base + ["--chat-template-kwargs", "[1]"])
    for value in ('{"x": NaN}', '{"x": 1e999}'):   # would reach the sidecar and report, which strict readers refuse
        with pytest.raises(SystemExit):
            parse_args(base + ["--chat-template-kwargs", value])


@pytest.mark.parametrize(("record_format", "line", "field"), [
    ("messages", {"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "q"},
                               {"role": "assistant", "content": ""}]}, "messages[2]"),
    ("sharegpt", {"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": ""}]},
     "conversations[1]"),
])
def test_a_template_error_names_the_inputs_own_message(tmp_path, tokenizer_dir, record_format, line, field):
    src = _write_lines(tmp_path / "in.jsonl", [line])
    cfg = PackConfig(inputs=[str(src)], output=str(tmp_path / "o.jsonl.packed"), record_format=record_format,
                     tokenizer=str(tokenizer_dir("qwen2.5")), max_seq_len=256, progress=False, histogram="")
    with pytest.raises(PackError, match=re.escape(f"in.jsonl:1: chat-template: {field}: empty assistant turn")):
        run_pack(cfg)


def test_the_cli_prints_warnings_as_warning_lines(tmp_path, tokenizer_dir, capsys):
    from packsft.packing import cli

    src = _write_lines(tmp_path / "in.jsonl", [EDGE_LINES[9], EDGE_LINES[0]])  # line 1's turn lies beyond the cut
    argv = ["--input", str(src), "--output", str(tmp_path / "o.jsonl.packed"), "--max-seq-length", "256",
            "--tokenizer", str(tokenizer_dir("qwen2.5")), "--no-progress", "--histogram", ""]
    assert cli.main(argv) == 0
    err = capsys.readouterr().err
    assert err.startswith("warning: ") and "in.jsonl:1: conversation has more than" in err, err
    assert "PackWarning" not in err and "_apply_oversize" not in err, err
    # alone, it leaves the rows nothing to train: an error (before: exit 0 and rows that train nothing)
    src = _write_lines(tmp_path / "in.jsonl", [EDGE_LINES[9]])
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert "error: nothing to train: none of the 1 conversations to pack keeps a trained token in its row " \
           "(warnings: 0 no_trained_token, 1 truncation_removes_training at max_seq_len 256)" in err, err
    assert "truncation_removes_training " in err
    masked = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a", "weight": 0}]}
    src.write_text(json.dumps(masked) + "\n")
    assert cli.main(argv) == 2
    assert "nothing to train: none of the 1 conversations to pack keeps a trained token in its row (warnings: 1 " \
           "no_trained_token, 0 truncation" in capsys.readouterr().err


def test_the_progress_bar_counts_bytes_and_conversations(tmp_path, tokenizer_dir, capsys):
    src = _write_lines(tmp_path / "in.jsonl", EDGE_LINES[:1] * 3)
    run_pack(PackConfig(inputs=[str(src)], output=str(tmp_path / "o.jsonl.packed"), max_seq_len=1024,
                        tokenizer=str(tokenizer_dir("qwen2.5")), histogram=""))
    last = capsys.readouterr().err.rstrip().split("\r")[-1]
    assert last.startswith("reading: 100%") and last.endswith(" 3 conversations]"), last


def test_the_first_five_warnings_of_a_kind_are_printed_and_the_report_has_them_all():
    from packsft.packing.config import PackWarning
    from packsft.packing.report import PackReport

    report = PackReport()
    with pytest.warns(PackWarning) as caught:
        for i in range(1, 7):
            report.warn("no_trained_token", "nothing trained", "in.jsonl", i)
    assert [str(w.message) for w in caught][3:] == [
        "in.jsonl:4: nothing trained",
        "in.jsonl:5: nothing trained (only the first 5 of each kind are printed; the report lists them all)"]
    assert report.warning_counts() == {"no_trained_token": 6}


def test_ctrl_c_is_an_error_line_and_exit_130(tmp_path, monkeypatch, capsys):
    from packsft.packing import cli

    def interrupted(cfg):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "run_pack", interrupted)
    assert cli.main(["--input", "x.jsonl", "--output", str(tmp_path / "o.jsonl.packed"), "--tokenizer", "t",
                     "--max-seq-length", "256"]) == 130
    assert capsys.readouterr().err.startswith("error: interrupted (SIGINT)")


def test_sigterm_is_an_error_line_and_exit_143(tmp_path, monkeypatch, capsys):
    import signal

    from packsft.packing import cli, signals

    def terminated(cfg):
        signals._on_sigterm(signal.SIGTERM, None)

    monkeypatch.setattr(cli, "run_pack", terminated)
    with pytest.raises(SystemExit) as e:
        cli.main(["--input", "x.jsonl", "--output", str(tmp_path / "o.jsonl.packed"), "--tokenizer", "t",
                  "--max-seq-length", "256"])
    assert e.value.code == 143
    assert capsys.readouterr().err.startswith("error: terminated (SIGTERM)")


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGINT"])
def test_a_stop_signal_while_the_spool_folder_is_removed_leaves_nothing(sig, tmp_path, tokenizer_dir, monkeypatch):
    """Handled inside ``shutil.rmtree``, the signal's exception stopped the removal halfway."""
    import shutil
    import signal

    from packsft.packing import pipeline
    from packsft.packing.signals import Terminated

    real = shutil.rmtree

    def signalled(path, *a, **k):
        if ".spool." in str(path):
            os.kill(os.getpid(), getattr(signal, sig))
        return real(path, *a, **k)

    monkeypatch.setattr(pipeline.shutil, "rmtree", signalled)
    src = _write_lines(tmp_path / "in.jsonl", EDGE_LINES[:1] * 3)
    out = tmp_path / "out" / "o.jsonl.packed"
    with pytest.raises(Terminated if sig == "SIGTERM" else KeyboardInterrupt) as e:
        run_pack(PackConfig(inputs=[str(src)], output=str(out), tokenizer=str(tokenizer_dir("qwen2.5")),
                            max_seq_len=256, progress=False))
    assert not getattr(e.value, "published", False)
    assert os.listdir(out.parent) == [".o.jsonl.packed.lock"]


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGINT"])
def test_a_stop_signal_handled_in_a_finalizer_still_stops_the_run(sig, tmp_path, tokenizer_dir, monkeypatch):
    """Python drops an exception raised in ``__del__`` (a Ctrl-C landed in one while transformers was imported):
    the run went on and published its outputs, exit 0."""
    import signal

    from packsft.packing.signals import Terminated
    from packsft.prompt_formats import spec

    class Finalized:
        def __del__(self):
            signal.raise_signal(getattr(signal, sig))   # its handler runs here, and its exception is dropped

    real = spec.load_tokenizer

    def loading(path):
        Finalized()
        return real(path)

    monkeypatch.setattr(spec, "load_tokenizer", loading)
    src = _write_lines(tmp_path / "in.jsonl", EDGE_LINES[:1] * 3)
    out = tmp_path / "out" / "o.jsonl.packed"
    with pytest.raises(Terminated if sig == "SIGTERM" else KeyboardInterrupt) as e:
        run_pack(PackConfig(inputs=[str(src)], output=str(out), tokenizer=str(tokenizer_dir("smollm2-135m-instruct")),
                            max_seq_len=256, progress=False, histogram=""))
    assert not getattr(e.value, "published", False)
    assert os.listdir(out.parent) == [".o.jsonl.packed.lock"]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler   # put back


def test_rows_are_written_in_groups_bounded_by_bytes_with_the_same_output(tmp_path, shared_data, monkeypatch):
    from packsft.packing import rows

    src = _head(shared_data / "chat" / "gpteacher.messages.jsonl", tmp_path / "in.jsonl", 300)
    groups, real = [], rows._byte_groups

    def recording(*a):
        out = list(real(*a))
        groups.append(len(out))
        return out

    monkeypatch.setattr(rows, "_byte_groups", recording)
    outs = []
    for cap in (64 << 20, 20_000):
        monkeypatch.setattr(rows, "ROW_GROUP_BYTES", cap)
        out = tmp_path / f"c{cap}" / "o.jsonl.packed"
        run_pack(PackConfig(inputs=[str(src)], output=str(out), max_seq_len=2048, progress=False, histogram="",
                            tokenizer=str(shared_data / "tokenizers" / "smollm2-135m-instruct")))
        outs.append([out.read_bytes()] + [p.read_bytes() for p in cache_paths(out)])
    assert groups[0] == 1 and groups[1] > 10  # one group, then many of at most 20 KB (a row is about 10 KB)
    assert outs[0] == outs[1]


def test_ctrl_c_while_the_cli_starts_is_an_error_line_not_a_traceback(tmp_path, tokenizer_dir):
    import signal
    import time

    src = _write_lines(tmp_path / "a.jsonl", EDGE_LINES[:1])
    proc = subprocess.Popen([sys.executable, str(REPO / "tools" / "pack_megatron_sft_jsonl.py"), "--input", str(src),
                             "--output", str(tmp_path / "o.jsonl.packed"), "--tokenizer",
                             str(tokenizer_dir("qwen2.5")), "--max-seq-length", "512", "--no-progress"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    time.sleep(0.25)  # the imports take about 0.6 s
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert err.strip().startswith("error: interrupted (SIGINT)") and "Traceback" not in err, err


def test_length_histogram_shows_lengths_before_the_cut_and_the_dropped(tmp_path, tokenizer_dir, monkeypatch):
    """The histogram gets each conversation's length as tokenized, before the packer's own-row cut and before
    --oversize drop (it plotted the stored, cut lengths and left the dropped out: no long tail)."""
    import packsft.packing.report as report_module

    tok_dir = tokenizer_dir("qwen2.5")

    def conv(turns: int, words: int) -> dict:
        msgs = []
        for i in range(turns):
            msgs += [{"role": "user", "content": f"question {i} " + "why " * words},
                     {"role": "assistant", "content": f"answer {i} " + "because " * words}]
        return {"messages": msgs}

    # short ones; one tokenized whole, then cut (about 400 tokens); one too long to tokenize whole (estimated)
    records = [conv(1, 3), conv(2, 5), conv(7, 20), conv(60, 20)]
    src = _write_lines(tmp_path / "in.jsonl", records)
    tok = _tokenizer(str(tok_dir))
    fmt = get_prompt_format("chat-template", tok)
    true = [count_conversation_tokens(parse_record(r).messages, Tokenization.of(tok, fmt)) for r in records]
    L = 256
    high = own_row_window(L)[1]
    assert true[0] <= L and true[1] <= L and true[2] > high and len(json.dumps(records[3])) > 8 * high
    calls = []
    real_plot = report_module.plot_lengths
    monkeypatch.setattr(report_module, "plot_lengths", lambda *a, **k: calls.append((a, k)) or real_plot(*a, **k))
    base = dict(inputs=[str(src)], tokenizer=str(tok_dir), max_seq_len=L, progress=False)
    report = run_pack(PackConfig(output=str(tmp_path / "o.jsonl.packed"), **base))
    assert [o.get("cut_by_packer") for o in report.oversize] == [True, True]  # stored: about L tokens each
    (path, fitting, _, max_seq_len), kw = calls[-1]
    assert sorted(fitting.tolist()) == sorted(true[:2]) and max_seq_len == L and not kw["dropped"]
    exact, estimate = kw["truncated"]
    assert exact == true[2] and kw["estimated"] == 1                  # tokenized whole before it was cut
    assert 0.8 * true[3] < estimate < 1.25 * true[3]                  # scaled from the stored cut
    assert Path(str(tmp_path / "o.jsonl.packed") + ".lengths.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    run_pack(PackConfig(output=str(tmp_path / "d.jsonl.packed"), oversize="drop", **base))
    (_, fitting, _, _), kw = calls[-1]
    assert sorted(fitting.tolist()) == sorted(true[:2]) and kw["dropped"] == true[2:] and not kw["truncated"]
    assert kw["estimated"] == 0
