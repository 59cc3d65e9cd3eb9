"""``--oversize split`` (packsft/packing/split.py) on the shared real data: pieces fit a row, start with the system
message, mask their context, train every assistant turn exactly once (the whole conversation's tokens, end of turn
included), keep tool calls with their results; the pipeline stores them as the loader reads them back and reports
the pieces and the turns too long for a row."""

import functools
import json
import warnings
from pathlib import Path

import pytest
from test_token_cache import _assert_every_row_equal, _datasets

from packsft.conversation import parse_record, split_row
from packsft.data.dataset import PackedDataWarning
from packsft.data.repack import repack_hint
from packsft.layout import conversation_cost
from packsft.packing.config import PackConfig
from packsft.packing.pipeline import run_pack
from packsft.packing.split import split_conversation
from packsft.prompt_formats import TokenizationSpec, tokenize_conversation, tokenize_segments
from packsft.record_formats import ROW_JSON
from packsft.sidecar import REPORT_SUFFIX

CHAT, TOOLS = "chat/chitchat.messages.jsonl", "tools/glaive_toolcall_en_demo.messages.jsonl"


@functools.lru_cache
def _tokenization(folder: str, train_on: str = "all"):
    return TokenizationSpec(folder, "chat-template", train_on=train_on).resolve()


def _conversations(path: Path, lines) -> list:
    wanted = set(lines)
    with open(path, encoding="utf-8") as f:
        return [parse_record(json.loads(text), str(path), n) for n, text in enumerate(f, start=1) if n in wanted]


def _trained(messages, tz, tools, start: int = 1) -> list[tuple[int, list[int]]]:
    """``(index in the whole conversation, trained ids)`` of each trained turn of ``messages``, whose
    ``messages[1:]`` are the whole conversation's from ``start`` on."""
    return [(start + seg.turn - 1, ids) for seg, ids in tokenize_segments(messages, tz, tools) if seg.trained]


def _check_split(conv, tz, L: int, cp: int = 1):
    """Split ``conv`` and check every piece against the whole conversation; the split and the pieces' contexts."""
    whole = dict(_trained(conv.messages, tz, conv.tools))
    end_of_turn = tz.tokenizer.convert_tokens_to_ids("<|im_end|>")
    got = split_conversation(conv, tz, L, cp, tz.fmt.train_on)
    seen, contexts = [], []
    for piece, tokens, runs, start in got.pieces:
        assert conversation_cost(len(tokens), cp) <= L
        assert piece.messages[0] == conv.messages[0] and piece.tools == conv.tools  # the system message, tools
        assert conv.messages[start]["role"] != "tool"  # tool results stay after their call
        for i, m in enumerate(piece.messages[1:], start):  # the whole conversation's messages, some weight 0
            assert {k: v for k, v in m.items() if k != "weight"} == {k: v for k, v in conv.messages[i].items()
                                                                    if k != "weight"}
        stored = split_row(json.loads(ROW_JSON(piece.to_row_messages())))  # as the loader reads the row back
        assert len(stored) == 1
        assert tokenize_conversation(stored[0].messages, tz, stored[0].tools, runs=True) == (tokens, runs)
        trained = _trained(piece.messages, tz, piece.tools, start)
        assert trained, "a piece trains at least one turn"
        for turn, ids in trained:
            assert ids == whole[turn], f"turn {turn}: other tokens than in the whole conversation"
            assert end_of_turn in ids[-2:], "the end of turn is trained with the turn"
        contexts.append(trained[0][0] - start)  # messages of context before the piece's first trained turn
        assert sum(len(ids) for _, ids in trained) == sum(r for r in runs if r > 0)  # nothing else trained
        seen += [turn for turn, _ in trained]
    assert len(seen) == len(set(seen)), "a turn trained twice"
    assert sorted(seen + [turn for turn, _, _ in got.rejected]) == sorted(whole), "a turn neither trained nor rejected"
    for turn, n, error in got.rejected:
        assert n is None or conversation_cost(n, cp) > L
        assert error.turn == turn
    return got, contexts


@pytest.mark.parametrize("cp", [1, 2])
def test_chat_pieces_fit_and_train_every_turn_once(shared_data, cp):
    tz = _tokenization(str(shared_data / "tokenizers" / "smollm2-135m-instruct"))
    convs = _conversations(shared_data / CHAT, [2, 4, 6])
    later_contexts = []
    for conv in convs:
        got, contexts = _check_split(conv, tz, 512, cp)
        assert len(got.pieces) >= 2 and not got.rejected
        later_contexts += contexts[1:]
    assert max(later_contexts) > 1  # a later piece holds earlier turns as masked context, not only its prompt


def test_train_on_last_gives_one_piece_that_trains_the_last_turn(shared_data):
    tz = _tokenization(str(shared_data / "tokenizers" / "smollm2-135m-instruct"), "last")
    (conv,) = _conversations(shared_data / CHAT, [2])
    got, _ = _check_split(conv, tz, 512)
    ((piece, _, _, start),) = got.pieces
    last = max(i for i, m in enumerate(conv.messages) if m["role"] == "assistant")
    assert [turn for turn, _ in _trained(piece.messages, tz, None, start)] == [last]


