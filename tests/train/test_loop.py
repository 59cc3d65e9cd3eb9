"""End-to-end training on real packed rows (gsm8k, SmolLM2 tokenizer, tiny model): learning, exact resume, packed ==
unpacked loss, and the data-parallel split."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from distributed_helpers import parallel_state_1proc, run_distributed, tool_forked  # noqa: F401 - fixture

from packsft.packing.config import PackConfig
from packsft.packing.pipeline import run_pack
from packsft.train.config import load_config

REPO = Path(__file__).resolve().parents[2]
SEQ = 256


@pytest.fixture(scope="module")
def packed(tmp_path_factory, shared_data, tokenizer_dir):
    """Two packed files of the first gsm8k_test conversations: 6 conversations (few rows, to overfit) and 24."""
    out = tmp_path_factory.mktemp("packed")
    lines = (shared_data / "chat" / "gsm8k_test.messages.jsonl").read_text().splitlines()
    files = {}
    for name, n in (("few", 6), ("many", 24)):
        src = out / f"{name}.jsonl"
        src.write_text("\n".join(lines[:n]) + "\n")
        run_pack(PackConfig(inputs=[str(src)], output=str(out / f"{name}.jsonl.packed"), max_seq_len=SEQ,
                            tokenizer=str(tokenizer_dir("smollm2-135m-instruct")), histogram="", progress=False))
        files[name] = out / f"{name}.jsonl.packed"
    files["tokenizer"] = tokenizer_dir("smollm2-135m-instruct")
    return files


def write_config(path: Path, packed: dict, output_dir: Path, **sections) -> Path:
    """A tiny-model YAML (hidden 64, 2 layers, vocab 49152) over ``packed["few"]``; ``sections`` update it."""
    cfg = {
        "model": {"num_layers": 2, "hidden_size": 64, "ffn_hidden_size": 128, "num_attention_heads": 4,
                  "num_query_groups": 2, "vocab_size": 49152, "max_position_embeddings": SEQ,
                  "tie_word_embeddings": True},
        "data": {"train_path": str(packed["few"]), "tokenizer": str(packed["tokenizer"]), "max_seq_len": SEQ},
        "optimizer": {"lr": 3e-3, "weight_decay": 0.0},
        "scheduler": {"warmup_steps": 2, "decay_style": "constant"},
        "train": {"global_batch_size": 2, "train_steps": 30},
        "checkpoint": {"save_interval": 0},
        "logging": {"output_dir": str(output_dir), "progress": False, "tensorboard": False},
    }
    for section, values in sections.items():
        cfg.setdefault(section, {}).update(values)
    path.write_text(yaml.safe_dump(cfg))
    return path


def train(config: Path, *overrides: str) -> subprocess.CompletedProcess:
    """Run ``tools/train.py`` in a fresh process (dist_checkpointing needs a ``__main__`` guard); raise on failure."""
    proc = subprocess.run([sys.executable, str(REPO / "tools" / "train.py"), "--config", str(config), *overrides],
                          capture_output=True, text=True, timeout=300, env={"OMP_NUM_THREADS": "1", "PATH": ""})
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc


def train_forked(config: Path, *overrides: str, nproc: int = 1, check: bool = True) -> subprocess.CompletedProcess:
    """:func:`train` (``tools/train.py --config config overrides``) on ``nproc`` forked ranks: :func:`tool_forked`."""
    return tool_forked("train", "--config", config, *overrides, nproc=nproc, check=check)


def train_records(output_dir: Path) -> dict[int, dict]:
    """Last ``kind == "train"`` record of each step in ``metrics.jsonl``."""
    records = [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r for r in records if r["kind"] == "train"}


@pytest.mark.slow
def test_tiny_model_overfits_a_few_real_rows(tmp_path, packed):
    out = tmp_path / "run"
    train_forked(write_config(tmp_path / "c.yaml", packed, out, logging={"tensorboard": True}))
    records = train_records(out)
    assert sorted(records) == list(range(1, 31))
    first, last = records[1]["loss"], records[30]["loss"]
    assert first > 10.0 and last < first - 5.0, (first, last)
    assert all(r["grad_norm"] > 0 and r["tokens_per_s"] > 0 and r["trained_tokens"] > 0 for r in records.values())
    assert records[30]["consumed_samples"] == 60 and records[30]["consumed_tokens"] == 60 * SEQ
    assert list((out / "tensorboard").glob("events.out.tfevents.*"))
    assert (out / "checkpoints" / "latest").read_text().strip() == "iter_0000030"


OPTIMIZERS = {"megatron": {}, "megatron_dist_opt": {"use_distributed_optimizer": True}}
"""``optimizer`` sections the exact-resume tests run with: Megatron's optimizer, and its distributed optimizer."""


