"""packsft.loss against F.cross_entropy on full logits (single process, CPU).

Shapes: t tokens, h hidden, v vocabulary. Inputs are scaled so logits have unit variance and losses are
O(log v); fp32 results must equal the reference within atol = rtol = 1e-5.
"""

import pytest
import torch
import torch.nn.functional as F

from packsft.loss import (
    fused_linear_cross_entropy,
    global_num_trained_tokens,
    normalize_loss,
    num_trained_tokens,
)
from packsft.loss.fused_linear_cross_entropy import _addmm_fp32_output, _fp32_output_gemm

T, H, V = 24, 16, 50
TOL = dict(atol=1e-5, rtol=1e-5)
# bf16 tolerance (documented in docs/loss.md): error relative to the largest reference value.
BF16_REL_TOL = {"loss": 1e-3, "grad_hidden": 1e-2, "grad_weight": 1e-2}


def _inputs(t=T, h=H, v=V, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    hidden = (torch.randn(t, h, generator=g) / h**0.25).to(dtype).requires_grad_()
    weight = (torch.randn(v, h, generator=g) / h**0.25).to(dtype).requires_grad_()
    labels = torch.randint(0, v, (t,), generator=g)
    return hidden, weight, labels


def _reference(hidden, weight, labels, reduction, loss_mask=None, grad_out=None):
    """Loss and (grad_hidden, grad_weight) of F.cross_entropy on the full fp32 logits."""
    h32 = hidden.detach().float().requires_grad_()
    w32 = weight.detach().float().requires_grad_()
    per_token = F.cross_entropy(h32 @ w32.t(), labels, reduction="none")
    if loss_mask is not None:
        per_token = per_token * loss_mask
    trained = (labels != -100) & (loss_mask != 0 if loss_mask is not None else True)
    if reduction == "none":
        loss = per_token
    elif reduction == "sum":
        loss = per_token.sum()
    else:
        loss = per_token.sum() / max(int(trained.sum()), 1)
    loss.backward(grad_out if reduction == "none" else None)
    return loss.detach(), h32.grad, w32.grad


def _ours(hidden, weight, labels, reduction, chunk_size, loss_mask=None, grad_out=None, vocab_chunk_size=32768):
    hidden.grad = weight.grad = None
    loss = fused_linear_cross_entropy(
        hidden, weight, labels, loss_mask, chunk_size, reduction, vocab_chunk_size=vocab_chunk_size
    )
    loss.backward(grad_out if reduction == "none" else None)
    return loss.detach(), hidden.grad, weight.grad


def _ignore(labels, pattern):
    labels = labels.clone()
    if pattern == "scattered":
        labels[::3] = -100
    elif pattern == "leading_span":  # tokens 0..11 ignored: spans three whole chunks of 4
        labels[:12] = -100
    return labels


@pytest.mark.parametrize("reduction", ["none", "sum", "mean"])
@pytest.mark.parametrize("chunk_size", [4, 7, 24, 100])  # 4 divides 24 (and 12, 16 trained), 7 does not
@pytest.mark.parametrize("pattern", ["no_ignore", "scattered", "leading_span"])
@pytest.mark.parametrize("vocab_chunk_size", [16, 32768])  # 16 splits V=50 into 16+16+16+2; 32768: one block
def test_matches_full_logits_cross_entropy(reduction, chunk_size, pattern, vocab_chunk_size):
    hidden, weight, labels = _inputs()
    labels = _ignore(labels, pattern)
    labels[-1] = V - 1  # a label in the last, short vocab block
    grad_out = torch.randn(T, generator=torch.Generator().manual_seed(1))
    ref = _reference(hidden, weight, labels, reduction, grad_out=grad_out)
    got = _ours(hidden, weight, labels, reduction, chunk_size, grad_out=grad_out, vocab_chunk_size=vocab_chunk_size)
    assert got[0].dtype == torch.float32 and got[0].shape == ref[0].shape
    for name, a, b in zip(("loss", "grad_hidden", "grad_weight"), got, ref):
        torch.testing.assert_close(a, b, **TOL, msg=lambda m, name=name: f"{name}: {m}")
    if reduction == "none":
        assert torch.all(got[0][labels == -100] == 0)


@pytest.mark.parametrize("reduction", ["none", "sum", "mean"])
def test_loss_mask_weights_and_excludes_tokens(reduction):
    hidden, weight, labels = _inputs(seed=3)
    labels = _ignore(labels, "scattered")
    loss_mask = torch.ones(T)
    loss_mask[1:6] = 0.0
    loss_mask[20] = 0.5  # a weight, not only 0/1
    grad_out = torch.randn(T)
    ref = _reference(hidden, weight, labels, reduction, loss_mask, grad_out)
    got = _ours(hidden, weight, labels, reduction, 5, loss_mask, grad_out)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, **TOL)


