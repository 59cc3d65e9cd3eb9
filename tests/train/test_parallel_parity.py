"""Every parallel layout of the real trainer step equals the single-process step (fp32, gloo on localhost).

Data: the shortest real hh-rlhf conversations, packed by the real packer (SmolLM2 tokenizer, ``max_seq_len`` 256,
next-fit) for ``context_parallel_size`` 4, which gives 4 rows of 4-5 conversations each. The same rows are valid for
every smaller CP size (their conversations fit with less padding), so the file is copied for CP 1 and 2 with the
sidecar's ``context_parallel_size`` set accordingly; the dataset then pads each conversation for the CP size of the
run, and the reference (CP=1) sees the natural unpadded rows. ``train.global_batch_size`` = 4 = all rows, so every
layout trains on the same global batch.

For each layout (CP=2, TP=2 and DP=2, each once more with activation recompute, in one 2-process spawn; CP=4 and
TP=2 x CP=2 in one 4-process spawn) and each
loss (fused chunked linear-CE and Megatron's stock ``vocab_parallel_cross_entropy``), ``Trainer.train_step`` (the
product code: trained-token count, normalisation, Megatron's DDP over DP x CP, TP-aware clipping) runs on the first
global batch; the test captures the gradients the optimizer step sees (``main_grad``, full tensors: TP shards
concatenated along their partition dimension; ``finalize_model_grads`` has already summed CP and DP shares) and
compares loss, gradients, gradient norm and the trained-token count with the single-process run. The optimizer
update is stubbed out so both losses see the same weights.
"""

import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import yaml
from distributed_helpers import (  # noqa: F401
    own_output_dir,
    parallel_state_1proc,
    run_distributed,
    short_conversation_lines,
)

from packsft.packing.config import PackConfig
from packsft.packing.pipeline import run_pack
from packsft.sidecar import read_sidecar, sidecar_path, write_sidecar
from packsft.train.config import load_config

SEQ, ROWS, MAX_CP = 256, 4, 4
TOKENIZER = "smollm2-135m-instruct"
ATOL = 1e-5
SP = ("parallel.sequence_parallel=true",)
CLIP = 0.05                    # below the reference gradient norm (asserted), so clipping is active

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


@pytest.fixture(scope="module")
def packed(tmp_path_factory, shared_data, tokenizer_dir) -> dict:
    """``{cp: packed path}`` for CP 1, 2, 4 (the same rows), plus ``tokenizer``."""
    out = tmp_path_factory.mktemp("parity")
    src = out / "short.jsonl"
    src.write_text("\n".join(short_conversation_lines(shared_data, 17)) + "\n")
    base = out / f"cp{MAX_CP}.jsonl.packed"
    run_pack(PackConfig(inputs=[str(src)], output=str(base), max_seq_len=SEQ, algorithm="next-fit",
                        context_parallel_size=MAX_CP, tokenizer=str(tokenizer_dir(TOKENIZER)), histogram="",
                        progress=False))
    rows = [json.loads(line)["messages"] for line in base.read_text().splitlines()]
    assert len(rows) == ROWS and all(sum(m["role"] == "system" for m in r) >= 3 for r in rows), \
        [sum(m["role"] == "system" for m in r) for r in rows]
    files = {MAX_CP: base, "tokenizer": tokenizer_dir(TOKENIZER)}
    for cp in (1, 2):
        files[cp] = out / f"cp{cp}.jsonl.packed"
        shutil.copy(base, files[cp])
        write_sidecar(files[cp], dict(read_sidecar(base), context_parallel_size=cp))
    assert sidecar_path(files[1]).is_file()
    return files