def test_tool_calls_split_with_their_results(shared_data):
    tz = _tokenization(str(shared_data / "tokenizers" / "qwen2.5"))
    convs = _conversations(shared_data / TOOLS, [228, 238, 261, 273])
    tool_contexts, rejected = 0, {}
    for conv in convs:
        got, _ = _check_split(conv, tz, 512)
        tool_contexts += sum(any(m["role"] == "tool" for m in piece.messages) for piece, *_ in got.pieces[1:])
        rejected[conv.line] = [turn for turn, _, _ in got.rejected]
    assert tool_contexts  # a later piece holds a tool call with its results
    assert rejected == {228: [], 238: [], 261: [2], 273: []}


def test_pack_split_rows_report_sidecar_and_loader(tmp_path, shared_data):
    """Lines 2-6 of chitchat (three longer than 512 tokens), 91 (its one trained turn too long: dropped) and 123
    (one turn too long, the others in pieces)."""
    lines = {2, 3, 4, 5, 6, 91, 123}
    src = tmp_path / "chat.jsonl"
    with open(shared_data / CHAT, encoding="utf-8") as f, open(src, "w", encoding="utf-8") as g:
        g.writelines(text for n, text in enumerate(f, start=1) if n in lines)
    tok = shared_data / "tokenizers" / "smollm2-135m-instruct"
    out = tmp_path / "rows.jsonl.packed"
    report = run_pack(PackConfig(inputs=[str(src)], output=str(out), tokenizer=str(tok), max_seq_len=512,
                                 oversize="split", progress=False))
    tz = _tokenization(str(tok))
    convs = _conversations(src, range(1, len(lines) + 1))
    splits = {c.line: split_conversation(c, tz, 512) for c in convs
              if len(tokenize_conversation(c.messages, tz, c.tools)[0]) > 512}
    assert sorted(splits) == [1, 2, 3, 5, 6, 7]
    pieces = {line: len(s.pieces) for line, s in splits.items()}
    assert pieces[6] == 0 and pieces[7] >= 1
    assert report.split_conversations == 5 and report.pieces == sum(pieces.values())
    assert [(o["line"], o["action"], o["pieces"]) for o in report.oversize] == \
        [(line, "split" if k else "dropped", k) for line, k in sorted(pieces.items())]
    assert [(r["line"], r["reason"][:12]) for r in report.rejected_turns] == [(6, "messages[1]:"), (7, "messages[3]:")]
    assert report.packed_conversations == len(lines) - len(splits) + report.pieces
    meta = json.loads(Path(str(out) + ".meta.json").read_text())
    assert meta["oversize"] == "split"
    assert meta["counts"]["pieces"] == report.pieces and meta["counts"]["rejected_turns"] == 2
    summary = report.summary()
    assert f"5 split into {report.pieces} pieces" in summary and "rejected turns      : 2" in summary

    cached, plain = _datasets(out, tok, "chat-template", 512)
    with warnings.catch_warnings():
        warnings.simplefilter("error", PackedDataWarning)  # no piece is truncated
        rows = _assert_every_row_equal(cached, plain, 1)
    trained = sum(trained_tokens(c, tz) for c in convs if c.line not in splits)
    trained += sum(sum(r for r in runs if r > 0) for s in splits.values() for _, _, runs, _ in s.pieces)
    assert sum(int(a["num_trained_tokens"]) for a, _ in rows) == trained

    again = tmp_path / "again.jsonl.packed"  # worker processes and other shards: the same rows and token cache
    run_pack(PackConfig(inputs=[str(src)], output=str(again), tokenizer=str(tok), max_seq_len=512, oversize="split",
                        num_workers=2, shard_bytes=20000, progress=False, histogram=""))
    for suffix in ("", ".tokens.npy", ".tokens-index.npy"):
        assert Path(str(again) + suffix).read_bytes() == Path(str(out) + suffix).read_bytes()

    Path(str(out) + REPORT_SUFFIX).unlink()  # the re-pack command reads the policy from the sidecar too
    assert "--oversize split" in repack_hint(out, meta, tz.fmt, str(tok), 1024, 1)


def trained_tokens(conv, tz) -> int:
    """Tokens the loader trains of ``conv`` packed whole (targets ``[1:]``)."""
    tokens, runs = tokenize_conversation(conv.messages, tz, conv.tools, runs=True)
    return sum(r for r in runs if r > 0) - (runs[0] > 0)


def test_split_needs_a_format_that_masks_context(tmp_path):
    src = tmp_path / "in.jsonl"
    src.write_text('{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}\n')
    cfg = PackConfig(inputs=[str(src)], output=str(tmp_path / "o.jsonl.packed"), tokenizer="tok", max_seq_len=64,
                     prompt_format="identity", oversize="split")
    with pytest.raises(ValueError, match="--oversize split needs --prompt-format one of"):
        cfg.validate()
