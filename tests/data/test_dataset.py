"""PackedSFTDataset: rows as tensors, the cached index, reports, sidecar refusal, and packer == loader on real data."""

import functools
import json
import os
import pickle
import shutil
import warnings

import pytest
import torch

from packsft.conversation import ConversationError
from packsft.data import dataset as dataset_module
from packsft.data.dataset import PackedDataWarning, PackedSFTDataset
from packsft.data.row import build_row
from packsft.prompt_formats import Tokenization, get_prompt_format, spec, tokenize_conversation
from packsft.sidecar import SidecarError, write_sidecar
from packsft.tokenizer import load_tokenizer, tokenizer_fingerprint

TEKKEN = "nemotron-h-layout-tekken"


@functools.lru_cache
def _load(path: str):
    return load_tokenizer(path)


def load_cached(path):
    """``load_tokenizer(path)``, loaded once per path (``str`` or ``Path``) in this process."""
    return _load(str(path))


@pytest.fixture(scope="module", autouse=True)
def packer_loads_each_tokenizer_once():
    """The packer's ``load_tokenizer`` (``packsft.prompt_formats.spec``) is :func:`load_cached` in a module that
    imports this fixture (a test that edits a tokenizer folder after packing loads it with ``load_tokenizer``)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(spec, "load_tokenizer", load_cached)
        yield


def conv(user, assistant, system="", tools=None):
    """Messages of one conversation as the packer writes them (system first, tools on it)."""
    sys_msg = {"role": "system", "content": system, **({"tools": tools} if tools else {})}
    msgs = [sys_msg, {"role": "user", "content": user}]
    return msgs + ([{"role": "assistant", "content": assistant}] if assistant is not None else [])


def sidecar_dict(tok, fmt, max_seq_len, cp, **overrides):
    """The checked sidecar fields for ``tok``/``fmt`` plus the packer's descriptive ones."""
    meta = {"format_version": 2, "tokenizer_fingerprint": tokenizer_fingerprint(tok), "prompt_format": fmt.spec(),
            "max_seq_len": max_seq_len, "context_parallel_size": cp, "algorithm": "next-fit", "seed": 0,
            "counts": {"rows": 0}, "efficiency": 0.0, "input": "data/in.jsonl"}
    meta.update(overrides)
    return meta


def write_packed(path, rows, tok=None, fmt=None, max_seq_len=64, cp=1, sidecar=True, **overrides):
    """Write ``rows`` (each a list of conversations' messages) as a packed file with its sidecar."""
    with open(path, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps({"messages": [m for c in row for m in c]}) + "\n")
    if sidecar:
        write_sidecar(path, sidecar_dict(tok, fmt, max_seq_len, cp, **overrides))
    return path


@pytest.fixture(scope="module")
def tekken(tokenizer_dir):
    tok = load_cached(tokenizer_dir(TEKKEN))
    return tok, get_prompt_format("nemotron-h-aligned", tok)


ROWS = [
    [conv("Capital of France?", "Paris."), conv("2+2?", "4", system="Be brief.")],
    [conv("Name a colour.", "Blue.")],
    [conv("Say hi.", "Hi!"), conv("Say bye.", "Bye!"), conv("Count to three.", "One, two, three.")],
]


@pytest.mark.parametrize("cp", [1, 2])
def test_items_are_the_row_builder_applied_to_the_packers_tokenization(tmp_path, tekken, cp):
    tok, fmt = tekken
    path = write_packed(tmp_path / "a.jsonl.packed", ROWS, tok, fmt, 64, cp)
    ds = PackedSFTDataset(path, tok, fmt, 64, cp)
    assert len(ds) == 3
    for i, row in enumerate(ROWS):
        expected, _ = build_row([tokenize_conversation(c, Tokenization.of(tok, fmt)) for c in row], fmt.pad_token_id,
                                64, cp)
        item = ds[i]
        assert set(item) == set(expected)
        for key, value in expected.items():
            assert torch.equal(item[key], value) if isinstance(value, torch.Tensor) else item[key] == value, key
        assert len(item["cu_seqlens_padded"]) == len(row) + 1
    assert torch.equal(ds[-1]["tokens"], ds[2]["tokens"])
    with pytest.raises(IndexError, match="row 3 out of range .* 3 rows"):
        ds[3]