def _config(tmp_path: Path, packed: dict) -> Path:
    cfg = {
        "model": {"num_layers": 2, "hidden_size": 64, "ffn_hidden_size": 128, "num_attention_heads": 4,
                  "num_query_groups": 2, "vocab_size": 49152, "max_position_embeddings": SEQ,
                  "tie_word_embeddings": True, "params_dtype": "float32"},
        "data": {"train_path": str(packed[1]), "tokenizer": str(packed["tokenizer"]), "max_seq_len": SEQ},
        "loader": {"sampler": "sequential"},
        "loss": {"chunk_size": 100},
        "optimizer": {"lr": 3e-3, "weight_decay": 0.1, "clip_grad": CLIP},
        "train": {"global_batch_size": ROWS, "train_steps": 4},
        "checkpoint": {"save_interval": 0, "resume": "none", "save_at_end": False},
        "logging": {"output_dir": str(tmp_path / "out"), "progress": False, "tensorboard": False},
    }
    path = tmp_path / "parity.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _full_grads(gpt, tp_group) -> dict[str, torch.Tensor]:
    """Every parameter's gradient (Megatron DDP's ``main_grad``) as the full (TP=1) tensor: TP shards concatenated
    along ``partition_dim``.

    SwiGLU's ``linear_fc1`` shard of rank r is ``[gate_r; up_r]`` while the TP=1 weight is ``[gate; up]``, so its
    shards are split in halves and the gates and ups concatenated separately (Megatron's TP layout of a GLU).
    """
    tp = dist.get_world_size(tp_group)
    grads = {}
    for name, p in gpt.named_parameters():
        g = p.main_grad.detach().clone()
        if tp > 1 and getattr(p, "tensor_model_parallel", False):
            parts = [torch.empty_like(g) for _ in range(tp)]
            dist.all_gather(parts, g.contiguous(), group=tp_group)
            if name.endswith("mlp.linear_fc1.weight"):
                halves = [part.chunk(2, dim=0) for part in parts]
                parts = [h[0] for h in halves] + [h[1] for h in halves]
            g = torch.cat(parts, dim=p.partition_dim)
        grads[name] = g
    return grads


def _step_both_losses(config_path: str, train_path: str, tp: int, cp: int, want_grads: bool,
                      overrides: tuple[str, ...] = ()) -> dict:
    """Build the real ``Trainer`` for (tp, cp) and run ``train_step`` on its first global batch, fused then stock.

    ``overrides``: further dotted config overrides (e.g. activation recompute).

    Returns ``{fused: {"loss", "grad_norm", "trained_tokens", "grads" (full tensors, only if want_grads)}}`` and the
    rows this rank read (``rows``: token sums, to check the global batch).
    """
    from packsft.train import loop
    from packsft.train.loop import Trainer

    cfg = load_config(config_path, [f"parallel.tensor_model_parallel_size={tp}",
                                    f"parallel.context_parallel_size={cp}", f"data.train_path={train_path}",
                                    own_output_dir(config_path), *overrides])
    trainer = Trainer(cfg)
    batches = trainer.next_micro_batches()
    trainer.optimizer.step_with_ready_grads = lambda: True   # both losses and all layouts see the initial weights
    captured, original_step = {}, loop.megatron_step_skipping_non_finite

    def capturing_step(optimizer, loss_sum):
        full = _full_grads(trainer.gpt, trainer.ctx.tp_group)  # collective over TP: every rank gathers
        captured["grads"] = full if want_grads else None
        return original_step(optimizer, loss_sum)

    loop.megatron_step_skipping_non_finite = capturing_step
    try:
        out = {}
        for fused in (True, False):
            trainer.cfg.loss.fused_linear_cross_entropy = fused
            result = trainer.train_step(batches)
            out[fused] = {k: result[k] for k in ("loss", "grad_norm", "trained_tokens")}
            out[fused]["grads"] = captured.pop("grads", None)
    finally:
        loop.megatron_step_skipping_non_finite = original_step
    out["rows"] = sorted(int(b["tokens"].sum()) for b in batches)
    out["layout"] = trainer.layout()
    out["recompute"] = trainer.gpt.config.recompute_granularity
    out["sequence_parallel"] = trainer.gpt.config.sequence_parallel
    out["local_hidden_tokens"] = _local_hidden_tokens(trainer.gpt, batches[0])
    return out


