"""bench/gpu_variants.py at toy size on CPU (fp32): every variant CI can run is measured, matches base, and a variant
over its time cap is a row, not the end of the run (the GPU figures are a bench)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_variants_rows_parity_and_host_syncs_on_cpu(tmp_path, shared_data):
    conversations = tmp_path / "c.jsonl"
    lines = (shared_data / "chat" / "gsm8k_train.messages.jsonl").read_text().splitlines()[:60]
    conversations.write_text("\n".join(lines) + "\n")
    tok = shared_data / "tokenizers" / "smollm2-135m-instruct"
    packed = tmp_path / "rows.jsonl.packed"
    subprocess.run([sys.executable, str(REPO / "tools" / "pack_megatron_sft_jsonl.py"), "--input", str(conversations),
                    "--output", str(packed), "--tokenizer", str(tok), "--max-seq-length", "512", "--histogram", "",
                    "--no-progress"], check=True, capture_output=True, timeout=120)
    out = tmp_path / "variants.json"
    proc = subprocess.run(
        [sys.executable, str(REPO / "bench" / "gpu_variants.py"), "--config", str(REPO / "configs" / "tiny_cpu.yaml"),
         "--variants", "base,varlen,rope,fused_adam,stock_loss,te", "--caps", "varlen=0.001", "--json", str(out),
         "--text", str(tmp_path / "variants.txt"), "--warmup", "1", "--timed", "1",
         "model.num_layers=2", "model.hidden_size=64", "model.ffn_hidden_size=128", "model.num_attention_heads=4",
         "model.num_query_groups=2", "model.vocab_size=49152", "model.tie_word_embeddings=true",
         "model.max_position_embeddings=512", f"data.train_path={packed}", f"data.tokenizer={tok}",
         "data.max_seq_len=512", "data.split_validation_size=0", "validation.val_period=0",
         "validation.val_at_end=false", "train.global_batch_size=2", "optimizer.backend=megatron",
         "optimizer.use_distributed_optimizer=true", "checkpoint.resume=none", "checkpoint.save_at_end=false",
         f"logging.output_dir={tmp_path / 'run'}", "logging.tensorboard=false"],
        capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1, proc.stderr[-3000:]        # varlen failed on purpose (its 1 ms cap)
    rows = {r["name"]: r for r in json.loads(out.read_text())["variants"]}
    assert list(rows) == ["base", "varlen", "rope", "fused_adam", "stock_loss", "te"]
    assert rows["varlen"]["ok"] is False and "time cap" in rows["varlen"]["error"]   # the run went on after it
    assert rows["te"]["ok"] is None and rows["te"]["error"].startswith("skipped")    # no TransformerEngine here
    for name in ("base", "rope", "fused_adam", "stock_loss"):
        row = rows[name]
        assert row["ok"] and row["tokens_per_s"] > 0 and row["mfu_6p"] is None, row   # no peak known for a CPU
    for name in ("rope", "fused_adam", "stock_loss"):        # fp32: the same loss and gradients as base
        assert rows[name]["parity"].startswith("ok") and rows[name]["norm_rel_diff"] <= 1e-4, rows[name]
    # base reads the device back in every layer (Megatron's THD RoPE) and for the norm; the sync-free RoPE removes
    # the layers' reads and the device-side norm the rest but the step's one skip decision
    assert rows["base"]["syncs_per_step"] > rows["rope"]["syncs_per_step"] > rows["fused_adam"]["syncs_per_step"] == 1
    assert rows["base"]["attention_kernel"] == "sdpa per conversation (forced: base)"
    assert "FAIL  VariantTimeout" in (tmp_path / "variants.txt").read_text()
