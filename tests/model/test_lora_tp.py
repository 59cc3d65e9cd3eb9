"""A TP=2 training step equals the single-process one: Qwen3's q/k norms and LoRA adapters (2 gloo processes).

The step is the trainer's: stock per-token loss on a packed THD row through Megatron's DDP, backward,
``finalize_model_grads`` (sums the per-head q/k norm gradients and, under SP, the replicated adapter ones over TP),
then Megatron's optimizer as packsft steps it (TP-aware norm and clip on the device, fused AdamW). Gradients and
updated weights are compared as full (TP=1 layout) tensors.
"""

import pytest
import torch
import torch.distributed as dist
from distributed_helpers import parallel_state_1proc, run_distributed  # noqa: F401

from packsft.data.context_parallel import make_packed_seq_params
from packsft.model.config import ModelConfig
from packsft.model.gpt import build_gpt_model
from packsft.model.lora import LoraConfig, apply_lora, lora_modules
from packsft.train.config import OptimizerConfig
from packsft.train.optim import build_megatron_optimizer, megatron_step_skipping_non_finite

pytestmark = [pytest.mark.distributed, pytest.mark.slow]
LENGTHS, VOCAB = [10, 6, 8, 8], 256
CASES = [("qwen3", False), ("qwen3", True), ("lora", False), ("lora", True)]   # (model, sequence parallel)


def _config(**kw):
    return ModelConfig(num_layers=2, hidden_size=64, ffn_hidden_size=96, num_attention_heads=4, num_query_groups=2,
                       vocab_size=VOCAB, max_position_embeddings=64, kv_channels=32, qk_layernorm=True,
                       init_method_std=0.1, **kw)


def _shard_rows(full, name, rank, tp):
    """Rank ``rank``'s row shard of a full column-parallel tensor (SwiGLU ``linear_fc1``: gate and up halves)."""
    if ".linear_fc1." in name:
        gate, up = full.chunk(2, 0)
        return torch.cat([gate.chunk(tp, 0)[rank], up.chunk(tp, 0)[rank]])
    return full.chunk(tp, 0)[rank]


def _full(t, name, p, group, tp):
    """The TP=1 tensor of a parameter (or its gradient) ``t``."""
    if tp == 1 or not getattr(p, "tensor_model_parallel", False):
        return t.detach().clone()
    parts = [torch.empty_like(t) for _ in range(tp)]
    dist.all_gather(parts, t.detach().contiguous(), group=group)
    if ".linear_fc1." in name and p.partition_dim == 0:
        halves = [part.chunk(2, 0) for part in parts]
        parts = [h[0] for h in halves] + [h[1] for h in halves]
    return torch.cat(parts, p.partition_dim)


def one_step(kind, sp, rank=0, tp=1, group=None):
    torch.manual_seed(0)
    model = build_gpt_model(_config(), sequence_parallel=sp)
    with torch.no_grad():   # q/k norm weights away from 1, identically on every rank
        g = torch.Generator().manual_seed(1)
        for name, p in model.named_parameters():
            if "layernorm" in name:
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=g))
    if kind == "lora":
        apply_lora(model, LoraConfig(rank=4, alpha=8.0))
        g = torch.Generator().manual_seed(2)
        with torch.no_grad():    # non-zero B, so A gets a gradient too
            for name, module in sorted(lora_modules(model).items()):
                b = module.lora_B["default"].weight
                full = 0.1 * torch.randn(module.out_features, 4, generator=g)
                b.copy_(full if module.is_parallel_a else _shard_rows(full, name + ".", rank, tp))
    cu = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()], dtype=torch.int32)
    tokens = torch.randint(0, VOCAB, (1, int(cu[-1])), generator=torch.Generator().manual_seed(3))
    labels = torch.roll(tokens, -1, 1)
    position_ids = torch.cat([torch.arange(n) for n in LENGTHS])[None]
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads

    model.config.calculate_per_token_loss = True
    ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(grad_reduce_in_fp32=True), model)
    # eps 1e-3: Adam's first step is lr * sign(g) for |g| >> eps, which would turn 1e-9 rounding noise of near-zero
    # gradients into lr-sized differences
    opt = build_megatron_optimizer(ddp, OptimizerConfig(lr=1e-2, adam_eps=1e-3, weight_decay=0.1, clip_grad=0.5),
                                   bf16=False)
    loss = ddp(tokens, position_ids, None, labels=labels, packed_seq_params=make_packed_seq_params(cu, max(LENGTHS)))
    (loss.sum() / loss.numel()).backward()
    finalize_model_grads([ddp])
    grads = {n: _full(p.main_grad, n, p, group, tp) for n, p in model.named_parameters() if p.requires_grad}
    _, norm = megatron_step_skipping_non_finite(opt, loss.sum().detach())
    after = {n: _full(p, n, p, group, tp) for n, p in model.named_parameters() if p.requires_grad}
    return {"loss": float(loss.sum()), "norm": float(norm), "grads": grads, "after": after}


def _tp2_worker(rank, world_size):
    from packsft.train.distributed import init_distributed

    ctx = init_distributed(tensor_model_parallel_size=2)
    return [one_step(kind, sp, rank, 2, ctx.tp_group) for kind, sp in CASES]


def test_tp2_step_equals_tp1_qk_norms_and_lora(parallel_state_1proc):  # noqa: F811
    reference = {kind: one_step(kind, False) for kind in ("qwen3", "lora")}
    lora_ref = reference["lora"]["grads"]
    assert all(".lora_" in k for k in lora_ref) and len(lora_ref) == 2 * 4 * 2      # adapters only
    assert min(g.abs().max().item() for g in lora_ref.values()) > 0                # A and B get gradients
    per_rank = run_distributed(_tp2_worker, 2, timeout_s=300)
    for i, (kind, sp) in enumerate(CASES):
        ref, got = reference[kind], per_rank[0][i]
        assert abs(got["loss"] - ref["loss"]) < 1e-4 and abs(got["norm"] - ref["norm"]) < 1e-5, (kind, sp)
        assert got["grads"].keys() == ref["grads"].keys()
        if kind == "qwen3":   # without the TP sum each rank would hold about half of it
            assert ref["grads"]["decoder.layers.0.self_attention.q_layernorm.weight"].abs().max() > 1e-2
        for key in ref["grads"]:
            torch.testing.assert_close(got["grads"][key], ref["grads"][key], atol=1e-5, rtol=0, msg=(kind, sp, key))
            torch.testing.assert_close(got["after"][key], ref["after"][key], atol=1e-5, rtol=0, msg=(kind, sp, key))