def test_prompt_format_by_name_and_tokenizer_by_path(tmp_path, tekken, tokenizer_dir):
    tok, fmt = tekken
    path = write_packed(tmp_path / "a.jsonl.packed", ROWS, tok, fmt)
    ds = PackedSFTDataset(path, tokenizer_dir(TEKKEN), "nemotron-h-aligned", 64)
    assert ds.prompt_format == fmt and torch.equal(ds[0]["tokens"], PackedSFTDataset(path, tok, fmt, 64)[0]["tokens"])


def test_index_is_cached_reused_and_rebuilt_when_the_file_changes(tmp_path, tekken, monkeypatch):
    tok, fmt = tekken
    path = write_packed(tmp_path / "a.jsonl.packed", ROWS, tok, fmt)
    PackedSFTDataset(path, tok, fmt, 64)
    index_file = tmp_path / "a.jsonl.packed.idx"
    assert index_file.is_file() and not list(tmp_path.glob("*.tmp"))
    built = []
    real_build = dataset_module.build_index
    monkeypatch.setattr(dataset_module, "build_index", lambda p: built.append(p) or real_build(p))
    assert len(PackedSFTDataset(path, tok, fmt, 64)) == 3 and built == []           # reused
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps({"messages": ROWS[1][0]}) + "\n")
    write_sidecar(path, sidecar_dict(tok, fmt, 64, 1))
    ds = PackedSFTDataset(path, tok, fmt, 64)
    assert len(ds) == 4 and len(built) == 1                                            # rebuilt: size changed
    assert torch.equal(ds[3]["tokens"], ds[1]["tokens"])


def test_index_of_other_rows_with_the_same_size_and_mtime_is_not_used(tmp_path, tokenizer_dir):
    """Two packs of the same conversations in another row order have the same size; an index copied across with
    the mtime restored (a tar extract, a coarse-mtime file system) is refused by the sidecar's rows hash (before:
    its offsets were used, giving a JSON error or the wrong rows)."""
    from packsft.packing.config import PackConfig
    from packsft.packing.pipeline import run_pack

    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"question {i} " + "x " * i},
                                                    {"role": "assistant", "content": f"answer {i}"}]}) + "\n"
                           for i in range(40)))
    outs = []
    for seed in (1, 2):
        out = tmp_path / f"s{seed}" / "rows.jsonl.packed"
        run_pack(PackConfig(inputs=[str(src)], output=str(out), tokenizer=str(tokenizer_dir("smollm2-135m-instruct")),
                            max_seq_len=128, shuffle_rows=True, seed=seed, progress=False, histogram=""))
        outs.append(out)
    a, b = outs
    assert a.stat().st_size == b.stat().st_size and a.read_bytes() != b.read_bytes()
    tok = load_cached(tokenizer_dir("smollm2-135m-instruct"))
    want = PackedSFTDataset(b, tok, "chat-template", 128, use_token_cache=False)
    PackedSFTDataset(a, tok, "chat-template", 128, use_token_cache=False)
    shutil.copy(f"{a}.idx", f"{b}.idx")
    os.utime(b, ns=(a.stat().st_atime_ns, a.stat().st_mtime_ns))
    got = PackedSFTDataset(b, tok, "chat-template", 128, use_token_cache=False)
    assert len(got) == len(want) > 2
    for i in range(len(got)):
        assert torch.equal(got[i]["tokens"], want[i]["tokens"]), i


def test_rows_key_of_a_sidecar():
    assert dataset_module.rows_key({"rows_file": {"blake2b": "f" * 40}}) == (1 << 60) - 1
    for odd in (None, {}, {"rows_file": ["x"]}, {"rows_file": {"blake2b": "zz"}}, {"rows_file": None}):
        assert dataset_module.rows_key(odd) == 0  # (a list there raised AttributeError)


def test_blank_lines_are_skipped_and_line_numbers_kept(tmp_path, tekken):
    tok, fmt = tekken
    path = tmp_path / "a.jsonl.packed"
    lines = [json.dumps({"messages": [m for c in r for m in c]}) for r in ROWS]
    path.write_text(f"\n{lines[0]}\n  \n{lines[1]}\n{lines[2]}\n", encoding="utf-8")
    write_sidecar(path, sidecar_dict(tok, fmt, 64, 1))
    ds = PackedSFTDataset(path, tok, fmt, 64)
    assert len(ds) == 3 and [ds.line_number(i) for i in range(3)] == [2, 4, 5]


