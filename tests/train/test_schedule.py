"""``loss.normalization`` through the real step (``Trainer.step_tensors`` -> ``Schedule.run``) and validation
(``Schedule.totals``): the same conversations give the same loss and gradients however they are arranged into rows,
micro-batches and DP / CP ranks, and ``conversation`` is the mean of the per-conversation means computed
independently, one conversation at a time.

Data: 17 short real hh-rlhf conversations (two with a first assistant turn of ``weight: 0``), packed by the real
packer at ``max_seq_len`` 256 for CP 2 and copied for CP 1 (the same rows); ``train.global_batch_size`` = every row,
so one step sees every conversation. fp32, no clipping, the optimizer update stubbed out (every step sees the same
weights); the DP 2, CP 2 and PP 2 layouts (one 2-process gloo spawn) start from the single-process model's weights.
"""

import json
import shutil
from pathlib import Path

import pytest
import torch
import yaml
from distributed_helpers import (  # noqa: F401 - fixture
    own_output_dir,
    parallel_state_1proc,
    run_distributed,
    short_conversation_lines,
)

from packsft.data.collate import collate_rows
from packsft.data.row import build_row
from packsft.packing.config import PackConfig
from packsft.packing.pipeline import run_pack
from packsft.sidecar import read_sidecar, write_sidecar
from packsft.train.config import load_config

SEQ = 256
MODES = ("token", "conversation")
RTOL = 1e-6


@pytest.fixture(scope="module")
def packed(tmp_path_factory, shared_data, tokenizer_dir) -> dict:
    """``{1: path, 2: path}``: the same rows for CP 1 and CP 2, and the number of ``rows``."""
    out = tmp_path_factory.mktemp("normalization")
    lines = []
    for line in short_conversation_lines(shared_data, 17):
        record = json.loads(line)
        assistants = [m for m in record["messages"] if m["role"] == "assistant"]
        if len(assistants) > 1:
            assistants[0]["weight"] = 0                     # context only: not trained, not counted
        lines.append(json.dumps(record))
    assert sum('"weight": 0' in line for line in lines) == 2
    src = out / "short.jsonl"
    src.write_text("\n".join(lines) + "\n")
    files = {2: out / "cp2.jsonl.packed", 1: out / "cp1.jsonl.packed"}
    run_pack(PackConfig(inputs=[str(src)], output=str(files[2]), max_seq_len=SEQ, algorithm="next-fit",
                        context_parallel_size=2, tokenizer=str(tokenizer_dir("smollm2-135m-instruct")),
                        histogram="", progress=False))
    shutil.copy(files[2], files[1])
    write_sidecar(files[1], dict(read_sidecar(files[2]), context_parallel_size=1))
    files["rows"] = len(files[2].read_text().splitlines())
    files["tokenizer"] = tokenizer_dir("smollm2-135m-instruct")
    assert files["rows"] % 2 == 0, files["rows"]             # DP 2 splits the global batch evenly
    return files


@pytest.fixture(scope="module")
def config(tmp_path_factory, packed) -> Path:
    cfg = {
        "model": {"num_layers": 2, "hidden_size": 64, "ffn_hidden_size": 128, "num_attention_heads": 4,
                  "num_query_groups": 2, "vocab_size": 49152, "max_position_embeddings": SEQ,
                  "tie_word_embeddings": True, "params_dtype": "float32"},
        "data": {"train_path": str(packed[1]), "validation_path": str(packed[1]),
                 "tokenizer": str(packed["tokenizer"]), "max_seq_len": SEQ},
        "loader": {"sampler": "sequential"},
        "loss": {"chunk_size": 100},
        "optimizer": {"lr": 3e-3, "weight_decay": 0.0, "clip_grad": 0.0},
        "train": {"global_batch_size": packed["rows"], "train_steps": 4},
        "validation": {"val_at_start": False, "val_at_end": False},
        "checkpoint": {"save_interval": 0, "resume": "none", "save_at_end": False},
        "logging": {"output_dir": str(tmp_path_factory.mktemp("out")), "progress": False, "tensorboard": False},
    }
    path = tmp_path_factory.mktemp("cfg") / "normalization.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _trainer(config_path, *overrides):
    from packsft.train.loop import Trainer

    trainer = Trainer(load_config(config_path, [own_output_dir(config_path), *overrides]))
    trainer.optimizer.step_with_ready_grads = lambda: True     # every step sees the initial weights
    return trainer