@pytest.mark.parametrize("reduction", ["none", "sum", "mean"])
@pytest.mark.parametrize("how", ["labels", "loss_mask"])
def test_no_trained_token_gives_exact_zero_and_zero_grads(reduction, how):
    hidden, weight, labels = _inputs()
    loss_mask = None
    if how == "labels":
        labels = torch.full_like(labels, -100)
    else:
        loss_mask = torch.zeros(T)
    loss = fused_linear_cross_entropy(hidden, weight, labels, loss_mask, 4, reduction)
    assert not torch.isnan(loss).any()
    assert torch.all(loss == 0)
    loss.sum().backward()
    assert torch.equal(hidden.grad, torch.zeros_like(hidden))
    assert torch.equal(weight.grad, torch.zeros_like(weight))


def test_megatron_sbh_layout_and_module_form():
    s, b = 6, 4
    hidden, weight, labels = _inputs(t=s * b)
    labels_bs = _ignore(labels, "scattered").reshape(b, s)  # Megatron labels are [b, s]
    hidden_sbh = hidden.detach().reshape(s, b, H).requires_grad_()
    per_token = fused_linear_cross_entropy(hidden_sbh, weight, labels_bs.t(), chunk_size=5, reduction="none")
    assert per_token.shape == (s, b)
    flat_labels = labels_bs.t().reshape(-1)
    flat = fused_linear_cross_entropy(hidden_sbh.reshape(-1, H), weight, flat_labels, reduction="none")
    torch.testing.assert_close(per_token.reshape(-1), flat, **TOL)
    summed = fused_linear_cross_entropy(hidden_sbh, weight, labels_bs.t(), chunk_size=5, reduction="sum")
    torch.testing.assert_close(summed, per_token.sum(), **TOL)


def test_tied_embedding_gradient_adds_both_uses():
    torch.manual_seed(4)
    embedding = torch.nn.Embedding(V, H)
    tokens = torch.randint(0, V, (T,))
    labels = _ignore(torch.randint(0, V, (T,)), "scattered")

    def run(loss_fn):
        embedding.zero_grad()
        hidden = torch.tanh(embedding(tokens))  # stands in for the decoder
        loss_fn(hidden, embedding.weight).backward()
        return embedding.weight.grad.clone()

    ours = run(lambda h, w: fused_linear_cross_entropy(h, w, labels, chunk_size=5))
    ref = run(lambda h, w: F.cross_entropy(h @ w.t(), labels))
    torch.testing.assert_close(ours, ref, **TOL)


def test_frozen_weight_gives_hidden_grad_only():
    hidden, weight, labels = _inputs()
    weight.requires_grad_(False)
    fused_linear_cross_entropy(hidden, weight, labels, chunk_size=7).backward()
    _, ref_grad_hidden, _ = _reference(hidden, weight, labels, "mean")
    assert weight.grad is None
    torch.testing.assert_close(hidden.grad, ref_grad_hidden, **TOL)


def test_saves_nothing_of_vocab_size():
    t, v = 64, 1000
    hidden, weight, labels = _inputs(t=t, v=v)
    loss = fused_linear_cross_entropy(hidden, weight, labels, chunk_size=8, reduction="none")
    node = loss.grad_fn
    while type(node).__name__ != "FusedLinearCrossEntropyFunctionBackward":
        node = node.next_functions[0][0]
    saved = node.saved_tensors
    inputs = {hidden.data_ptr(), weight.data_ptr()}
    others = [x for x in saved if x.data_ptr() not in inputs]
    assert len(saved) - len(others) == 2  # hidden and weight saved by reference, not copied
    assert all(x.dim() == 1 and x.numel() <= t for x in others), [tuple(x.shape) for x in others]