def _local_hidden_tokens(gpt, batch) -> int:
    """Tokens of this rank's residual stream after the embedding (``t / tp`` under sequence parallelism)."""
    with torch.no_grad():
        return gpt.embedding(input_ids=batch["tokens"], position_ids=batch["position_ids"]).shape[0]


def _layouts_worker(rank, world_size, config_path, train_paths, layouts):
    """Run each ``(tp, cp[, overrides])`` of ``layouts`` in these processes in turn (parallel_state rebuilt between)."""
    from megatron.core import parallel_state

    results = []
    for tp, cp, *overrides in layouts:
        if parallel_state.model_parallel_is_initialized():
            parallel_state.destroy_model_parallel()
        results.append(_step_both_losses(config_path, train_paths[cp], tp, cp, want_grads=rank == 0,
                                         overrides=tuple(overrides[0]) if overrides else ()))
        dist.barrier()
    return results


@pytest.fixture(scope="module")
def setup(tmp_path_factory, packed):
    config = _config(tmp_path_factory.mktemp("cfg"), packed)
    return str(config), {cp: str(packed[cp]) for cp in (1, 2, MAX_CP)}


@pytest.fixture(scope="module")
def reference(setup, packed, parallel_state_1proc):  # noqa: F811
    """The single-process step (TP = CP = DP = 1) and an independent count of the global batch's trained tokens."""
    from packsft.data.dataset import PackedSFTDataset

    config, paths = setup
    ref = _step_both_losses(config, paths[1], 1, 1, want_grads=True)
    dataset = PackedSFTDataset(paths[1], str(packed["tokenizer"]), "chat-template", SEQ)
    ref["independent_count"] = sum(int(((r["loss_mask"] != 0) & (r["labels"] != -100)).sum()) for r in
                                   (dataset[i] for i in range(ROWS)))
    return ref


def _check_layout(name: str, per_rank: list[dict], ref: dict) -> dict[str, float]:
    """Assert every rank's loss, norm, count and rank 0's full gradients equal ``ref``; return the maxima."""
    maxima = {"loss": 0.0, "grad": 0.0, "grad_norm": 0.0}
    for fused in (True, False):
        expected = ref[fused]
        assert expected["grad_norm"] > CLIP, "clipping must be active for the norm check to matter"
        for rank, result in enumerate(per_rank):
            got = result[fused]
            assert got["trained_tokens"] == expected["trained_tokens"] == ref["independent_count"], \
                (name, rank, fused, got["trained_tokens"], ref["independent_count"])
            maxima["loss"] = max(maxima["loss"], abs(got["loss"] - expected["loss"]))
            maxima["grad_norm"] = max(maxima["grad_norm"], abs(got["grad_norm"] - expected["grad_norm"]))
            assert abs(got["loss"] - expected["loss"]) < ATOL, (name, rank, fused, got["loss"], expected["loss"])
            assert abs(got["grad_norm"] - expected["grad_norm"]) < ATOL, \
                (name, rank, fused, got["grad_norm"], expected["grad_norm"])
        grads = per_rank[0][fused]["grads"]
        assert grads.keys() == expected["grads"].keys(), name
        for key, ref_grad in expected["grads"].items():
            assert grads[key].shape == ref_grad.shape, (name, key)
            diff = (grads[key] - ref_grad).abs().max().item()
            maxima["grad"] = max(maxima["grad"], diff)
            assert diff < ATOL, (name, fused, key, diff)
    return maxima


def _check_global_batch(name: str, per_rank: list[dict], ref: dict) -> None:
    """With DP (and TP = CP = 1) the ranks together read exactly the reference's rows, each row once."""
    assert per_rank[0]["layout"]["context_parallel_size"] == per_rank[0]["layout"]["tensor_model_parallel_size"] == 1
    dp_rows = sorted(r for result in per_rank for r in result["rows"])
    assert dp_rows == ref["rows"], (name, dp_rows, ref["rows"])