def _step(trainer, collated: list[dict], mode: str) -> dict:
    """``train_step`` of the collated micro-batches under ``mode``: loss, trained tokens and every ``main_grad``."""
    from packsft.train.data import model_input

    ctx = trainer.ctx
    trainer.cfg.loss.normalization = mode
    batches = [model_input(b, ctx.context_parallel_size, ctx.cp_rank, ctx.cp_group, ctx.device, mode)
               for b in collated]
    result = trainer.train_step(batches)
    grads = {name: p.main_grad.detach().clone() for name, p in trainer.gpt.named_parameters()}
    return {"loss": result["loss"], "trained_tokens": result["trained_tokens"], "grads": grads}


def _loader_rows(trainer) -> list[dict]:
    """This rank's collated rows of the first global batch (one micro-batch each)."""
    rows = iter(trainer.train_loader)
    return [next(rows) for _ in range(trainer.micro_batches)]


def _relative(got: dict, ref: dict) -> dict[str, float]:
    """Relative differences of the loss and of all gradients together (2-norm of the difference / of ``ref``)."""
    diff = torch.cat([(got["grads"][k] - g).reshape(-1) for k, g in ref["grads"].items()])
    whole = torch.cat([g.reshape(-1) for g in ref["grads"].values()])
    return {"loss": abs(got["loss"] - ref["loss"]) / abs(ref["loss"]), "grads": float(diff.norm() / whole.norm())}


def _arrangements(dataset) -> dict[str, list[dict]]:
    """The file's conversations as collated micro-batches: the packer's rows (one per micro-batch), the
    conversations in reverse order re-packed next-fit and two rows per micro-batch, and one conversation per
    micro-batch."""
    pad = dataset.prompt_format.pad_token_id
    conversations = [c for i in range(len(dataset)) for c in dataset.tokenize_row(i)]
    refilled, row = [], []
    for conv in reversed(conversations):
        if row and sum(len(t) for t, _ in row) + len(conv[0]) > SEQ:
            refilled.append(row)
            row = []
        row.append(conv)
    refilled.append(row)
    rows = [build_row(r, pad, SEQ)[0] for r in refilled]
    assert len(refilled) > 1 and [len(r) for r in refilled] != [len(dataset.tokenize_row(i)) for i in
                                                                 range(len(dataset))]
    return {"packed": [collate_rows([dataset[i]]) for i in range(len(dataset))],
            "reversed, 2 rows per micro-batch": [collate_rows(rows[i:i + 2]) for i in range(0, len(rows), 2)],
            "one conversation per micro-batch": [collate_rows([build_row([c], pad, SEQ)[0]]) for c in conversations]}


def _independent_means(trainer, dataset) -> dict[str, float]:
    """Token and conversation means of the file's loss, each conversation run alone in a row of its own length
    (Megatron's stock cross-entropy, fp64 sums)."""
    from packsft.train.data import model_input
    from packsft.train.token_loss import gpt_token_loss

    pad = dataset.prompt_format.pad_token_id
    sums, counts = [], []
    with torch.no_grad():
        for i in range(len(dataset)):
            for conv in dataset.tokenize_row(i):
                row = collate_rows([build_row([conv], pad, len(conv[0]))[0]])
                per_token, mask = gpt_token_loss(trainer.chunks[0], model_input(row, 1, 0, None, trainer.ctx.device),
                                                 fused=False, chunk_size=SEQ)
                sums.append(float(per_token.double().sum()))
                counts.append(int((mask != 0).sum()))
    trained = [(s, n) for s, n in zip(sums, counts) if n > 0]
    return {"token": sum(sums) / sum(counts), "conversation": sum(s / n for s, n in trained) / len(trained),
            "trained_tokens": sum(counts), "conversations": len(trained)}


@pytest.fixture(scope="module")
def reference(config, parallel_state_1proc):  # noqa: F811
    """The single-process trainer, its steps on the packer's rows in both modes, and the independent means."""
    trainer = _trainer(config)
    rows = _loader_rows(trainer)
    steps = {mode: _step(trainer, rows, mode) for mode in MODES}
    return {"trainer": trainer, "steps": steps, "independent": _independent_means(trainer, trainer.train_set)}


