"""A trainer checkpoint saved at TP=2 resumes at TP=1, and one saved at DP=4 resumes at DP=2 and at DP=1, with the
same next loss.

Each run is ``tools/train.py``'s ``main`` in fresh processes, forks of the tests' fork server (one per rank, with
torchrun's variables: ``test_loop.train_forked``). Data: real packed rows of the shortest hh-rlhf
conversations (SmolLM2 tokenizer, ``max_seq_len`` 256). The TP change trains all 4 rows of its file each step. The DP
change trains global batches of 4 of at least 8 rows (one micro-batch per rank at DP=4, two at DP=2, four at DP=1),
so step 2 trains rows step 1 did not: a resumed run has the same step-2 loss only when it continues on the DP=4 run's
next global batch (the loader's state of a global order resumes at another DP size and micro-batch count;
``restore_data_order=false`` would start the order again).
"""

import json
from pathlib import Path

import pytest
import yaml
from distributed_helpers import short_conversation_lines
from test_loop import train_forked

from packsft.packing.config import PackConfig
from packsft.packing.pipeline import run_pack

SEQ, ROWS = 256, 4
NO_SAVE = "checkpoint.save_interval=0"   # a resumed run: its checkpoints would be read by no test

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


def _pack(out: Path, lines: list[str], tokenizer: str) -> Path:
    (out / "in.jsonl").write_text("\n".join(lines) + "\n")
    packed = out / "rows.jsonl.packed"
    run_pack(PackConfig(inputs=[str(out / "in.jsonl")], output=str(packed), max_seq_len=SEQ, algorithm="next-fit",
                        tokenizer=tokenizer, histogram="", progress=False))
    return packed


@pytest.fixture(scope="module")
def config(tmp_path_factory, shared_data, tokenizer_dir) -> Path:
    """Tiny-model YAML over 4 packed rows (hidden 64, 2 layers, fp32, lr 3e-3, checkpoint every step)."""
    out = tmp_path_factory.mktemp("ckpt")
    tokenizer = str(tokenizer_dir("smollm2-135m-instruct"))
    packed = _pack(out, short_conversation_lines(shared_data, 17), tokenizer)
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
    """Run ``tools/train.py``'s ``main`` on ``nproc`` fresh ranks (:func:`test_loop.train_forked`); return
    ``{step: loss}`` from its ``metrics.jsonl``."""
    train_forked(config, f"logging.output_dir={output_dir}", *overrides, nproc=nproc)
    records = [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records if r["kind"] == "train"}


def test_tp2_checkpoint_resumes_on_one_rank_with_the_same_next_loss(tmp_path, config):
    two = _train(config, tmp_path / "two", 2, "parallel.tensor_model_parallel_size=2")
    assert sorted(two) == [1, 2]
    saved = tmp_path / "two" / "checkpoints" / "iter_0000001"
    one = _train(config, tmp_path / "one", 1, f"checkpoint.resume={saved}", NO_SAVE)
    assert sorted(one) == [2]                                  # resumed after step 1
    assert abs(two[2] - two[1]) > 1e-2                         # the update between the steps is visible
    assert abs(one[2] - two[2]) < 1e-5, (two, one)


def test_dp4_checkpoint_resumes_at_dp2_and_dp1_on_the_next_global_batch(tmp_path, config, shared_data):
    packed = _pack(tmp_path, short_conversation_lines(shared_data, 40), yaml.safe_load(config.read_text())["data"][
        "tokenizer"])
    assert len(packed.read_text().splitlines()) >= 8
    rows = [f"data.train_path={packed}", "train.global_batch_size=4"]
    four = _train(config, tmp_path / "four", 4, *rows)
    assert sorted(four) == [1, 2] and abs(four[2] - four[1]) > 1e-2
    saved = tmp_path / "four" / "checkpoints" / "iter_0000001"
    for nproc in (2, 1):
        resumed = _train(config, tmp_path / f"dp{nproc}", nproc, f"checkpoint.resume={saved}", NO_SAVE, *rows)
        assert sorted(resumed) == [2]
        assert abs(resumed[2] - four[2]) < 1e-5, (nproc, four, resumed)