def test_truncated_row_warns_once_naming_line_lengths_and_what_was_cut(tmp_path, tekken):
    tok, fmt = tekken
    long_answer = " ".join(["word"] * 40)
    path = write_packed(tmp_path / "t.jsonl.packed", [ROWS[1], [conv("Hi", "Hello."), conv("Talk.", long_answer)]],
                        tok, fmt, 32, 1)
    ds = PackedSFTDataset(path, tok, fmt, 32)
    with pytest.warns(PackedDataWarning) as record:
        item = ds[1]
    assert len(record) == 1
    message = str(record[0].message)
    n1 = len(tokenize_conversation(conv("Hi", "Hello."), Tokenization.of(tok, fmt))[0])
    n2 = len(tokenize_conversation(conv("Talk.", long_answer), Tokenization.of(tok, fmt))[0])
    assert "t.jsonl.packed:2 (row 1) right-truncated" in message
    assert f"need {n1 + n2} tokens but max_seq_len is 32" in message
    assert f"conversation 1 ({n2} tokens) was cut after {32 - n1} tokens" in message
    assert item["tokens"].shape == (32,) and item["cu_seqlens_padded"].tolist() == [0, n1, 32]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ds[1]                                                                      # reported once per row


def test_row_without_trained_token_is_reported_and_returned_with_zero_loss_mask(tmp_path, tekken):
    tok, fmt = tekken
    path = write_packed(tmp_path / "u.jsonl.packed", [[conv("Only a question?", None)]], tok, fmt)
    ds = PackedSFTDataset(path, tok, fmt, 64)
    with pytest.warns(PackedDataWarning, match=r"u.jsonl.packed:1 \(row 0\) has no trained token"):
        item = ds[0]
    assert item["num_trained_tokens"] == 0 and item["loss_mask"].sum() == 0


def test_malformed_rows_name_file_line_and_conversation(tmp_path, tekken):
    tok, fmt = tekken
    path = tmp_path / "m.jsonl.packed"
    good = json.dumps({"messages": ROWS[1][0]})
    bad_turn = json.dumps({"messages": ROWS[1][0] + conv("Again?", "   ")})
    user_first = json.dumps({"messages": ROWS[1][0][1:]})
    for body, where in ((f"{good}\nnot json\n", r"m.jsonl.packed:2: not valid JSON"),
                        (f"{good}\n[1]\n", r"m.jsonl.packed:2: a packed row must be a JSON object"),
                        (f"{user_first}\n", r"m.jsonl.packed:1: messages\[0\].role: a packed row must start")):
        path.write_text(body, encoding="utf-8")
        write_sidecar(path, sidecar_dict(tok, fmt, 64, 1))
        with pytest.raises(ConversationError, match=where):  # found when the dataset opens, not at the step
            PackedSFTDataset(path, tok, fmt, 64)
    path.write_text(f"{good}\n{bad_turn}\n", encoding="utf-8")
    write_sidecar(path, sidecar_dict(tok, fmt, 64, 1))
    ds = PackedSFTDataset(path, tok, fmt, 64)  # structure is valid; the empty turn needs the tokenizer
    with pytest.raises(ConversationError, match=r"m.jsonl.packed:2: conversation 1: .*empty assistant turn"):
        ds[1]


def test_missing_sidecar_warns_or_is_refused(tmp_path, tekken):
    tok, fmt = tekken
    path = write_packed(tmp_path / "n.jsonl.packed", ROWS, sidecar=False)
    with pytest.warns(PackedDataWarning, match="has no sidecar n.jsonl.packed.meta.json"):
        assert len(PackedSFTDataset(path, tok, fmt, 64)) == 3
    with pytest.raises(SidecarError, match="no sidecar.*Re-pack it"):
        PackedSFTDataset(path, tok, fmt, 64, require_sidecar=True)


def test_file_packed_for_cp1_is_refused_with_cp2(tmp_path, tekken):
    tok, fmt = tekken
    path = write_packed(tmp_path / "c.jsonl.packed", ROWS, tok, fmt, 64, cp=1)
    with pytest.raises(SidecarError) as err:
        PackedSFTDataset(path, tok, fmt, 64, context_parallel_size=2)
    message = str(err.value)
    assert "context_parallel_size: packed for 1, loader has 2" in message
    assert "--context-parallel-size 2" in message and "--input data/in.jsonl" in message
    assert "max_seq_len" not in message.split("Re-pack")[0]                           # only the differing field


