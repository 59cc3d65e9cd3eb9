"""Tensor parallel = 2 (and data parallel = 2) for packsft.loss, two gloo processes on localhost.

Each rank holds half the vocabulary rows of the output weight (rank r: ids [r * v/2, (r + 1) * v/2)).
Loss, hidden-state gradient and the concatenated weight-gradient shards must equal the TP=1 result
computed in the same process from the full weight.
"""

import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from packsft.loss import fused_linear_cross_entropy, global_num_trained_tokens, normalize_loss

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

WORLD = 2
T, H, V = 30, 16, 64
TOL = dict(atol=1e-5, rtol=1e-5)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _inputs(seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    hidden = (torch.randn(T, H, generator=g) / H**0.25).to(dtype)
    weight = (torch.randn(V, H, generator=g) / H**0.25).to(dtype)
    labels = torch.randint(0, V, (T,), generator=g)
    labels[::4] = -100
    labels[1], labels[2], labels[3] = V // 2 - 1, V // 2, V - 1  # both sides of the shard boundary
    loss_mask = torch.ones(T)
    loss_mask[5:9] = 0.0
    return hidden, weight, labels, loss_mask


def _loss_and_grads(hidden, weight, labels, loss_mask, reduction, chunk_size, group, **kwargs):
    hidden = hidden.clone().requires_grad_()
    weight = weight.clone().requires_grad_()
    loss = fused_linear_cross_entropy(
        hidden, weight, labels, loss_mask, chunk_size, reduction, tp_group=group, **kwargs
    )
    grad_out = torch.linspace(-1, 1, T) if reduction == "none" else None
    loss.backward(grad_out)
    return loss.detach(), hidden.grad, weight.grad


def _gather_rows(shard, group):
    parts = [torch.empty_like(shard) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, shard.contiguous(), group=group)
    return torch.cat(parts)


def _check_tp_equals_tp1(rank, group):
    rows = slice(rank * V // WORLD, (rank + 1) * V // WORLD)
    for reduction in ("none", "sum", "mean"):
        for chunk_size, vocab_chunk in ((4, 32768), (7, 12)):  # 4 divides the 20 trained tokens, 7 does not
            hidden, weight, labels, loss_mask = _inputs(seed=1)
            ref = _loss_and_grads(hidden, weight, labels, loss_mask, reduction, chunk_size, None)
            got = _loss_and_grads(
                hidden, weight[rows], labels, loss_mask, reduction, chunk_size, group, vocab_chunk_size=vocab_chunk
            )
            where = f"rank {rank}, reduction {reduction}, chunk_size {chunk_size}, vocab_chunk {vocab_chunk}"
            torch.testing.assert_close(got[0], ref[0], **TOL, msg=lambda m, w=where: f"loss, {w}: {m}")
            torch.testing.assert_close(got[1], ref[1], **TOL, msg=lambda m, w=where: f"grad_hidden, {w}: {m}")
            torch.testing.assert_close(
                _gather_rows(got[2], group), ref[2], **TOL, msg=lambda m, w=where: f"grad_weight, {w}: {m}"
            )


def _check_partial_hidden_grad_and_empty(rank, group):
    rows = slice(rank * V // WORLD, (rank + 1) * V // WORLD)
    hidden, weight, labels, loss_mask = _inputs(seed=2)
    ref = _loss_and_grads(hidden, weight, labels, loss_mask, "sum", 5, None)
    got = _loss_and_grads(hidden, weight[rows], labels, loss_mask, "sum", 5, group, reduce_hidden_grad=False)
    partial = got[1].clone()
    dist.all_reduce(partial, group=group)  # what a sequence-parallel reduce-scatter would sum
    torch.testing.assert_close(partial, ref[1], **TOL)
    assert not torch.allclose(got[1], ref[1], **TOL), "without the all-reduce the grad must be partial"

    empty = _loss_and_grads(hidden, weight[rows], torch.full_like(labels, -100), None, "mean", 5, group)
    assert empty[0].item() == 0.0
    assert torch.equal(empty[1], torch.zeros_like(empty[1]))
    assert torch.equal(empty[2], torch.zeros_like(empty[2]))


def _check_bf16(rank, group):
    rows = slice(rank * V // WORLD, (rank + 1) * V // WORLD)
    hidden, weight, labels, loss_mask = _inputs(seed=3, dtype=torch.bfloat16)
    ref = _loss_and_grads(hidden, weight, labels, loss_mask, "mean", 6, None)
    got = _loss_and_grads(hidden, weight[rows], labels, loss_mask, "mean", 6, group, vocab_chunk_size=12)
    torch.testing.assert_close(got[0], ref[0], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got[1], ref[1], atol=1e-2, rtol=1e-2)  # bf16: sums of partials round
    torch.testing.assert_close(_gather_rows(got[2], group), ref[2], atol=1e-2, rtol=1e-2)


def _check_data_parallel_mean(rank, group):
    """Two DP ranks with different trained-token counts reproduce the full-batch mean."""
    hidden, weight, labels, loss_mask = _inputs(seed=4)
    labels[15:] = torch.where(torch.arange(15) < 12, -100, labels[15:])  # rank 1 trains 3 tokens
    loss_mask = (labels != -100).float()
    local = slice(rank * T // WORLD, (rank + 1) * T // WORLD)
    count = global_num_trained_tokens(loss_mask[local], groups=(group,))
    assert count.item() == int(loss_mask.sum())
    w = weight.clone().requires_grad_()
    h = hidden.clone().requires_grad_()
    loss_sum = fused_linear_cross_entropy(h[local], w, labels[local], loss_mask[local], 4, "sum")
    normalize_loss(loss_sum, count).backward()
    grad_w = w.grad.clone()
    dist.all_reduce(grad_w, group=group)  # a summing gradient reduction (gradient_average_size=1)
    ref = _loss_and_grads(hidden, weight, labels, loss_mask, "mean", 4, None)
    torch.testing.assert_close(grad_w, ref[2], **TOL)


def _worker(rank, port):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    try:
        group = dist.new_group(list(range(WORLD)))
        _check_tp_equals_tp1(rank, group)
        _check_partial_hidden_grad_and_empty(rank, group)
        _check_bf16(rank, group)
        _check_data_parallel_mean(rank, group)
    finally:
        dist.destroy_process_group()


def test_tp2_and_dp2_equal_single_process():
    mp.spawn(_worker, args=(_free_port(),), nprocs=WORLD, join=True)