def test_conversation_loss_is_the_mean_of_independent_conversation_means(reference):
    independent, steps = reference["independent"], reference["steps"]
    assert independent["conversations"] == 17                   # the weight-0 turns leave every conversation trained
    for mode in MODES:
        assert steps[mode]["trained_tokens"] == independent["trained_tokens"]
        assert abs(steps[mode]["loss"] - independent[mode]) <= RTOL * independent[mode], (mode, steps, independent)
    assert abs(independent["token"] - independent["conversation"]) > 1e-3      # the two modes really differ


def test_rows_and_micro_batches_do_not_change_loss_or_gradients(reference):
    trainer = reference["trainer"]
    for name, collated in _arrangements(trainer.train_set).items():
        for mode in MODES:
            got = _step(trainer, collated, mode)
            rel = _relative(got, reference["steps"][mode])
            print(name, mode, rel)
            assert got["trained_tokens"] == reference["steps"][mode]["trained_tokens"], (name, mode)
            assert rel["loss"] <= RTOL and rel["grads"] <= RTOL, (name, mode, rel)


def test_validation_reports_the_training_mean(reference):
    trainer = reference["trainer"]
    for mode in MODES:
        trainer.cfg.loss.normalization = mode
        result = trainer.validate()
        expected = reference["independent"][mode]
        assert abs(result["val_loss"] - expected) <= RTOL * expected, (mode, result, expected)
        assert result["val_trained_tokens"] == reference["independent"]["trained_tokens"]


LAYOUTS = {"dp=2": (), "cp=2": ("parallel.context_parallel_size=2",),
           "pp=2": ("parallel.pipeline_model_parallel_size=2",)}


def _layouts_worker(rank, world_size, config_path, cp2_path, weights):
    """Each layout of :data:`LAYOUTS` from the reference's ``weights``: both modes' step on the first global batch
    (every gradient by its one-process name, on its stage) and validation."""
    from megatron.core import parallel_state
    from test_pipeline_parallel import full_grads, load_full_weights

    results = []
    for name, overrides in LAYOUTS.items():
        if parallel_state.model_parallel_is_initialized():
            parallel_state.destroy_model_parallel()
        data = (f"data.train_path={cp2_path}", f"data.validation_path={cp2_path}") if name == "cp=2" else ()
        trainer = _trainer(config_path, *overrides, *data)
        load_full_weights(trainer, weights)
        rows = _loader_rows(trainer)
        out = {"layout": trainer.layout()}
        for mode in MODES:
            step = _step(trainer, rows, mode)
            out[mode] = {**step, "grads": full_grads(trainer), "val_loss": trainer.validate()["val_loss"]}
        results.append(out)
        torch.distributed.barrier()
    return results


@pytest.mark.distributed
@pytest.mark.slow
def test_dp2_cp2_pp2_equal_single_process(config, packed, reference):
    weights = {n: p.detach().clone() for n, p in reference["trainer"].gpt.named_parameters()}
    per_rank = run_distributed(_layouts_worker, 2, str(config), str(packed[2]), weights, timeout_s=400)
    for i, name in enumerate(LAYOUTS):
        layout = per_rank[0][i]["layout"]
        sizes = (layout["data_parallel_size"], layout["context_parallel_size"], layout["pipeline_model_parallel_size"])
        assert sizes == {"dp=2": (2, 1, 1), "cp=2": (1, 2, 1), "pp=2": (1, 1, 2)}[name], (name, layout)
        for mode in MODES:
            ref = reference["steps"][mode]
            merged = {}                                  # PP: each stage's gradients; DP, CP: every rank's are equal
            for rank in range(2):
                got = per_rank[rank][i][mode]
                assert got["trained_tokens"] == ref["trained_tokens"], (name, mode, rank)
                assert abs(got["loss"] - ref["loss"]) <= RTOL * ref["loss"], (name, mode, rank, got["loss"], ref)
                expected = reference["independent"][mode]
                assert abs(got["val_loss"] - expected) <= RTOL * expected, (name, mode, rank, got["val_loss"])
                merged.update({k.removesuffix("#output"): g for k, g in got["grads"].items()})
            assert merged.keys() == ref["grads"].keys(), (name, sorted(set(merged) ^ set(ref["grads"])))
            rel = _relative({"loss": ref["loss"], "grads": merged}, ref)
            print(name, mode, rel)
            assert rel["grads"] <= RTOL, (name, mode, rel)
