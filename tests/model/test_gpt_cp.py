"""Context/tensor parallelism on 2 gloo processes reproduce the single-process per-token loss and gradients."""

import pytest
import torch
import torch.distributed as dist
from distributed_helpers import parallel_state_1proc, run_distributed  # noqa: F401 - fixture

from packsft.data.context_parallel import make_packed_seq_params, slice_batch_for_cp
from packsft.layout import cp_partition_indices
from packsft.model.config import ModelConfig
from packsft.model.gpt import build_gpt_model
from packsft.model.output_head import use_hidden_state_output
from packsft.train.distributed import init_distributed
from packsft.train.token_loss import gpt_token_loss

LENGTHS = [8, 12, 4, 8]                      # multiples of 2 * cp = 4
CU = torch.tensor([0, 8, 20, 24, 32], dtype=torch.int32)
SEED, VOCAB = 7, 1000

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


def _model():
    torch.manual_seed(SEED)
    model = build_gpt_model(ModelConfig(num_layers=2, hidden_size=64, ffn_hidden_size=128,
                                        num_attention_heads=4, num_query_groups=2, vocab_size=VOCAB,
                                        max_position_embeddings=128))
    use_hidden_state_output(model)
    return model


def _row():
    gen = torch.Generator().manual_seed(SEED)
    labels = torch.randint(0, VOCAB, (1, 32), generator=gen)
    labels[0, [0, 1, 9, 21]] = -100
    return {"tokens": torch.randint(0, VOCAB, (1, 32), generator=gen), "labels": labels,
            "loss_mask": (labels != -100).float(),
            "position_ids": torch.cat([torch.arange(n) for n in LENGTHS])[None], "cu_seqlens": CU}


def _loss_and_grads(model, batch, fused, grad_group=None):
    """Per-token loss [t] and all parameter gradients of sum(loss) (summed over ``grad_group``)."""
    model.zero_grad(set_to_none=True)
    loss, mask = gpt_token_loss(model, batch, fused=fused, chunk_size=5)
    loss.sum().backward()                      # max |grad| about 4.7: atol 1e-5 is tight
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    if grad_group is not None:
        for g in grads.values():
            dist.all_reduce(g, group=grad_group)
    return loss.detach(), grads


def _cp_worker(rank, world_size):
    ctx = init_distributed(context_parallel_size=world_size)
    model = _model()
    local = slice_batch_for_cp(_row(), world_size, ctx.cp_rank)
    local["packed_seq_params"] = make_packed_seq_params(CU, max(LENGTHS), cp_group=ctx.cp_group)
    results = {fused: _loss_and_grads(model, local, fused, grad_group=ctx.cp_group) for fused in (False, True)}
    sbhd = _sbhd_loss(model, world_size, ctx.cp_rank)
    _use_reference_varlen(model)                       # the CUDA path's inputs, through a CPU kernel of its contract
    local["packed_seq_params"] = make_packed_seq_params(CU, max(LENGTHS), cp_group=ctx.cp_group)
    results["varlen"] = _loss_and_grads(model, local, False, grad_group=ctx.cp_group)
    return results, sbhd


def _use_reference_varlen(model):
    from test_attention import reference_varlen

    from packsft.model.attention import AttentionKernel, TorchCoreAttention

    for module in model.modules():
        if isinstance(module, TorchCoreAttention):
            module.kernel = AttentionKernel("reference varlen", reference_varlen)


def _sbhd_loss(model, cp_size, cp_rank):
    """Per-token loss [32 / cp] of the row as ONE unpacked sbhd sequence (no packed_seq_params)."""
    index = cp_partition_indices(torch.tensor([0, 32]), cp_size, cp_rank)
    row = _row()
    with torch.no_grad():
        return model(row["tokens"][:, index], torch.arange(32)[None, index], None,
                     labels=row["labels"][:, index].clamp(min=0))[0]


def _tp_worker(rank, world_size):
    init_distributed(tensor_model_parallel_size=world_size)
    model = _model()
    batch = dict(_row(), packed_seq_params=make_packed_seq_params(CU, max(LENGTHS)))
    (stock_loss, stock_grads), (fused_loss, fused_grads) = (_loss_and_grads(model, batch, f)
                                                            for f in (False, True))
    max_grad_diff = max((stock_grads[n] - fused_grads[n]).abs().max().item() for n in stock_grads)
    return stock_loss, fused_loss, max_grad_diff


@pytest.fixture(scope="module")
def reference(parallel_state_1proc):  # noqa: F811
    model = _model()
    batch = dict(_row(), packed_seq_params=make_packed_seq_params(CU, max(LENGTHS)))
    return (*_loss_and_grads(model, batch, fused=False), _sbhd_loss(model, 1, 0))


def test_cp2_matches_cp1_loss_and_gradients(reference):
    ref_loss, ref_grads, ref_sbhd = reference
    per_rank = run_distributed(_cp_worker, 2)
    for rank, (results, sbhd) in enumerate(per_rank):
        torch.testing.assert_close(sbhd, ref_sbhd[cp_partition_indices(torch.tensor([0, 32]), 2, rank)],
                                   atol=1e-5, rtol=0)
        index = cp_partition_indices(CU, 2, rank)
        for fused, (loss, grads) in results.items():
            torch.testing.assert_close(loss, ref_loss[index], atol=1e-5, rtol=0,   # fused "varlen": the varlen path
                                       msg=lambda m, r=rank, f=fused: f"rank {r} fused={f}: {m}")
            for name, ref in ref_grads.items():
                torch.testing.assert_close(grads[name], ref, atol=1e-5, rtol=0,
                                           msg=lambda m, n=name, f=fused: f"{n} fused={f}: {m}")


def test_tp2_matches_tp1_loss_and_fused_equals_stock(reference):
    ref_loss, _, _ = reference
    for stock_loss, fused_loss, max_grad_diff in run_distributed(_tp_worker, 2):
        torch.testing.assert_close(stock_loss, ref_loss, atol=1e-5, rtol=0)
        torch.testing.assert_close(fused_loss, ref_loss, atol=1e-5, rtol=0)
        assert max_grad_diff < 1e-5