def _check_layout_and_sp(name: str, per_rank: list[dict], ref: dict, tp: int, cp: int, sp: bool) -> None:
    """:func:`_check_layout`; with sequence parallelism also that the stream is split and equal within 1e-6."""
    maxima = _check_layout(name, per_rank, ref)
    print(name, maxima)
    if sp:
        assert all(r["sequence_parallel"] for r in per_rank), name
        assert per_rank[0]["local_hidden_tokens"] == SEQ // (cp * tp), name     # the stream is really split
        assert maxima["loss"] < 1e-6 and maxima["grad"] < 1e-6, (name, maxima)


def test_reference_step_is_sane(reference):
    for fused in (True, False):
        assert 10.0 < reference[fused]["loss"] < 11.5                  # about log(49152) = 10.8 at init
        assert reference[fused]["trained_tokens"] == reference["independent_count"] > 0
    assert abs(reference[True]["loss"] - reference[False]["loss"]) < ATOL
    max_grad = max(g.abs().max().item() for g in reference[True]["grads"].values())
    print("reference loss", reference[True]["loss"], "grad_norm", reference[True]["grad_norm"], "max |grad|", max_grad,
          "trained tokens", reference["independent_count"])


SELECTIVE = ("model.recompute_granularity=selective", "model.recompute_modules=[core_attn,mlp]")
FULL_BLOCK = ("model.recompute_granularity=full", "model.recompute_method=block", "model.recompute_num_layers=1")
FULL_UNIFORM = ("model.recompute_granularity=full", "model.recompute_method=uniform", "model.recompute_num_layers=1")
TWO_RANKS = [(1, 2), (2, 1), (1, 1), (2, 1, SP)]             # cp=2, tp=2, dp=2 (tp=cp=1 on 2 ranks), tp=2 + SP
RECOMPUTE = [(1, 2, SELECTIVE), (2, 1, FULL_BLOCK), (1, 1, FULL_UNIFORM)]


@pytest.fixture(scope="module")
def two_ranks(setup) -> list[list[dict]]:
    """``[rank][i]``: the step of layout ``i`` of :data:`TWO_RANKS` then :data:`RECOMPUTE`, in one 2-process spawn."""
    config, paths = setup
    return run_distributed(_layouts_worker, 2, config, paths, TWO_RANKS + RECOMPUTE, timeout_s=700)


def test_cp2_tp2_dp2_equal_single_process(two_ranks, reference):
    for i, (tp, cp, *sp) in enumerate(TWO_RANKS):
        per_rank = [two_ranks[rank][i] for rank in range(2)]
        name = f"tp={tp} cp={cp} dp={2 // (tp * cp)}{' sequence-parallel' if sp else ''}"
        if tp * cp == 1:
            _check_global_batch(name, per_rank, reference)
        _check_layout_and_sp(name, per_rank, reference, tp, cp, bool(sp))


def test_cp4_and_tp2_cp2_equal_single_process(setup, reference):
    config, paths = setup
    layouts = [(1, 4), (2, 2), (2, 2, SP)]
    per_layout = run_distributed(_layouts_worker, 4, config, paths, layouts, timeout_s=700)
    for i, (tp, cp, *sp) in enumerate(layouts):
        per_rank = [per_layout[rank][i] for rank in range(4)]
        name = f"tp={tp} cp={cp}{' sequence-parallel' if sp else ''}"
        _check_layout_and_sp(name, per_rank, reference, tp, cp, bool(sp))


def test_recompute_under_cp2_tp2_dp2_equals_single_process_without(two_ranks, reference):
    """Activation recompute under each 2-rank layout (recomputed CP all-gather, TP collectives, DDP hooks)."""
    for i, (tp, cp, overrides) in enumerate(RECOMPUTE, start=len(TWO_RANKS)):
        per_rank = [two_ranks[rank][i] for rank in range(2)]
        name = f"tp={tp} cp={cp} dp={2 // (tp * cp)} {overrides[0].split('=')[1]}"
        assert [r["recompute"] for r in per_rank] == [overrides[0].split("=")[1]] * 2, name
        print(name, _check_layout(name, per_rank, reference))
