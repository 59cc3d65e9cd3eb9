"""HF conversion under tensor parallelism (2 gloo processes): import shards, export gathers, TP2 -> TP1 via the CLI
(the import under ``torchrun``, the export in this process)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from distributed_helpers import parallel_state_1proc, run_distributed  # noqa: F401 - fixture
from test_hf_io import LENGTHS, VOCAB, hf_model, megatron_logits
from test_init_from import convert_in_process
from transformers import AutoModelForCausalLM

from packsft.data.context_parallel import make_packed_seq_params
from packsft.model.gpt import build_gpt_model
from packsft.model.hf_config import model_config_from_hf
from packsft.model.hf_io import load_hf_state_into_model, save_hf_checkpoint
from packsft.train.distributed import init_distributed

REPO_ROOT = Path(__file__).resolve().parents[2]
FAMILIES = ("llama", "qwen2", "qwen3")                      # tied, untied with QKV bias, q/k norms + head_dim
pytestmark = [pytest.mark.distributed, pytest.mark.slow]


def _import_and_export_tp2(rank, world_size, out_dir):
    ctx = init_distributed(tensor_model_parallel_size=2)
    return {family: _check_family(rank, ctx, family, Path(out_dir) / family) for family in FAMILIES}


def _check_family(rank, ctx, family, out_dir):
    model = hf_model(family, seed=11)                       # same seed: every rank holds the same HF model
    cfg = model_config_from_hf(model.config)
    megatron = build_gpt_model(cfg).eval()
    load_hf_state_into_model(megatron, model.state_dict(), cfg, ctx.tp_group)
    cu = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()], dtype=torch.int32)
    tokens = torch.randint(0, VOCAB, (1, int(cu[-1])), generator=torch.Generator().manual_seed(3))
    position_ids = torch.cat([torch.arange(n) for n in LENGTHS])[None]
    packed = megatron_logits(megatron, tokens, position_ids, make_packed_seq_params(cu, max(LENGTHS)))
    vocab = slice(rank * VOCAB // 2, (rank + 1) * VOCAB // 2)    # parallel_output: this rank's vocab shard
    diffs = []
    for s, e in zip(cu[:-1].tolist(), cu[1:].tolist()):
        with torch.no_grad():
            alone = model(tokens[:, s:e]).logits[0, :, vocab]
        diffs.append((packed[s:e] - alone).abs().max().item())
    save_hf_checkpoint(megatron, cfg, out_dir, hf_config=model.config, tp_group=ctx.tp_group)
    return max(diffs), packed.shape


def test_tp2_import_matches_transformers_and_export_gathers(tmp_path):
    results = run_distributed(_import_and_export_tp2, 2, str(tmp_path))
    for family in FAMILIES:
        assert [r[family][1] for r in results] == [(32, VOCAB // 2)] * 2
        assert max(r[family][0] for r in results) < 1e-4
        exported = AutoModelForCausalLM.from_pretrained(tmp_path / family, dtype=torch.float32)
        original = hf_model(family, seed=11)
        assert exported.state_dict().keys() == original.state_dict().keys()
        assert all(torch.equal(exported.state_dict()[k], v) for k, v in original.state_dict().items())


def _run(*args):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, *args], cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]


def test_cli_import_tp2_then_export_tp1_is_exact(tmp_path, tokenizer_dir, parallel_state_1proc):  # noqa: F811
    original = hf_model("mistral", seed=12, vocab_size=49152)   # export refuses a tokenizer larger than the model
    original.save_pretrained(tmp_path / "src")
    tool = str(REPO_ROOT / "tools" / "convert_checkpoint.py")
    _run("-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", tool, "import",
         "--hf", str(tmp_path / "src"), "--out", str(tmp_path / "mcore"))
    assert {"model_config.json", "hf_config.json", ".metadata"} <= {p.name for p in (tmp_path / "mcore").iterdir()}
    convert_in_process("export", "--megatron", tmp_path / "mcore", "--out", tmp_path / "hf",
                       "--tokenizer", tokenizer_dir("smollm2-135m-instruct"))
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32)
    assert type(exported).__name__ == "MistralForCausalLM"
    assert exported.config.sliding_window == original.config.sliding_window
    assert all(torch.equal(exported.state_dict()[k], v) for k, v in original.state_dict().items())
    assert (tmp_path / "hf" / "tokenizer.json").is_file()
