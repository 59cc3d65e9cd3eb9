"""The Megatron presets against Megatron-LM's own ``SFTDataset`` (golden fixture, no network).

``tests/fixtures/megatron_sft_golden.json`` was written by ``tools/make_megatron_sft_fixtures.py`` from Megatron-LM's
source (the commit is in the fixture); rerun that script against a newer Megatron-LM to refresh it.
"""

import json
import warnings
from pathlib import Path

import pytest

import packsft.data.dataset as dataset_module
from packsft.data.dataset import PackedSFTDataset
from packsft.packing.config import PackConfig
from packsft.packing.pipeline import run_pack
from packsft.prompt_formats import (
    NonMegatronError,
    PromptFormatError,
    Tokenization,
    get_prompt_format,
    tokenize_conversation,
)
from packsft.tokenizer import load_tokenizer

GOLDEN = json.loads((Path(__file__).parents[1] / "fixtures" / "megatron_sft_golden.json").read_text(encoding="utf-8"))
CASES = [(preset, k) for preset, spec in GOLDEN["presets"].items() for k in range(len(spec["rows"]))]


@pytest.fixture(scope="module")
def tok(tokenizer_dir):
    return load_tokenizer(tokenizer_dir(GOLDEN["tokenizer"]))


def test_fixture_names_its_megatron_commit_and_covers_every_preset_and_cp():
    commit = GOLDEN["megatron_lm_commit"]
    assert len(commit) == 40 and int(commit, 16) >= 0
    assert set(GOLDEN["presets"]) == {"identity", "nemotron-nano-v2", "nemotron-h-aligned"}
    for spec in GOLDEN["presets"].values():
        assert {r["context_parallel_size"] for r in spec["rows"]} == {1, 2}


@pytest.mark.parametrize(("preset", "k"), CASES, ids=[f"{p}-{k}" for p, k in CASES])
def test_loader_matches_megatron_sft_dataset(tmp_path, monkeypatch, tok, preset, k):
    monkeypatch.setattr(dataset_module, "tokenizer_fingerprint", lambda t: "no sidecar")  # 1 s saved per row
    case = GOLDEN["presets"][preset]["rows"][k]
    L, cp = case["max_seq_len"], case["context_parallel_size"]
    messages = [m for name in case["conversations"] for m in GOLDEN["conversations"][name]]
    path = tmp_path / "rows.jsonl.packed"
    path.write_text(json.dumps({"messages": messages}, ensure_ascii=False) + "\n", encoding="utf-8")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # no sidecar; the "long" row is truncated
        ds = PackedSFTDataset(path, tok, preset, L, cp)
        row = ds[0]
    assert ds.prompt_format.pad_token_id == GOLDEN["presets"][preset]["pad_id"]
    assert row["tokens"].tolist() == case["tokens"]
    assert row["position_ids"].tolist() == case["position_ids"]
    assert row["cu_seqlens_padded"].tolist() == case["cu_seqlens"]
    mask, ref = row["loss_mask"].tolist(), case["loss_mask"]
    # the one documented difference in the mask: packsft never trains a label across a conversation boundary
    ends = {e - 1 for e in case["cu_seqlens"][1:-1]}
    differ = {i for i, (a, b) in enumerate(zip(mask, ref)) if a != b}
    assert differ <= ends and all(ref[i] == 1 and mask[i] == 0 for i in differ)
    expected_boundary = preset == "identity" and "empty_prompt" in case["conversations"][1:]
    assert len(differ) == (1 if expected_boundary else 0)
    labels = row["labels"].tolist()
    assert [labels[i] for i in range(L) if mask[i]] == [case["labels"][i] for i in range(L) if mask[i]]
    assert all(labels[i] == -100 for i in range(L) if not mask[i])  # Megatron-LM leaves the pad id there


@pytest.mark.parametrize("preset", sorted(GOLDEN["presets"]))
def test_packsft_refuses_exactly_what_megatron_refuses(tok, preset):
    refused = GOLDEN["presets"][preset]["refused"]
    fmt = get_prompt_format(preset, tok)
    for name, conv in GOLDEN["conversations"].items():
        if name in refused:
            with pytest.raises(PromptFormatError):
                tokenize_conversation(conv, Tokenization.of(tok, fmt))
        else:
            tokenize_conversation(conv, Tokenization.of(tok, fmt))


