"""packsft.train.memory and tools/plan_memory.py: parameter counts, static bytes, row length, and the formula
against a measured CPU step."""

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
from distributed_helpers import parallel_state_1proc, tool_forked  # noqa: F401 - fixture

from packsft.layout import MAX_SEQ_LEN
from packsft.model.config import ModelConfig
from packsft.train.memory import Layout, max_seq_len, num_parameters, plan, static_bytes_per_parameter

REPO = Path(__file__).resolve().parents[2]
LLAMA_8B = ModelConfig(num_layers=32, hidden_size=4096, ffn_hidden_size=14336, num_attention_heads=32,
                       num_query_groups=8, vocab_size=128256, max_position_embeddings=131072)
GB80 = 80e9


@pytest.mark.parametrize("overrides", [{}, {"tie_word_embeddings": True}, {"add_qkv_bias": True}])
def test_num_parameters_equals_the_built_model(parallel_state_1proc, overrides):  # noqa: F811
    from packsft.model.gpt import build_gpt_model

    cfg = ModelConfig(num_layers=2, hidden_size=64, ffn_hidden_size=96, num_attention_heads=4, num_query_groups=2,
                      vocab_size=500, max_position_embeddings=64, **overrides)
    assert num_parameters(cfg) == sum(p.numel() for p in build_gpt_model(cfg).parameters())
    assert num_parameters(LLAMA_8B) == pytest.approx(8.03e9, rel=1e-3)


def test_static_bytes_per_parameter():
    assert static_bytes_per_parameter(Layout()) == 4 + 4 + 8 + 2                      # fp32 AdamW + autocast copies
    assert static_bytes_per_parameter(Layout(dp=2)) == 18                            # main_grad is DDP's buffer
    assert static_bytes_per_parameter(Layout(autocast=False, dp=2, distributed_optimizer=True)) == 8 + 8 / 2
    mega = Layout(bf16=True, autocast=False, dp=8)
    assert static_bytes_per_parameter(mega) == 2 + 4 + 12
    assert static_bytes_per_parameter(replace(mega, distributed_optimizer=True)) == 6 + 12 / 8
    assert static_bytes_per_parameter(replace(mega, distributed_optimizer=True, cp=2)) == 6 + 12 / 16


def test_levers_reduce_memory_and_the_longest_row_is_the_edge():
    base = Layout(tp=4, cp=2, dp=2)
    at = plan(LLAMA_8B, base, 16384, GB80)
    assert plan(LLAMA_8B, replace(base, recompute="full"), 16384, GB80).activations < at.activations / 3
    assert plan(LLAMA_8B, replace(base, sequence_parallel=True), 16384, GB80).activations < at.activations
    assert plan(LLAMA_8B, replace(base, fused_loss=False), 16384, GB80).loss > 5 * at.loss
    longest = max_seq_len(LLAMA_8B, base, GB80)
    assert 16384 < longest < 32768                           # configs/llama3_8b_multigpu.yaml's 16k rows fit
    assert plan(LLAMA_8B, base, longest, GB80).fits and not plan(LLAMA_8B, base, longest + 4, GB80).fits
    with pytest.raises(ValueError, match=r"vocab_size \(128257\) must be a multiple of tensor_model_parallel_size"):
        replace(LLAMA_8B, vocab_size=128257).check_parallel_fit(tp=4)   # the training config and converter refuse it
    sp = replace(base, tp=8, cp=3, sequence_parallel=True)   # rows of a multiple of lcm(6, 24) under SP
    assert max_seq_len(LLAMA_8B, sp, GB80) % 24 == 0 and plan(LLAMA_8B, sp, max_seq_len(LLAMA_8B, sp, GB80), GB80).fits


def test_the_longest_row_is_at_most_what_packsft_packs():
    tiny = ModelConfig(num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4, num_query_groups=2,
                       vocab_size=1000, max_position_embeddings=512)
    assert max_seq_len(tiny, Layout(cp=3), 1e15) == MAX_SEQ_LEN // 6 * 6   # memory alone: 45M tokens and more


def test_plan_memory_cli():
    """``tools/plan_memory.py``'s ``main`` in forks of the tests' fork server (``distributed_helpers.tool_forked``)."""
    run = ["--config", REPO / "configs" / "llama3_8b_multigpu.yaml", "--world-size", "16"]
    out = tool_forked("plan_memory", *run, check=False)
    assert out.returncode == 0, out.stderr
    assert "fits" in out.stdout and "with full recompute" in out.stdout and "distributed optimizer" in out.stdout
    for value in ("lots", "80", "1KB", "1.2.3GB"):          # a bare number would be bytes: refused
        bad = tool_forked("plan_memory", *run, "--gpu-memory", value, check=False)
        assert bad.returncode == 2 and bad.stderr.startswith("error:"), (value, bad.stderr)
    sweep = tool_forked("plan_memory", *run, "--sweep", "--seq-lens", "8192", "32768", check=False)
    assert sweep.returncode == 0 and "| 4 | 2 | 1 | 2 |" in sweep.stdout


@pytest.mark.slow
@pytest.mark.parametrize("seq_len", [4096, 8192])
def test_formula_within_20_percent_of_a_measured_cpu_step(seq_len):
    out = subprocess.run([sys.executable, str(REPO / "bench" / "memory.py"), "--one", str(seq_len)],
                         capture_output=True, text=True, timeout=300,
                         env={"OMP_NUM_THREADS": "1", "MALLOC_MMAP_THRESHOLD_": "65536", "PATH": ""})
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert 0.8 <= result["ratio"] <= 1.2, result
