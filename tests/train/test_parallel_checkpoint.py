"""A trainer checkpoint saved at TP=2 resumes at TP=1, and one saved at DP=2 resumes at DP=1, with the same next loss.

Each run is ``tools/train.py`` in fresh processes (``torch.distributed.run`` for 2 ranks; ``dist_checkpointing``'s
save needs the script's ``__main__`` guard). Data: 4 real packed rows (the shortest hh-rlhf conversations, SmolLM2
tokenizer, ``max_seq_len`` 256) and ``train.global_batch_size`` 4, so every step trains on all rows; the DP change
trains global batches of 2 rows, so step 2 trains the other half of the epoch's order: the resumed run has the same
step-2 loss only when it continues on the 2-rank run's next global batch (the loader's state of a global order
resumes at another DP size; ``restore_data_order=false`` would train step 1's rows again).
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from distributed_helpers import short_conversation_lines

from packsft.packing.config import PackConfig
from packsft.packing.pipeline import run_pack

REPO = Path(__file__).resolve().parents[2]
SEQ, ROWS = 256, 4

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


@pytest.fixture(scope="module")
def config(tmp_path_factory, shared_data, tokenizer_dir) -> Path:
    """Tiny-model YAML over 4 packed rows (hidden 64, 2 layers, fp32, lr 3e-3, checkpoint every step)."""
    out = tmp_path_factory.mktemp("ckpt")
    (out / "in.jsonl").write_text("\n".join(short_conversation_lines(shared_data, 17)) + "\n")
    tokenizer = str(tokenizer_dir("smollm2-135m-instruct"))
    packed = out / "rows.jsonl.packed"
    run_pack(PackConfig(inputs=[str(out / "in.jsonl")], output=str(packed), max_seq_len=SEQ, algorithm="next-fit",
                        tokenizer=tokenizer, histogram="", progress=False))
    assert len(packed.read_text().splitlines()) == ROWS
    cfg = {
        "model": {"num_layers": 2, "hidden_size": 64, "ffn_hidden_size": 128, "num_attention_heads": 4,
                  "num_query_groups": 2, "vocab_size": 49152, "max_position_embeddings": SEQ,
                  "tie_word_embeddings": True},
        "data": {"train_path": str(packed), "tokenizer": tokenizer, "max_seq_len": SEQ},
        "optimizer": {"lr": 3e-3, "weight_decay": 0.1},
        "scheduler": {"warmup_steps": 1, "decay_style": "constant"},
        "train": {"global_batch_size": ROWS, "train_steps": 2},
        "checkpoint": {"save_interval": 1, "save_at_end": False},
        "logging": {"progress": False, "tensorboard": False},
    }
    (out / "c.yaml").write_text(yaml.safe_dump(cfg))
    return out / "c.yaml"


def _train(config: Path, output_dir: Path, nproc: int, *overrides: str) -> dict[int, float]:
    """Run ``tools/train.py`` on ``nproc`` processes; return ``{step: loss}`` from its ``metrics.jsonl``."""
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    cmd = [*(launcher if nproc > 1 else [sys.executable]), str(REPO / "tools" / "train.py"), "--config", str(config),
           f"logging.output_dir={output_dir}", *overrides]
    env = {"OMP_NUM_THREADS": "1", "PATH": os.environ.get("PATH", "")}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    records = [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records if r["kind"] == "train"}


@pytest.mark.parametrize(("two_rank", "one_rank"), [(("parallel.tensor_model_parallel_size=2",), ()),
                                                     (("train.global_batch_size=2",), ("train.global_batch_size=2",))],
                         ids=["tp2_to_tp1", "dp2_to_dp1"])
def test_two_rank_checkpoint_resumes_on_one_rank_with_the_same_next_loss(tmp_path, config, two_rank, one_rank):
    two = _train(config, tmp_path / "two", 2, *two_rank)       # 2 ranks: TP=2, or DP=2 when no TP is given
    assert sorted(two) == [1, 2]
    saved = tmp_path / "two" / "checkpoints" / "iter_0000001"
    one = _train(config, tmp_path / "one", 1, f"checkpoint.resume={saved}", *one_rank)
    assert sorted(one) == [2]                                  # resumed after step 1
    assert abs(two[2] - two[1]) > 1e-2                         # the update between the steps is visible
    print(two_rank or "dp=2", "step-2 loss", two[2], "resumed", one[2], "diff", abs(one[2] - two[2]))
    assert abs(one[2] - two[2]) < 1e-5, (two, one)