def _bf16_errors(chunk_size, device="cpu"):
    t, h, v = 256, 64, 512
    hidden, weight, labels = _inputs(t=t, h=h, v=v, seed=5, dtype=torch.bfloat16)
    labels = _ignore(labels, "scattered")
    ref = _reference(hidden, weight, labels, "mean")  # fp32 math on the same bf16-valued inputs (CPU)
    on = [x.detach().to(device).requires_grad_() for x in (hidden, weight)]
    got = _ours(*on, labels.to(device), "mean", chunk_size, vocab_chunk_size=200)
    assert got[1].dtype == got[2].dtype == torch.bfloat16
    return {
        name: float((a.float().cpu() - b).abs().max() / b.abs().max())
        for name, a, b in zip(("loss", "grad_hidden", "grad_weight"), got, ref)
    }


def test_bf16_within_documented_tolerance_and_not_growing_with_chunks():
    one_chunk = _bf16_errors(256)
    for chunk_size in (32, 4):
        many = _bf16_errors(chunk_size)
        for name, err in many.items():
            assert err <= BF16_REL_TOL[name], (chunk_size, name, err)
            assert err <= 1.5 * one_chunk[name] + 1e-6, (chunk_size, name, err, one_chunk[name])


def test_fp32_output_gemm_only_on_cuda_and_for_bf16():
    out, a = torch.zeros(2, 2), torch.ones(2, 2, dtype=torch.bfloat16)
    assert not _fp32_output_gemm(out)
    assert not _addmm_fp32_output(out, a, a) and out.abs().sum() == 0   # CPU: the caller's fallback runs
    assert not _addmm_fp32_output(out, a.half(), a.half())              # fp16: never (probabilities ~1/v)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the fp32-output bf16 GEMM path is CUDA's")
def test_bf16_on_cuda_uses_fp32_output_gemms_and_stays_within_tolerance():
    if tuple(int(x) for x in torch.__version__.split(".")[:2]) >= (2, 10):
        assert _fp32_output_gemm(torch.zeros(1, device="cuda")), "torch.addmm(out_dtype=float32) failed on CUDA"
    fast = _fp32_output_gemm(torch.zeros(1, device="cuda"))
    for chunk_size in (256, 4):
        errors = _bf16_errors(chunk_size, device="cuda")
        for name, err in errors.items():
            assert err <= BF16_REL_TOL[name], (chunk_size, name, err)
        if fast:   # fp32 logits of exact bf16 products: the loss is the fp32 reference's but for summation order
            assert errors["loss"] <= 1e-5, (chunk_size, errors)


def test_num_trained_tokens_counts_mask_and_labels():
    loss_mask = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.5])
    labels = torch.tensor([3, -100, 4, 5, 6])
    assert num_trained_tokens(loss_mask).item() == 4
    assert num_trained_tokens(loss_mask, labels).item() == 3
    n = global_num_trained_tokens([loss_mask, torch.zeros(3)], groups=None)
    assert n.dtype == torch.int64 and n.item() == 4
    assert global_num_trained_tokens(loss_mask, groups=()).item() == 4


def test_micro_batches_with_global_count_equal_full_batch_mean():
    """Gradient accumulation over micro-batches (one with no trained token) reproduces the full-batch mean."""
    hidden, weight, labels = _inputs(t=30, seed=6)
    labels = _ignore(labels, "scattered")
    labels[10:20] = -100  # the middle micro-batch trains nothing
    loss_mask = (labels != -100).float()
    slices = [slice(0, 10), slice(10, 20), slice(20, 30)]
    count = global_num_trained_tokens([loss_mask[s] for s in slices])
    total = torch.zeros(())
    for s in slices:
        loss_sum = fused_linear_cross_entropy(hidden[s], weight, labels[s], loss_mask[s], 4, "sum")
        part = normalize_loss(loss_sum, count)
        if s.start == 10:
            assert part.item() == 0.0
        part.backward()
        total += part.detach()
    ref = _reference(hidden, weight, labels, "mean")
    torch.testing.assert_close(total, ref[0], **TOL)
    torch.testing.assert_close(hidden.grad, ref[1], **TOL)
    torch.testing.assert_close(weight.grad, ref[2], **TOL)


def test_normalize_loss_zero_count_and_average_size():
    loss_sum = torch.tensor(3.0, requires_grad=True)
    zero = normalize_loss(loss_sum * 0, torch.tensor(0))
    assert zero.item() == 0.0 and not torch.isnan(zero)
    assert normalize_loss(loss_sum, 4, gradient_average_size=2).item() == pytest.approx(1.5)