def resumed_run_config(packed: dict, optimizer: str) -> dict:
    """The sections of the exact-resume runs: 8 steps over ``packed["many"]`` with validation every 4 steps."""
    return {"train": {"global_batch_size": 2, "train_steps": 8}, "data": {"train_path": str(packed["many"]),
            "split_validation_size": 0.2}, "scheduler": {"warmup_steps": 2, "decay_style": "cosine"},
            "validation": {"val_period": 4, "max_batches": 2},
            "optimizer": {"weight_decay": 0.1, **OPTIMIZERS[optimizer]}}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, packed):  # noqa: F811
    """``optimizer -> output folder`` of the run the stopped and the killed ones must reproduce (built once each)."""
    runs = {}

    def run(optimizer: str) -> Path:
        if optimizer not in runs:
            out = tmp_path_factory.mktemp(f"full_{optimizer}")
            train_forked(write_config(out / "full.yaml", packed, out / "run", **resumed_run_config(packed, optimizer)))
            runs[optimizer] = out / "run"
        return runs[optimizer]
    return run


@pytest.mark.slow
@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
def test_stopped_and_then_sigkilled_run_resumes_bit_exact(tmp_path, packed, parallel_state_1proc,  # noqa: F811
                                                          uninterrupted, optimizer):
    """A run stopped at step 3 (``train.stop_at_step``) resumes; killed with SIGKILL after its next checkpoint
    (step 6) it resumes again, to the uninterrupted run's losses and weights; the half-written save and the metrics
    past the checkpoint the kill left are set aside. (One chain: each resume is a spawn of its own.)"""
    killed = tmp_path / "killed"
    cfg = write_config(tmp_path / "killed.yaml", packed, killed, **resumed_run_config(packed, optimizer))
    train_forked(cfg, "train.stop_at_step=3")
    latest = killed / "checkpoints" / "latest"
    assert latest.read_text().strip() == "iter_0000003"
    proc = subprocess.Popen([sys.executable, str(REPO / "tools" / "train.py"), "--config", str(cfg),
                             "checkpoint.save_interval=3"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True, env={"OMP_NUM_THREADS": "1", "PATH": ""})
    deadline = time.monotonic() + 240
    while latest.read_text().strip() != "iter_0000006":   # `latest` is replaced in one rename
        assert proc.poll() is None, f"training ended before its checkpoint at step 6: {proc.stderr.read()[-3000:]}"
        assert time.monotonic() < deadline, "no checkpoint at step 6 within 240 s"
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL
    assert not (killed / "checkpoints" / "iter_0000008").exists()
    (killed / "checkpoints" / "iter_0000008.tmp").mkdir(exist_ok=True)   # as a save killed half-way leaves it
    with open(killed / "metrics.jsonl", "a") as f:
        f.write('{"kind": "train", "step": 7, "loss": 1.0}\n{"kind": "tra')   # steps past the checkpoint, a cut line
    train_forked(cfg)  # checkpoint.resume=auto: continues from `latest`
    assert_same_run(uninterrupted(optimizer), killed, steps=8)
    records = [json.loads(line) for line in (killed / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r["kind"] == "train"] == list(range(1, 9))   # each step once
    discarded = (killed / "metrics.discarded.jsonl").read_text().splitlines()
    assert discarded[-2:] == ['{"kind": "train", "step": 7, "loss": 1.0}', '{"kind": "tra']
    assert not list((killed / "checkpoints").glob("*.tmp"))


def _stopped_at_2_config(path: Path, packed: dict, output_dir: Path) -> Path:
    """The resume-note runs' config: 4 steps over ``packed["many"]`` (a fifth held out), validated at the end."""
    return write_config(path, packed, output_dir, train={"global_batch_size": 2, "train_steps": 4},
                        data={"train_path": str(packed["many"]), "split_validation_size": 0.2},
                        validation={"val_period": 0, "max_batches": 1})


@pytest.fixture(scope="module")
def stopped_at_2(tmp_path_factory, packed):  # noqa: F811
    """``(config, output folder)`` of a 4-step run stopped at step 2 (saved, as any stop), which the resume-note tests
    continue (each its own copy of the folder, or one that leaves its checkpoints as they are)."""
    out = tmp_path_factory.mktemp("stopped_at_2")
    cfg = _stopped_at_2_config(out / "c.yaml", packed, out / "run")
    train_forked(cfg, "train.stop_at_step=2", "checkpoint.save_at_end=false")   # a stop saves all the same
    return cfg, out / "run"


def test_resume_without_latest_and_with_another_global_batch_size_continues_the_data_with_notes(  # noqa: F811
        tmp_path, packed, stopped_at_2):
    out = tmp_path / "run"
    shutil.copytree(stopped_at_2[1], out)
    cfg = _stopped_at_2_config(tmp_path / "c.yaml", packed, out)
    (out / "checkpoints" / "latest").unlink()    # as a save killed between publishing its folder and `latest` leaves
    proc = train_forked(cfg, "train.global_batch_size=4", "loss.normalization=conversation")
    assert f"note: {out / 'checkpoints'} has no latest (a save was stopped before writing it); resuming its newest " \
           "complete checkpoint, iter_0000002" in proc.stdout, proc.stdout
    assert f"note: train.global_batch_size is 4, checkpoint {out / 'checkpoints' / 'iter_0000002'} was trained " \
           "with 2: the data continues after the 4 rows consumed, 4 a step from now on" in proc.stdout, proc.stdout
    assert "note: loss.normalization is conversation, checkpoint " in proc.stdout and "trained with token: the " \
           "logged loss and the weight of each token in the gradients change from step 3 on" in proc.stdout, proc.stdout
    assert [r["consumed_samples"] for _, r in sorted(train_records(out).items())] == [2, 4, 8, 12]


def test_resume_at_the_last_step_trains_saves_and_validates_nothing_with_a_note(stopped_at_2):
    cfg, out = stopped_at_2
    saved = out / "checkpoints" / "iter_0000002"
    before = {p.name: p.stat().st_mtime_ns for p in saved.iterdir()}
    records = (out / "metrics.jsonl").read_text().splitlines()
    proc = train_forked(out / "config.yaml")   # the run's own config records train.stop_at_step=2
    assert "note: nothing to train: the run resumes at step 2 and train.stop_at_step is 2 (train.stop_at_step=null " \
           "trains on to train.train_steps=4)" in proc.stdout, proc.stdout
    proc = train_forked(cfg, "train.train_steps=2",   # a finished run submitted again: no second validation or save
                 "checkpoint.restore_data_order=false")   # (and the note of a data order started again)
    assert "note: nothing to train: the run resumes at step 2 and train.train_steps is 2" in proc.stdout, proc.stdout
    assert "note: checkpoint.restore_data_order=false: the data order starts again from its first rows (epoch 0), " \
           "which the 4 rows consumed up to step 2 may include: they are trained again" in proc.stdout, proc.stdout
    assert {p.name: p.stat().st_mtime_ns for p in saved.iterdir()} == before
    after = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()[len(records):]]
    assert [r["kind"] for r in after] == ["summary", "summary"]


def assert_same_run(a_dir: Path, b_dir: Path, steps: int) -> None:
    """Two runs logged the same metrics at every step and wrote bit-identical final checkpoints (model + Adam state)."""
    a, b = train_records(a_dir), train_records(b_dir)
    assert sorted(a) == sorted(b) == list(range(1, steps + 1))
    for step in a:
        for key in ("loss", "grad_norm", "lr", "trained_tokens", "consumed_samples"):
            assert a[step][key] == b[step][key], (step, key, a[step][key], b[step][key])
    from megatron.core.dist_checkpointing import load_plain_tensors

    last = f"iter_{steps:07d}"
    pa = _flat(load_plain_tensors(str(a_dir / "checkpoints" / last)))
    pb = _flat(load_plain_tensors(str(b_dir / "checkpoints" / last)))
    assert pa.keys() == pb.keys() and any("exp_avg_sq" in k for k in pa) and any("decoder" in k for k in pa)
    for key in pa:
        same = torch.equal(pa[key], pb[key]) if torch.is_tensor(pa[key]) else pa[key] == pb[key]
        assert same, key


def _flat(tree, prefix=""):
    if isinstance(tree, dict):
        return {k: v for key, sub in tree.items() for k, v in _flat(sub, f"{prefix}{key}.").items()}
    return {prefix: tree}


def _unpacked(batch, s, e):
    from packsft.data.context_parallel import make_packed_seq_params

    out = {k: batch[k][:, s:e] for k in ("tokens", "labels", "loss_mask", "position_ids")}
    out["packed_seq_params"] = make_packed_seq_params(torch.tensor([0, e - s], dtype=torch.int32), e - s)
    out["trained_index"] = ((out["labels"] != -100) & (out["loss_mask"] != 0)).reshape(-1).nonzero().squeeze(1)
    return out


def test_packed_loss_equals_mean_over_conversations_unpacked(tmp_path, packed, parallel_state_1proc):  # noqa: F811
    from packsft.train.data import model_input
    from packsft.train.loop import Trainer

    cfg = load_config(write_config(tmp_path / "c.yaml", packed, tmp_path / "o", checkpoint={"resume": "none"}))
    trainer = Trainer(cfg)
    trainer.optimizer.step_with_ready_grads = lambda: True                       # compare losses of the same weights
    row = next(r for r in (trainer.train_set[i] for i in range(len(trainer.train_set)))
               if len(r["cu_seqlens_padded"]) > 2)
    from packsft.data.collate import collate_rows

    collated = collate_rows([row])
    batch = model_input(collated, 1, 0, None, torch.device("cpu"))
    packed_loss = trainer.train_step([batch])["loss"]
    cu = collated["cu_seqlens_padded"].tolist()
    pieces = [_unpacked(batch, s, e) for s, e in zip(cu[:-1], cu[1:])]
    unpacked_loss = trainer.train_step(pieces)["loss"]
    assert len(pieces) >= 2
    assert abs(packed_loss - unpacked_loss) < 1e-5, (packed_loss, unpacked_loss)


def _rows_read_by_rank(rank, world_size, config_path, steps):
    from packsft.train.loop import Trainer

    trainer = Trainer(load_config(config_path))
    index = {tuple(trainer.train_set[i]["tokens"].tolist()): i for i in range(len(trainer.train_set))}
    return [index[tuple(b["tokens"][0].tolist())] for _ in range(steps) for b in trainer.next_micro_batches()]


@pytest.mark.slow
@pytest.mark.distributed
def test_data_parallel_ranks_read_disjoint_rows(tmp_path, packed):
    config = write_config(tmp_path / "c.yaml", packed, tmp_path / "o", data={"train_path": str(packed["many"])},
                          train={"global_batch_size": 4}, checkpoint={"resume": "none"})
    num_rows = len(Path(packed["many"]).read_text().splitlines())
    steps = num_rows // 4
    rank0, rank1 = run_distributed(_rows_read_by_rank, 2, str(config), steps)
    assert len(rank0) == len(rank1) == 2 * steps
    assert not set(rank0) & set(rank1)
    assert len(set(rank0) | set(rank1)) == 4 * steps


def test_micro_batch_of_two_rows_equals_two_micro_batches(tmp_path, packed, parallel_state_1proc):  # noqa: F811
    """``loader.micro_batch_size: 2`` concatenates two rows into one THD sequence: same loss and gradients."""
    from packsft.train.loop import Trainer

    results = {}
    for mbs in (1, 2):
        cfg = load_config(write_config(tmp_path / f"c{mbs}.yaml", packed, tmp_path / f"o{mbs}",
                                       data={"train_path": str(packed["many"])}, train={"global_batch_size": 4},
                                       loader={"micro_batch_size": mbs, "sampler": "sequential"},
                                       checkpoint={"resume": "none"}))
        torch.manual_seed(0)
        trainer = Trainer(cfg)
        trainer.optimizer.step_with_ready_grads = lambda: True
        batches = trainer.next_micro_batches()
        assert len(batches) == 4 // mbs and batches[0]["tokens"].shape == (1, mbs * SEQ)
        result = trainer.train_step(batches)
        results[mbs] = result
    assert results[1]["trained_tokens"] == results[2]["trained_tokens"]
    assert abs(results[1]["loss"] - results[2]["loss"]) < 1e-6, results
    assert abs(results[1]["grad_norm"] - results[2]["grad_norm"]) < 1e-5, results


@pytest.mark.slow
@pytest.mark.parametrize("optimizer", ["megatron_dist_opt"])  # torch AdamW + LoRA: tests/model/test_lora_run.py
def test_lora_run_keeps_adapter_state_only_and_resumes_exactly(tmp_path, packed, parallel_state_1proc,  # noqa: F811
                                                               optimizer):
    common = {"train": {"global_batch_size": 2, "train_steps": 4}, "data": {"train_path": str(packed["many"])},
              "optimizer": {"lr": 1e-2, **OPTIMIZERS[optimizer]}, "lora": {"enabled": True, "rank": 4, "alpha": 8.0}}
    full, parts = tmp_path / "full", tmp_path / "parts"
    train_forked(write_config(tmp_path / "full.yaml", packed, full, **common))
    parts_cfg = write_config(tmp_path / "parts.yaml", packed, parts, **common)
    train_forked(parts_cfg, "train.stop_at_step=2")
    train_forked(parts_cfg)
    assert_same_run(full, parts, steps=4)
    from megatron.core.dist_checkpointing import load_plain_tensors

    first = _flat(load_plain_tensors(str(parts / "checkpoints" / "iter_0000002")))
    last = _flat(load_plain_tensors(str(full / "checkpoints" / "iter_0000004")))
    adapter_numel = sum(v.numel() for k, v in last.items() if not k.startswith("optimizer.") and ".lora_" in k
                        and torch.is_tensor(v))
    moments = {k: v.numel() for k, v in last.items() if ".exp_avg." in k}
    # optimizer state holds the adapters only: per parameter (torch) or Megatron's padded flat bucket (dist. opt.)
    assert moments and adapter_numel <= sum(moments.values()) < adapter_numel + 1024, (moments, adapter_numel)
    adapters = [k for k in last if not k.startswith("optimizer.") and ".lora_B" in k]
    base = [k for k in last if not k.startswith("optimizer.") and k.endswith("linear_qkv.weight.")]
    assert adapters and base and all(torch.equal(first[k], last[k]) for k in base)            # base frozen
    assert any(not torch.equal(first[k], last[k]) for k in adapters)                          # adapters trained