@pytest.mark.parametrize(
    ("loader", "field"),
    [
        ({"max_seq_len": 128}, "max_seq_len: packed for 64, loader has 128"),
        ({"prompt_format": "nemotron-nano-v2"}, "prompt_format.name: packed for 'nemotron-h-aligned', loader has "
                                                "'nemotron-nano-v2'"),
        ({"pad_token": "<pad>"}, "prompt_format.pad_token: packed for '<SPECIAL_233>', loader has '<pad>'"),
        pytest.param({"tokenizer": "mistral-nemo", "prompt_format": "nemotron-h-aligned"},
                     "tokenizer_fingerprint: packed for", marks=pytest.mark.slow),
    ],
)
def test_sidecar_mismatch_names_the_field(tmp_path, tekken, tokenizer_dir, loader, field):
    tok, fmt = tekken
    path = write_packed(tmp_path / "s.jsonl.packed", ROWS, tok, fmt, 64)
    kwargs = {"max_seq_len": 64, **loader}
    if "tokenizer" in kwargs:
        kwargs["tokenizer"] = load_cached(tokenizer_dir(kwargs["tokenizer"]))
    else:
        kwargs["tokenizer"] = tok
    kwargs.setdefault("prompt_format", "nemotron-h-aligned")
    with pytest.raises(SidecarError, match=r"Re-pack it into a new file \(then point the config at it\) for this "
                                           "configuration") as err:
        PackedSFTDataset(path, **kwargs)
    assert field in str(err.value)


def test_pickles_without_the_file_handle_and_fingerprint_tracks_content(tmp_path, tekken):
    tok, fmt = tekken
    path = write_packed(tmp_path / "p.jsonl.packed", ROWS, tok, fmt)
    ds = PackedSFTDataset(path, tok, fmt, 64)
    first = ds[0]
    clone = pickle.loads(pickle.dumps(ds))
    assert clone._file is None and torch.equal(clone[0]["labels"], first["labels"])
    assert ds.fingerprint == clone.fingerprint and len(ds.fingerprint) == 16
    copy = tmp_path / "copy.jsonl.packed"
    shutil.copyfile(path, copy)
    shutil.copyfile(str(path) + ".meta.json", str(copy) + ".meta.json")
    os.utime(copy, ns=(1, 1))
    assert PackedSFTDataset(copy, tok, fmt, 64).fingerprint == ds.fingerprint         # mtime is not content
    write_packed(path, ROWS[::-1], tok, fmt)
    assert PackedSFTDataset(path, tok, fmt, 64).fingerprint != ds.fingerprint


@pytest.mark.slow
def test_train_loader_yields_collated_rows(tmp_path, tekken):
    from packsft.data.loader import DataLoaderConfig, build_train_dataloader

    tok, fmt = tekken
    ds = PackedSFTDataset(write_packed(tmp_path / "l.jsonl.packed", ROWS, tok, fmt), tok, fmt, 64)
    batch = next(iter(build_train_dataloader(ds, DataLoaderConfig(sampler="sequential", micro_batch_size=2))))
    assert batch["tokens"].shape == (1, 128)
    first, second = ds[0]["cu_seqlens_padded"], ds[1]["cu_seqlens_padded"]
    assert batch["cu_seqlens_padded"].tolist() == first.tolist() + (second[1:] + 64).tolist()


# Every conversation of every shared file is checked (about 5 minutes on 2 CPU cores for the four pairs);
# The first N conversations of each file; PACKSFT_FULL_REAL_DATA=1 reads every one (about 10 min on 2 cores).
REAL_FILES = {"chat/gpteacher.messages.jsonl": 400, "chat/gsm8k_train.messages.jsonl": 200,
              "chat/gsm8k_test.messages.jsonl": 200, "chat/hh_rlhf_harmless_base_test.messages.jsonl": 200,
              "chat/chitchat.messages.jsonl": 40, "tools/glaive_toolcall_en_demo.messages.jsonl": 100,
              "tools/bfcl_v4_ast.messages.jsonl": 200}
