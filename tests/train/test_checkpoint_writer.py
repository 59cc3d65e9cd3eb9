"""A ``dist_checkpointing`` writer process that fails or dies ends the save with an ``error:`` line naming it, never
a hang (Megatron-Core waits on its forked writers without a bound: ``packsft.train.process_guard``).

The tools run in fresh processes through a ``-c`` prelude that breaks the writers the way a user met it: ``psutil``
unimportable (a plain install before it was declared: each writer raises before it reports), or each writer killed
by SIGKILL (the kernel's OOM killer)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from tiny_offline import MAX_SEQ_LEN, write_inputs

REPO = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONWARNINGS": "ignore"}
NO_PSUTIL = "import sys; sys.modules['psutil'] = None"   # `import psutil` raises ImportError, in forks too
KILLED_WRITER = ("import os, signal\n"
                 "from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync\n"
                 "FileSystemWriterAsync.write_preloaded_data = staticmethod("
                 "lambda *a, **k: os.kill(os.getpid(), signal.SIGKILL))")


def run_tool(prelude: str, tool: str, *args: str, timeout: int = 150) -> subprocess.CompletedProcess:
    """Run ``tool`` as ``__main__`` after ``prelude`` (a hang fails through ``timeout``)."""
    code = f"{prelude}\nimport runpy, sys\nsys.argv = {[tool, *args]!r}\nrunpy.run_path({tool!r}, run_name='__main__')"
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout, env=ENV,
                          cwd=REPO)


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    return write_inputs(tmp_path_factory.mktemp("writer"))


@pytest.mark.slow
@pytest.mark.timeout(200)
@pytest.mark.parametrize("prelude, says", [(NO_PSUTIL, "RuntimeError: psutil is not installed"),
                                           (KILLED_WRITER, "ended with exit code -9")], ids=["no-psutil", "sigkill"])
def test_import_with_a_failing_writer_is_an_error_line(inputs, tmp_path, prelude, says):
    out = tmp_path / "imported"
    proc = run_tool(prelude, "tools/convert_checkpoint.py", "import", "--hf", str(inputs["hf"]), "--out", str(out))
    lines = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert len(lines) == 1 and lines[0].startswith(f"error: cannot write checkpoint {out}: rank 0: "), lines
    assert "checkpoint writer process" in lines[0] and says in lines[0], lines
    assert not out.exists()
    assert "Traceback" not in "\n".join(proc.stderr.splitlines()[-3:])


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_training_save_with_a_failing_writer_is_an_error_line(inputs, tmp_path):
    from packsft.packing.config import PackConfig
    from packsft.packing.pipeline import run_pack

    rows = tmp_path / "rows.jsonl.packed"
    run_pack(PackConfig(inputs=[str(inputs["chats"])], output=str(rows), max_seq_len=MAX_SEQ_LEN,
                        tokenizer=str(inputs["tokenizer"]), prompt_format="identity", histogram="", progress=False))
    config = tmp_path / "train.yaml"
    config.write_text(yaml.safe_dump({
        "model": {"num_layers": 1, "hidden_size": 32, "ffn_hidden_size": 64, "num_attention_heads": 4,
                  "num_query_groups": 2, "vocab_size": 32, "max_position_embeddings": MAX_SEQ_LEN,
                  "attention_backend": "torch", "params_dtype": "float32"},
        "data": {"train_path": str(rows), "tokenizer": str(inputs["tokenizer"]), "prompt_format": "identity",
                 "max_seq_len": MAX_SEQ_LEN},
        "train": {"global_batch_size": 1, "train_steps": 3},
        "checkpoint": {"save_interval": 1},
        "logging": {"output_dir": str(tmp_path / "run"), "progress": False, "tensorboard": False}}))
    proc = run_tool(NO_PSUTIL, "tools/train.py", "--config", str(config))
    lines = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert proc.returncode == 1, proc.stderr[-3000:]
    tmp = tmp_path / "run" / "checkpoints" / "iter_0000001.tmp"
    assert len(lines) == 1 and lines[0].startswith(f"error: cannot write checkpoint {tmp}: rank 0: "), lines
    assert "RuntimeError: psutil is not installed" in lines[0], lines
    assert not (tmp_path / "run" / "checkpoints" / "latest").exists()
