"""bench/gpu_profile_step.py at toy size on CPU: the table and the attention rows come out (the GPU run is a bench)."""

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def pack_toy_rows(tmp_path: Path, shared_data: Path) -> tuple[Path, Path]:
    """60 gsm8k conversations packed into 512-token rows with the SmolLM2 tokenizer: ``(rows file, tokenizer)``."""
    conversations = tmp_path / "c.jsonl"
    lines = (shared_data / "chat" / "gsm8k_train.messages.jsonl").read_text().splitlines()[:60]
    conversations.write_text("\n".join(lines) + "\n")
    tok = shared_data / "tokenizers" / "smollm2-135m-instruct"
    packed = tmp_path / "rows.jsonl.packed"
    subprocess.run([sys.executable, str(REPO / "tools" / "pack_megatron_sft_jsonl.py"), "--input", str(conversations),
                    "--output", str(packed), "--tokenizer", str(tok), "--max-seq-length", "512", "--histogram", "",
                    "--no-progress"], check=True, capture_output=True, timeout=120)
    return packed, tok


@pytest.mark.slow
def test_profile_step_prints_step_times_tables_and_attention_costs(tmp_path, shared_data):
    packed, tok = pack_toy_rows(tmp_path, shared_data)
    proc = subprocess.run(
        [sys.executable, str(REPO / "bench" / "gpu_profile_step.py"),
         "--config", str(REPO / "configs" / "tiny_cpu.yaml"),
         "--steps", "1", "--warmup", "1", "--rows", "5", "model.num_layers=2", "model.hidden_size=64",
         "model.ffn_hidden_size=128", "model.num_attention_heads=4", "model.num_query_groups=2",
         "model.vocab_size=49152", "model.tie_word_embeddings=true", "model.max_position_embeddings=512",
         f"data.train_path={packed}", f"data.tokenizer={tok}", "data.max_seq_len=512", "data.split_validation_size=0",
         "validation.val_period=0", "validation.val_at_end=false", "train.global_batch_size=2",
         "checkpoint.resume=none", f"logging.output_dir={tmp_path / 'run'}", "logging.tensorboard=false"],
        capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert "trainer built in" in out and "warm-up step 1:" in out and "tokens/s; device busy: n/a (no GPU)" in out
    assert "Self CPU" in out   # the profiler's host table
    for variant in ("built backend (TorchCoreAttention)", "one causal SDPA, whole row"):
        assert f"attention  {variant}" in out and "ms fwd+bwd" in out
    assert "attention  varlen_attn" in out   # on CPU: reported unavailable, with the reason