REAL_PAIRS = [(TEKKEN, "nemotron-nano-v2"), ("qwen2.5", "chat-template"),
              ("smollm2-135m-instruct", "chat-template"), ("mistral-nemo", "chat-template")]
NO_TOOLS = {"smollm2-135m-instruct"}  # its template cannot render tool calls (fails on content: null)


def variants(messages):
    """Edge-case copies of a conversation: whitespace around replies and prompts, CRLF, CJK, emoji, empty system."""
    def edit(fn, roles=("assistant",)):
        return [dict(m, content=fn(m["content"])) if m["role"] in roles and isinstance(m.get("content"), str)
                else dict(m) for m in messages]
    out = [edit(lambda c: "\n\n" + c), edit(lambda c: " " + c + " \n"), edit(lambda c: c + " ", ("user",)),
           edit(lambda c: c.replace("\n", "\r\n"), ("user", "assistant")),
           edit(lambda c: "東京は晴れ。" + c + "🙂👍🏽"), edit(lambda c: "\t" + c + "\n\n", ("user",))]
    return out + [[dict(messages[0], content="")] + [dict(m) for m in messages[1:]]]


def _read_and_count(path, tok, fmt, limit, max_seq_len, cp, every_variant=0):
    """Parse and count conversations the way the packer does; skip the ones it sets apart (oversize).

    ``chat-template`` must reject nothing; ``every_variant > 0`` adds :func:`variants` of every such conversation.
    """
    from packsft.conversation import Conversation, parse_record
    from packsft.jsonl import iter_jsonl_lines
    from packsft.layout import conversation_cost
    from packsft.prompt_formats import PromptFormatError, count_conversation_tokens

    convs, counts = [], []
    for k, (line, text, _) in enumerate(iter_jsonl_lines(path)):
        if limit is not None and k >= limit:
            break
        c = parse_record(json.loads(text), path, line)
        extra = [Conversation(v, c.tools, c.path, line) for v in variants(c.messages)] \
            if every_variant and k % every_variant == 0 else []
        for conv in [c, *extra]:
            try:
                n = count_conversation_tokens(conv.messages, Tokenization.of(tok, fmt), conv.tools)
            except Exception as e:  # PromptFormatError, or a template refusing this conversation
                assert isinstance(e, PromptFormatError), e
                assert fmt.name != "chat-template", f"{path}:{line}: rejected: {e}"
                continue
            if conversation_cost(n, cp) <= max_seq_len:
                convs.append(conv)
                counts.append(n)
    return convs, counts


@pytest.mark.slow
@pytest.mark.parametrize(("tokenizer_name", "preset"), REAL_PAIRS)
def test_packer_length_equals_loader_length_on_real_data(tmp_path, shared_data, tokenizer_dir, tokenizer_name,
                                                         preset):
    """The first conversations of each real file (all with PACKSFT_FULL_REAL_DATA=1), and for chat-template
    edge-case variants of every 20th, pack, none is rejected, and the loader tokenizes each to the packer's count."""
    from packsft.layout import conversation_cost
    from packsft.packing.algorithms import next_fit

    tok = load_cached(tokenizer_dir(tokenizer_name))
    fmt = get_prompt_format(preset, tok)
    max_seq_len, cp = 4096, 2
    full = os.environ.get("PACKSFT_FULL_REAL_DATA") == "1"
    checked = 0
    for name, limit in REAL_FILES.items():
        if tokenizer_name in NO_TOOLS and name.startswith("tools/"):
            continue
        convs, counts = _read_and_count(shared_data / name, tok, fmt, None if full else limit, max_seq_len, cp,
                                        every_variant=20 if preset == "chat-template" else 0)
        costs = [conversation_cost(n, cp) for n in counts]
        rows = next_fit(costs, max_seq_len)
        path = tmp_path / (name.split("/")[1] + ".packed")
        write_packed(path, [[convs[j].to_row_messages() for j in row] for row in rows], tok, fmt, max_seq_len, cp)
        ds = PackedSFTDataset(path, tok, fmt, max_seq_len, cp)
        assert len(ds) == len(rows)
        for i, row in enumerate(rows):
            pieces = ds.tokenize_row(i)
            assert [len(t) for t, _ in pieces] == [counts[j] for j in row], f"{name} row {i}"
            built, truncation = build_row(pieces, fmt.pad_token_id, max_seq_len, cp)
            lengths = (built["cu_seqlens_padded"][1:] - built["cu_seqlens_padded"][:-1]).tolist()
            assert truncation is None
            assert lengths[:-1] == [costs[j] for j in row[:-1]] and lengths[-1] >= costs[row[-1]]
            assert (built["cu_seqlens"][1:] - built["cu_seqlens"][:-1]).tolist() == [counts[j] for j in row]
            checked += len(row)
    assert checked > (25000 if full else 1000)


