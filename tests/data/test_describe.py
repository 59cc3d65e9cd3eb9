"""tools/inspect_packed.py and packsft.data.describe: what a person sees of a row."""

import importlib.util
from pathlib import Path

import pytest
from test_dataset import ROWS, TEKKEN, conv, load_cached, write_packed

from packsft.data.dataset import PackedSFTDataset
from packsft.data.describe import describe_row
from packsft.prompt_formats import get_prompt_format

TOOL = Path(__file__).resolve().parents[2] / "tools" / "inspect_packed.py"


def load_tool():
    spec = importlib.util.spec_from_file_location("inspect_packed", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def tekken(tokenizer_dir):
    tok = load_cached(tokenizer_dir(TEKKEN))
    return tok, get_prompt_format("nemotron-nano-v2", tok)


def test_cli_shows_roles_trained_tokens_positions_and_statistics(tmp_path, tekken, tokenizer_dir, capsys):
    tok, fmt = tekken
    path = write_packed(tmp_path / "r.jsonl.packed", ROWS, tok, fmt, 96, cp=2)
    assert load_tool().main(["--packed", str(path), "--tokenizer", str(tokenizer_dir(TEKKEN)),
                             "--prompt-format", "nemotron-nano-v2", "--row", "0", "--color", "never"]) == 0
    out = capsys.readouterr().out
    row = PackedSFTDataset(path, tok, fmt, 96, 2)[0]
    assert "row 0 of 3 (" in out and "r.jsonl.packed:1)" in out
    assert "max_seq_len 96, context_parallel_size 2" in out                  # both taken from the sidecar
    assert f"trained tokens {row['num_trained_tokens']}, max_seqlen {row['max_seqlen']}" in out
    real, padded = row["cu_seqlens"].tolist(), row["cu_seqlens_padded"].tolist()
    assert f"cu_seqlens {real} (real), cu_seqlens_padded {padded}" in out
    assert "[system] position 0: <SPECIAL_10>System↵" in out
    assert "[user] position 3: <SPECIAL_11>User↵" in out
    assert "[assistant] position 10: <SPECIAL_11>Assistant↵\n    «Paris.↵\n    <SPECIAL_12>↵»" in out
    assert "── conversation 1 · row positions 20..95 · 20 tokens, 56 padding · 4 trained ──" in out
    assert "<pad×3>" in out and "\033[" not in out


def test_color_mode_uses_ansi_instead_of_markers(tmp_path, tekken):
    tok, fmt = tekken
    ds = PackedSFTDataset(write_packed(tmp_path / "c.jsonl.packed", ROWS, tok, fmt, 96), tok, fmt, 96)
    out = describe_row(ds, 1, color=True)
    assert "\033[32mBlue.↵\n    <SPECIAL_12>↵\033[0m" in out and "«" not in out and "legend" not in out


def test_truncated_and_untrained_rows_are_flagged(tmp_path, tekken):
    tok, fmt = tekken
    rows = [[conv("Hi", "Hello."), conv("Talk.", " ".join(["word"] * 40)), conv("Bye", "Bye.")],
            [conv("Only a question?", None)]]
    ds = PackedSFTDataset(write_packed(tmp_path / "t.jsonl.packed", rows, tok, fmt, 32), tok, fmt, 32)
    out = describe_row(ds, 0)
    assert "TRUNCATED: its conversations need" in out and "conversation(s) [2] were dropped" in out
    assert "── conversation 2: dropped (after max_seq_len) ──" in out
    assert "NO TRAINED TOKEN" in describe_row(ds, -1)


def test_identity_rows_show_each_turn_and_train_the_assistant_turns(tmp_path, tekken):
    tok, _ = tekken
    fmt = get_prompt_format("identity", tok)
    ds = PackedSFTDataset(write_packed(tmp_path / "i.jsonl.packed", ROWS, tok, fmt, 32), tok, fmt, 32)
    out = describe_row(ds, 0)
    assert "[user] position 0: Capital of France?\n[assistant] position 4: «Paris.»" in out
    assert "[system] position 0: Be brief.\n[user] position 3: 2+2?\n[assistant] position 7: «4»" in out


def test_cli_refuses_a_mismatched_file_with_exit_code_2(tmp_path, tekken, tokenizer_dir, capsys):
    tok, fmt = tekken
    path = write_packed(tmp_path / "m.jsonl.packed", ROWS, tok, fmt, 96, cp=1)
    assert load_tool().main(["--packed", str(path), "--tokenizer", str(tokenizer_dir(TEKKEN)),
                             "--prompt-format", "nemotron-nano-v2", "--context-parallel-size", "2"]) == 2
    assert "error: " in capsys.readouterr().err