def test_identity_masks_like_megatron_and_refuses_merged_turns(tok):
    fmt = get_prompt_format("identity", tok)
    conv = GOLDEN["conversations"]["newline_ended"]
    tokens, targets = tokenize_conversation(conv, Tokenization.of(tok, fmt))
    assert tok.decode(tokens) == "".join(m["content"] for m in conv)
    assert tok.decode([t for t in targets if t != -100]) == "Blue.\nGreen.\n"
    with pytest.raises(NonMegatronError, match=r"messages\[1\]: a token crosses the boundary .*Megatron-LM"):
        tokenize_conversation(GOLDEN["conversations"]["merging_turns"], Tokenization.of(tok, fmt))
    with pytest.raises(NonMegatronError, match=r"messages\[1\]: assistant turn follows a 'system' turn"):
        tokenize_conversation(GOLDEN["conversations"]["assistant_after_system"], Tokenization.of(tok, fmt))


def test_pack_rejects_non_megatron_rows_or_keeps_them_as_packsft_only(tmp_path, tokenizer_dir, tok):
    convs = GOLDEN["conversations"]
    names = ["capital", "merging_turns", "assistant_after_assistant", "tool"]
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"messages": convs[n]}, ensure_ascii=False) + "\n" for n in names))
    cfg = dict(inputs=[str(src)], tokenizer=str(tokenizer_dir(GOLDEN["tokenizer"])), max_seq_len=128,
               prompt_format="identity", progress=False, histogram="")
    report = run_pack(PackConfig(output=str(tmp_path / "a.jsonl.packed"), **cfg))
    assert [(r["line"], r["reason"][:40]) for r in report.rejected] == [
        (2, "identity: messages[1]: a token crosses t"), (3, "identity: messages[3]: assistant turn fo")]
    assert all("--allow-non-megatron" in r["reason"] for r in report.rejected)
    assert json.loads((tmp_path / "a.jsonl.packed.meta.json").read_text())["megatron_lm_compatible"] is True

    with pytest.warns(UserWarning, match="packsft-only"):
        report = run_pack(PackConfig(output=str(tmp_path / "b.jsonl.packed"), allow_non_megatron=True, **cfg))
    # identity renders contents only: the tool conversation's call is warned about (its content is trained)
    assert not report.rejected and report.warning_counts() == {"non_megatron": 2, "tool_calls_not_rendered": 1}
    assert [(w["kind"], w["line"]) for w in report.warnings if w["kind"] != "non_megatron"] == [
        ("tool_calls_not_rendered", 4)]
    warned = [w for w in report.warnings if w["kind"] == "non_megatron"]
    assert [w["line"] for w in warned] == [2, 3]
    kept = "kept with --allow-non-megatron (packsft-only): "  # with the input's own message index, as rejected
    assert [w["message"][:58] for w in warned] == [kept + "messages[1]", kept + "messages[3]"]
    no_system = tmp_path / "no_system.jsonl"  # the packer adds the system message; the input's index is named
    turns = [{"role": "user", "content": "u"}, {"role": "assistant", "content": "a"},
             {"role": "assistant", "content": "b"}]
    no_system.write_text(json.dumps({"messages": turns}) + "\n")
    with pytest.warns(UserWarning, match="packsft-only"):
        added = run_pack(PackConfig(output=str(tmp_path / "c.jsonl.packed"), allow_non_megatron=True,
                                    **{**cfg, "inputs": [str(no_system)]}))
    assert [w["message"][:58] for w in added.warnings] == [kept + "messages[2]"]
    meta = json.loads((tmp_path / "b.jsonl.packed.meta.json").read_text())
    assert meta["megatron_lm_compatible"] is False and meta["counts"]["warnings"] == report.warning_counts()
    ds = PackedSFTDataset(tmp_path / "b.jsonl.packed", tok, "identity", 128)
    assert sum(int(ds[i]["cu_seqlens"][-1]) for i in range(len(ds))) == report.real_tokens


def test_an_identity_file_packed_before_the_megatron_masking_is_refused(tmp_path, tokenizer_dir):
    from packsft.data.dataset import PackedSFTDataset
    from packsft.packing.config import PackConfig
    from packsft.packing.pipeline import run_pack
    from packsft.sidecar import SidecarError, read_sidecar, write_sidecar

    src = tmp_path / "a.jsonl"
    src.write_text('{"messages": [{"role": "user", "content": "Hi\\n"}, {"role": "assistant", "content": "Yo\\n"}]}\n')
    out = tmp_path / "a.jsonl.packed"
    tok = str(tokenizer_dir("nemotron-h-layout-tekken"))
    run_pack(PackConfig(inputs=[str(src)], output=str(out), tokenizer=tok, max_seq_len=64, prompt_format="identity",
                        progress=False, histogram=""))
    assert len(PackedSFTDataset(out, tok, "identity", 64)) == 1
    meta = read_sidecar(out)
    meta = {k: v for k, v in meta.items() if k != "megatron_lm_compatible"}
    meta["format_version"] = 1                               # what the earlier packsft wrote
    write_sidecar(out, meta)
    with pytest.raises(SidecarError, match="packed for identity by an earlier packsft"):
        PackedSFTDataset(out, tok, "identity", 64)