@pytest.mark.slow
def test_files_written_by_the_packer_load_without_truncation(tmp_path, shared_data, tokenizer_dir):
    from packsft.packing.config import PackConfig
    from packsft.packing.pipeline import run_pack

    source = shared_data / "chat" / "gsm8k_test.messages.jsonl"
    subset = tmp_path / "in.jsonl"
    subset.write_text("".join(source.read_text(encoding="utf-8").splitlines(keepends=True)[:120]), encoding="utf-8")
    out = tmp_path / "g.jsonl.packed"
    report = run_pack(PackConfig(inputs=[str(subset)], output=str(out), tokenizer=str(tokenizer_dir("qwen2.5")),
                                 max_seq_len=1024, prompt_format="chat-template", context_parallel_size=2,
                                 histogram="", progress=False))
    tok = load_cached(tokenizer_dir("qwen2.5"))
    ds = PackedSFTDataset(out, tok, "chat-template", 1024, 2, require_sidecar=True)
    assert len(ds) == report.rows
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        rows = [ds[i] for i in range(len(ds))]
    assert sum(len(r["cu_seqlens_padded"]) - 1 for r in rows) == 120
    assert all(((r["cu_seqlens_padded"][1:] - r["cu_seqlens_padded"][:-1]) % 4 == 0).all() for r in rows)
    with pytest.raises(SidecarError, match="context_parallel_size: packed for 2, loader has 4"):
        PackedSFTDataset(out, tok, "chat-template", 1024, 4)


def test_a_file_packed_with_a_version_1_sidecar_still_loads(tmp_path, tokenizer_dir):
    """Version 1 sidecars lack train_on/chat_template_kwargs/append_eos; they load as all, {} and false."""
    tok = load_cached(tokenizer_dir("qwen2.5"))
    fmt = get_prompt_format("chat-template", tok)
    v1 = {k: v for k, v in fmt.spec().items() if k not in ("train_on", "chat_template_kwargs", "append_eos")}
    rows = [[conv("Hi", "Hello!"), conv("2+2?", "4")]]
    path = write_packed(tmp_path / "v1.jsonl.packed", rows, tok, fmt, 64, format_version=1, prompt_format=v1)
    ds = PackedSFTDataset(path, tok, "chat-template", 64, require_sidecar=True)
    assert ds.prompt_format.train_on == "all" and ds.prompt_format.chat_template_kwargs is None
    assert ds[0]["num_trained_tokens"] == len(tok("Hello!<|im_end|>4<|im_end|>", add_special_tokens=False)["input_ids"])


def test_a_stale_index_without_sidecar_gives_a_conversation_error(tmp_path, tokenizer_dir):
    """Without a sidecar the index is keyed on size and mtime only (documented): a same-size file with its mtime
    restored reads at stale offsets. A row not found there raised a bare JSONDecodeError from ``ds[i]``."""
    tok = load_cached(tokenizer_dir("smollm2-135m-instruct"))
    row = '{"messages": [{"role": "system", "content": ""}, {"role": "user", "content": "hi %s"}, ' \
          '{"role": "assistant", "content": "yo"}]}\n'
    path = tmp_path / "rows.jsonl.packed"
    path.write_text(row % "aa" + row % "b")
    with pytest.warns(Warning):
        PackedSFTDataset(path, tok, "chat-template", 128)  # builds rows.jsonl.packed.idx
    mtime = path.stat().st_mtime_ns
    path.write_text(row % "a" + row % "bb")  # same size, the second row one byte earlier
    os.utime(path, ns=(mtime, mtime))
    with pytest.warns(Warning):
        stale = PackedSFTDataset(path, tok, "chat-template", 128)
    with pytest.raises(ConversationError, match=r"rows.jsonl.packed:2: row 1 is not at its row index's offset .*"
                                                r"delete .*rows.jsonl.packed.idx"):
        stale.read_messages(1)
