"""configs/mixture_cpu.yaml as the docs' walkthrough runs it: two packed sources (one from Parquet), a named
validation file, a few steps of the tiny CPU model, one ``val_loss/<name>`` curve per validation set."""

import json
from pathlib import Path

import pytest
from distributed_helpers import tool_forked

from packsft.packing.config import PackConfig
from packsft.packing.pipeline import run_pack

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_mixture_config_trains_and_logs_both_validation_curves(tmp_path, shared_data, tokenizer_dir):
    datasets = pytest.importorskip("datasets")
    chat = shared_data / "chat"
    mix, demo = tmp_path / "out" / "mix", tmp_path / "out" / "demo"
    mix.mkdir(parents=True)
    demo.mkdir()
    (demo / "smollm2-tokenizer").symlink_to(tokenizer_dir("smollm2-135m-instruct"))
    sources = {"chat_a.jsonl": (chat / "gsm8k_train.messages.jsonl", 120),
               "chat_b.parquet": (chat / "gpteacher.messages.jsonl", 60),
               "chat_test.jsonl": (chat / "gsm8k_test.messages.jsonl", 20)}
    for name, (path, n) in sources.items():
        lines = path.read_text().splitlines()[:n]
        if name.endswith(".parquet"):
            datasets.Dataset.from_list([json.loads(x) for x in lines]).to_parquet(str(mix / name))
        else:
            (mix / name).write_text("\n".join(lines) + "\n")
        run_pack(PackConfig(inputs=[str(mix / name)], output=str(mix / (name.split(".")[0] + ".jsonl.packed")),
                            tokenizer=str(demo / "smollm2-tokenizer"), max_seq_len=1024, oversize="drop",
                            progress=False, histogram=""))
    # tools/train.py's main in a fork of the tests' fork server, run from tmp_path (the config's paths are relative)
    tool_forked("train", "--config", REPO / "configs" / "mixture_cpu.yaml", "train.train_steps=4",
                "validation.val_period=2", "validation.max_batches=1", "checkpoint.save_interval=4", cwd=tmp_path,
                env={"HF_HUB_OFFLINE": "1"}, timeout_s=600)
    records = [json.loads(x) for x in (mix / "train" / "metrics.jsonl").read_text().splitlines()]
    vals = [r for r in records if r["kind"] == "validation"]
    assert [r["step"] for r in vals] == [2, 4]
    for r in vals:
        assert {"val_loss/chat_a", "val_loss/chat_test"} <= r.keys() and "val_loss/chat_b" not in r
        assert all(r[k] > 0 for k in ("val_loss/chat_a", "val_loss/chat_test"))
    assert sorted(r["step"] for r in records if r["kind"] == "train") == [1, 2, 3, 4]
