"""bench/gpu_check.sh in its CPU mode: every step but the CUDA-only ones runs, so on a GPU it can fail only there."""

import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_gpu_check_runs_end_to_end_on_cpu(tmp_path, shared_data):
    env = {**os.environ, "GPU_CHECK_CPU": "1", "OUT": str(tmp_path), "GPU_CHECK_DATA": str(shared_data),
           "PYTHON": sys.executable, "OMP_NUM_THREADS": "1", "WHEELS": str(tmp_path / "no-wheels")}
    proc = subprocess.run(["bash", str(REPO / "bench" / "gpu_check.sh")], capture_output=True, text=True, env=env,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    table = (tmp_path / "gpu_check.txt").read_text()
    for check in ("pack-gsm8k-512", "train-1b-bf16-distopt", "step-without-syncs", "resume-after-stop", "loss-bench"):
        assert any(line.startswith(check) and " ok " in line for line in table.splitlines()), table
    result = json.loads((tmp_path / "train.json").read_text())
    assert result["ok"] and result["sync_ratio"] > 0 and result["mfu"] is None   # no peak known for a CPU
    assert result["resume"]["resume_rel_diff"] == 0.0   # CPU runs are deterministic: the resume is bit-exact
    assert tarfile.open(tmp_path / "logs.tar.gz").getnames()
