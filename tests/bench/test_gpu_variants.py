"""bench/gpu_variants.py at toy size on CPU (fp32), through the variants part of bench/gpu_check.sh on pre-packed rows
(GPU_CHECK_ROWS): every variant CI can run is measured and matches base, and a variant over its time cap is a row, not
the end of the run (the GPU figures are a bench)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from test_gpu_profile_step import pack_toy_rows

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_variants_rows_parity_and_host_syncs_on_cpu(tmp_path, shared_data):
    packed, _ = pack_toy_rows(tmp_path, shared_data)
    env = {**os.environ, "GPU_CHECK_CPU": "1", "GPU_CHECK_PARTS": "variants", "GPU_CHECK_ROWS": str(packed),
           "GPU_CHECK_VARIANT_ARGS": "--caps varlen=0.001 --warmup 1 --timed 1", "OUT": str(tmp_path),
           "GPU_CHECK_DATA": str(shared_data), "PYTHON": sys.executable, "OMP_NUM_THREADS": "1",
           "WHEELS": str(tmp_path / "no-wheels")}
    proc = subprocess.run(["bash", str(REPO / "bench" / "gpu_check.sh")], capture_output=True, text=True, env=env,
                          timeout=400)
    table = (tmp_path / "gpu_check.txt").read_text()
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]    # varlen failed on purpose (1 ms cap)
    checks = [line.split()[:2] for line in table.splitlines()]
    assert ["pack-gsm8k-512", "reused"] in checks and ["variants", "FAIL"] in checks, table
    out = tmp_path / "variants.json"
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
    # the layers' reads, the device-side norm, clip and skip the rest
    assert rows["base"]["syncs_per_step"] > rows["rope"]["syncs_per_step"] > rows["fused_adam"]["syncs_per_step"] == 0
    assert rows["base"]["attention_kernel"] == "sdpa per conversation (forced: base)"
    assert "FAIL  VariantTimeout" in (tmp_path / "variants.txt").read_text()
    assert (rows["base"]["loss"], rows["base"]["grad_norm"]) == (rows["fused_adam"]["loss"],
                                                                 rows["fused_adam"]["grad_norm"])
