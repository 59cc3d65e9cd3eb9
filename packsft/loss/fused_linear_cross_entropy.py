"""Chunked fused linear cross-entropy: the LM-head loss without a ``[t, v]`` logits tensor.

Shape legend: ``t`` = tokens of the micro-batch (packed THD rows flattened, or Megatron's ``[s, b]``
flattened), ``h`` = hidden size, ``v`` = vocabulary size, ``v_local = v / tp`` = this rank's vocab
shard, ``c`` = ``chunk_size`` (tokens per chunk), ``n`` = trained tokens (label not ignored and
``loss_mask`` non-zero).

Algorithm, memory figures and the normalisation it feeds: ``docs/loss.md``. The vocab-parallel
log-sum-exp follows Megatron-Core's ``VocabParallelCrossEntropy`` (``tensor_parallel.cross_entropy``): max
all-reduced, then the sum of exponentials and the target logit all-reduced, over the tensor-parallel group.
"""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist

from packsft.layout import IGNORE_INDEX
from packsft.process_groups import rank_and_size

_REDUCTIONS = ("none", "sum", "mean")


def _chunk_logits_fp32(hidden_c: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Return ``hidden_c [c, h] @ weight.T`` as fp32 ``[c, v_local]``.

    fp32 inputs give fp32 logits directly. bf16 on CUDA (:func:`_fp32_output_gemm`): one bf16 GEMM with fp32
    output, the logits never rounded to bf16. Otherwise (CPU, fp16, PyTorch < 2.10) the matmul runs in the inputs'
    dtype (fp32 accumulation inside the GEMM, result rounded once to that dtype, as Megatron's output layer does) and
    is then upcast. Softmax, log-sum-exp and gradients are computed in fp32.
    """
    if hidden_c.dtype == weight.dtype == torch.bfloat16 and _fp32_output_gemm(hidden_c):   # else autocast casts `@`
        return torch.mm(hidden_c, weight.t(), out_dtype=torch.float32)   # the same cuBLAS path as addmm's
    logits = hidden_c @ weight.t()
    return logits if logits.dtype == torch.float32 else logits.float()


_FP32_OUTPUT_GEMM: dict[torch.device, bool] = {}   # per CUDA device: whether mm/addmm(out_dtype=) work here


def _fp32_output_gemm(t: torch.Tensor) -> bool:
    """Whether bf16 GEMMs on ``t``'s device can write (``torch.mm``) or add (:func:`_addmm_fp32_output`) their
    product in fp32.

    CUDA only; probed once per device on a 1x1 product, so a real call never needs to catch an error (an
    out-of-memory or a CUDA fault there stays an error). PyTorch 2.8 added ``out_dtype``, but only 2.10's kernel
    accepts an fp32 ``input`` with bf16 matrices (pytorch/pytorch#167931); before it the probe fails, a warning says
    so once, and the slower GEMMs are used.
    """
    if not t.is_cuda:
        return False
    if t.device not in _FP32_OUTPUT_GEMM:
        out = torch.zeros(1, 1, dtype=torch.float32, device=t.device)
        one = torch.ones(1, 1, dtype=torch.bfloat16, device=t.device)
        try:
            torch.addmm(out, one, one, out_dtype=torch.float32, out=out)
            product = torch.mm(one, one, out_dtype=torch.float32)     # the logits' GEMM (_chunk_logits_fp32)
            ok = out.item() == 1.0 and product.dtype == torch.float32 and product.item() == 1.0
        except (TypeError, RuntimeError, NotImplementedError) as err:
            ok = False
            warnings.warn(f"torch {torch.__version__} has no bf16 GEMM with fp32 output on {t.device} "
                          f"({type(err).__name__}: {err}); the fused loss rounds its logits to bf16 and computes "
                          "the weight gradient in fp32 on upcast operands instead (slower). PyTorch >= 2.10 has it.",
                          stacklevel=2)
        _FP32_OUTPUT_GEMM[t.device] = ok
    return _FP32_OUTPUT_GEMM[t.device]


def _addmm_fp32_output(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> bool:
    """``out += a @ b`` in one bf16 GEMM with fp32 accumulation and fp32 output (no rounding of the product).

    ``out`` fp32 ``[m, n]``, ``a`` ``[m, k]`` and ``b`` ``[k, n]`` bf16. cuBLAS through ``torch.addmm(...,
    out_dtype=torch.float32)`` (https://docs.pytorch.org/docs/stable/generated/torch.addmm.html): tensor-core
    speed, where an fp32 GEMM on upcast operands runs at a fraction of it. Returns False, changing nothing, where
    :func:`_fp32_output_gemm` says there is no such kernel (CPU; PyTorch < 2.10) or for fp16 (its ``[c, block]``
    probabilities, around 1/v, would lose precision or flush to zero).
    """
    if a.dtype != torch.bfloat16 or not _fp32_output_gemm(out):
        return False
    torch.addmm(out, a, b, out_dtype=torch.float32, out=out)
    return True


def _block_target(labels_c: torch.Tensor, vocab_start: int, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Map global label ids ``[c]`` to (column in the vocab block ``[c]`` int64, label-in-block ``[c]`` fp32).

    The block covers global ids ``[vocab_start, vocab_start + block)``.
    """
    local = labels_c - vocab_start
    inside = (local >= 0) & (local < block)
    return local.clamp(0, block - 1), inside.float()


def _vocab_blocks(v_local: int, vocab_chunk_size: int):
    for vs in range(0, v_local, vocab_chunk_size):
        yield vs, min(vs + vocab_chunk_size, v_local)


def _chunk_lse_and_target(hidden_c, weight, labels_c, vocab_start, vocab_chunk_size, tp_group):
    """Return fp32 ``lse [c]`` and target logit ``[c]`` over the full (all-rank) vocabulary.

    Online log-sum-exp over vocab blocks of ``[c, vocab_chunk_size]`` fp32 logits (running max ``m`` and
    ``sum exp(logits - m)``), then max and (sum, target) all-reduced over ``tp_group``.
    """
    c = hidden_c.shape[0]
    row_max = torch.full((c,), float("-inf"), dtype=torch.float32, device=hidden_c.device)
    sum_exp = torch.zeros(c, dtype=torch.float32, device=hidden_c.device)
    target = torch.zeros(c, dtype=torch.float32, device=hidden_c.device)
    for vs, ve in _vocab_blocks(weight.shape[0], vocab_chunk_size):
        logits = _chunk_logits_fp32(hidden_c, weight[vs:ve])  # [c, block] fp32
        col, inside = _block_target(labels_c, vocab_start + vs, ve - vs)
        target += logits.gather(1, col[:, None]).squeeze(1) * inside
        new_max = torch.maximum(row_max, logits.max(dim=1).values)
        sum_exp.mul_((row_max - new_max).exp_()).add_(logits.sub_(new_max[:, None]).exp_().sum(dim=1))
        row_max = new_max
        del logits
    if tp_group is not None and dist.get_world_size(group=tp_group) > 1:
        global_max = row_max.clone()
        dist.all_reduce(global_max, op=dist.ReduceOp.MAX, group=tp_group)
        both = torch.stack((sum_exp * (row_max - global_max).exp(), target))
        dist.all_reduce(both, op=dist.ReduceOp.SUM, group=tp_group)
        row_max, sum_exp, target = global_max, both[0], both[1]
    return row_max + sum_exp.log(), target


def _chunk_backward(hidden_c, weight, labels_c, lse_c, g_c, vocab_start, vocab_chunk_size, grad_w):
    """Add this chunk's weight gradient to fp32 ``grad_w`` (if given); return its fp32 hidden gradient ``[c, h]``.

    Per vocab block: ``p = exp(logits - lse) - onehot(label)`` (``[c, block]`` fp32, the gradient of
    ``lse - target`` with respect to the logits), ``grad_h += p @ W_block``, ``grad_W_block += p.T @ (g * h)``.
    Row ``i`` is scaled by ``g_c[i]`` on the ``[c, h]`` side, never on ``[c, block]``.
    """
    grad_h_c = torch.zeros(hidden_c.shape, dtype=torch.float32, device=hidden_c.device)
    scaled_h = hidden_c.float() * g_c[:, None] if grad_w is not None else None  # a new tensor, also in fp32
    low = weight.dtype != torch.float32
    fast = weight.dtype == torch.bfloat16 and scaled_h is not None and _fp32_output_gemm(weight)
    scaled_h_low = scaled_h.to(weight.dtype) if fast else None
    rows = torch.arange(hidden_c.shape[0], device=hidden_c.device)
    for vs, ve in _vocab_blocks(weight.shape[0], vocab_chunk_size):
        probs = _chunk_logits_fp32(hidden_c, weight[vs:ve]).sub_(lse_c[:, None]).exp_()
        col, inside = _block_target(labels_c, vocab_start + vs, ve - vs)
        probs[rows, col] -= inside
        probs_low = probs.to(weight.dtype) if low else None
        if not low:
            grad_h_c.addmm_(probs, weight[vs:ve])
        elif not _addmm_fp32_output(grad_h_c, probs_low, weight[vs:ve]):
            grad_h_c += probs_low @ weight[vs:ve]
        if grad_w is not None:
            block = grad_w[vs:ve]
            if scaled_h_low is None or not _addmm_fp32_output(block, probs_low.t(), scaled_h_low):
                block.addmm_(probs.t(), scaled_h)   # fp32 GEMM (upcast operands for bf16/fp16 weights off CUDA)
        del probs, probs_low
    return grad_h_c.mul_(g_c[:, None])


class FusedLinearCrossEntropyFunction(torch.autograd.Function):
    """Autograd function behind :func:`fused_linear_cross_entropy`; returns fp32 per-token loss ``[t]``.

    Inputs are already flattened and validated by :func:`fused_linear_cross_entropy`:
    ``hidden [t, h]``, ``weight [v_local, h]``, ``idx [n]`` int64 (positions of trained tokens),
    ``labels_n [n]`` int64 (global vocab ids), ``scale_n [n]`` fp32 (the ``loss_mask`` value, 1.0
    without one), ``chunk_size``, ``vocab_chunk_size``, ``tp_group``, ``reduce_hidden_grad``.
    Saved for backward: ``hidden``, ``weight`` (references, no copies), ``idx``, ``labels_n``,
    ``scale_n`` and ``lse [n]`` fp32; nothing of size ``v``.
    """

    @staticmethod
    def forward(ctx, hidden, weight, idx, labels_n, scale_n, chunk_size, vocab_chunk_size, tp_group,
                reduce_hidden_grad):
        """Per chunk: ``scale * (logsumexp(logits) - logits[label])`` for the ``n`` trained tokens."""
        vocab_start = rank_and_size(tp_group)[0] * weight.shape[0]
        n = idx.numel()
        lse = torch.empty(n, dtype=torch.float32, device=hidden.device)
        target = torch.empty(n, dtype=torch.float32, device=hidden.device)
        for s in range(0, n, chunk_size):
            e = min(s + chunk_size, n)
            lse[s:e], target[s:e] = _chunk_lse_and_target(
                hidden.index_select(0, idx[s:e]), weight, labels_n[s:e], vocab_start, vocab_chunk_size, tp_group
            )
        loss = torch.zeros(hidden.shape[0], dtype=torch.float32, device=hidden.device)
        loss.index_copy_(0, idx, (lse - target) * scale_n)
        ctx.save_for_backward(hidden, weight, idx, labels_n, scale_n, lse)
        ctx.chunk_size, ctx.vocab_chunk_size = chunk_size, vocab_chunk_size
        ctx.tp_group, ctx.reduce_hidden_grad = tp_group, reduce_hidden_grad
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        """Recompute each chunk's softmax; ``d loss_i / d logits_i = g_i * (softmax_i - onehot(label_i))``."""
        hidden, weight, idx, labels_n, scale_n, lse = ctx.saved_tensors
        want_h, want_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        tp_rank, tp_size = rank_and_size(ctx.tp_group)
        g = grad_loss.float().index_select(0, idx) * scale_n  # [n] fp32: upstream gradient times loss_mask
        grad_h = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device) if want_h else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if want_w else None
        for s in range(0, idx.numel(), ctx.chunk_size):
            e = min(s + ctx.chunk_size, idx.numel())
            grad_h_c = _chunk_backward(
                hidden.index_select(0, idx[s:e]), weight, labels_n[s:e], lse[s:e], g[s:e],
                tp_rank * weight.shape[0], ctx.vocab_chunk_size, grad_w,
            )
            if want_h:
                grad_h.index_copy_(0, idx[s:e], grad_h_c)
        if want_h and tp_size > 1 and ctx.reduce_hidden_grad:
            dist.all_reduce(grad_h, op=dist.ReduceOp.SUM, group=ctx.tp_group)
        grad_h = grad_h.to(hidden.dtype) if want_h else None
        grad_w = grad_w.to(weight.dtype) if want_w else None
        return grad_h, grad_w, None, None, None, None, None, None, None


def _trained_tokens(labels_1d, loss_mask, ignore_index, trained_index=None):
    """Return ``idx [n]`` (positions of trained tokens), their labels ``[n]`` and ``loss_mask`` values ``[n]``.

    With ``trained_index`` given, it is ``idx`` (no ``nonzero()``, a host sync).
    """
    if trained_index is not None:
        idx = trained_index
        labels_n = labels_1d.index_select(0, idx)
    else:
        trained = labels_1d != ignore_index
        if loss_mask is not None:
            trained &= loss_mask.reshape(-1) != 0
        idx = trained.nonzero().squeeze(1)
        labels_n = labels_1d.index_select(0, idx)
    if loss_mask is None:
        scale_n = torch.ones(idx.numel(), dtype=torch.float32, device=labels_1d.device)
    else:
        scale_n = loss_mask.reshape(-1).index_select(0, idx).float()
    return idx, labels_n, scale_n


def fused_linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    loss_mask: torch.Tensor | None = None,
    chunk_size: int = 256,
    reduction: str = "mean",
    tp_group: dist.ProcessGroup | None = None,
    ignore_index: int = IGNORE_INDEX,
    reduce_hidden_grad: bool = True,
    vocab_chunk_size: int = 32768,
    trained_index: torch.Tensor | None = None,
) -> torch.Tensor:
    """Cross-entropy of ``hidden @ weight.T`` against ``labels``, computed chunk by chunk over tokens.

    Equals ``F.cross_entropy(hidden @ weight.T, labels, ignore_index=ignore_index)`` (times ``loss_mask``)
    but never holds the ``[t, v]`` logits. Working memory is one block of fp32 logits,
    ``chunk_size * min(vocab_chunk_size, v_local) * 4`` bytes (32 MiB at the defaults; plus a bf16 copy
    for bf16 inputs), the fp32 weight gradient ``v_local * h * 4`` bytes (which every method produces)
    and ``O(t * h)`` for the hidden gradient. At t=4096, h=1024, v=131072, fp32 on CPU the peak above
    baseline is 0.09x that of ``F.cross_entropy`` on full logits (``docs/loss.md``, ``bench/loss.py``).

    Flow:
      1. Select the trained tokens: ``labels != ignore_index`` and ``loss_mask != 0``. Ignored tokens
         cost no compute and get loss 0 and gradient 0.
      2. Forward, per chunk of ``chunk_size`` trained tokens and per block of ``vocab_chunk_size`` vocab
         rows: fp32 logits ``[c, block]``, folded into a running max and sum of exponentials (online
         log-sum-exp); the target logit is taken from the block (and TP rank) that holds the label. Max,
         then (sum, target) are all-reduced over ``tp_group``; ``lse = max + log(sum)``; token loss
         ``= (lse - target) * loss_mask``. Only ``lse [n]`` is kept for backward.
      3. Backward, same loops: recompute the block's logits, ``p = exp(logits - lse) - onehot(label)``,
         ``grad_hidden += p @ W_block`` and ``grad_W_block += p.T @ (g * hidden)`` with
         ``g = grad_output * loss_mask``, accumulated in fp32 and cast to the input dtypes at the end.
      4. Reduce: ``"none"`` returns the ``[...]`` per-token loss, ``"sum"`` its sum, ``"mean"`` the sum
         divided by the number of trained tokens of this call (0.0, not NaN, when there is none). The
         training loss normalised over the global batch is ``"sum"`` divided by
         :func:`packsft.loss.global_num_trained_tokens`; see :func:`packsft.loss.normalize_loss`.

    Tensor parallelism: ``weight`` is this rank's vocab shard, rows ``[r * v_local, (r + 1) * v_local)``
    of the padded vocabulary for TP rank ``r`` of ``tp_group`` (Megatron's ``VocabParallelEmbedding`` and
    ``ColumnParallelLinear`` layout). The log-sum-exp is vocab-parallel (two all-reduces of ``[c]``
    floats per chunk), so every TP rank gets the same full-vocabulary loss. ``hidden``, ``labels`` and
    ``loss_mask`` must be identical on all TP ranks. The hidden-state gradient is a partial sum per rank;
    **this function all-reduces it over ``tp_group`` itself** (``reduce_hidden_grad=True``), so pass the
    decoder's output directly, NOT through ``copy_to_tensor_model_parallel_region`` (that would sum it
    twice). With sequence parallelism, gather the hidden states with
    ``gather_from_sequence_parallel_region(hidden, tensor_parallel_output_grad=True)`` (its backward
    reduce-scatters the partial sums) and pass ``reduce_hidden_grad=False``.

    Context parallelism: labels and ``loss_mask`` are sliced with the tokens
    (``packsft.layout.cp_partition_indices``), so each CP rank's per-token loss is complete and needs no
    communication here; only the normaliser (number of trained tokens) is reduced over CP, by
    :func:`packsft.loss.global_num_trained_tokens`.

    Data parallelism: use ``reduction="sum"`` and divide by the trained-token count of the whole global
    batch (all micro-batches, DP and CP ranks), so every trained token has the same weight whatever
    micro-batch or rank it lands on.

    Tied embeddings: pass the embedding's ``word_embeddings.weight``; autograd adds this function's
    weight gradient to the embedding's.

    Args:
        hidden: ``[..., h]`` final hidden states (after the final norm), fp32, bf16 or fp16. Megatron's
            ``[s, b, h]`` decoder output can be passed as is (with ``labels.t()``) or flattened to ``[t, h]``.
        weight: ``[v_local, h]`` output-layer weight (``output_layer.weight`` or the tied embedding
            weight), same dtype as ``hidden``.
        labels: ``[...]`` int64 global vocab ids, same leading shape as ``hidden``; ``ignore_index``
            marks untrained positions.
        loss_mask: optional ``[...]`` float; multiplies each token's loss; 0 excludes the token.
        chunk_size: trained tokens per chunk.
        reduction: ``"none"`` (fp32 ``[...]``), ``"sum"`` or ``"mean"`` (fp32 scalars).
        tp_group: tensor-parallel process group; ``None`` (or size 1) for an unsharded weight.
        ignore_index: label value of untrained positions (-100 as in Megatron and torch).
        reduce_hidden_grad: all-reduce the hidden-state gradient over ``tp_group`` (see above).
        vocab_chunk_size: vocab rows per logits block; the block is ``[chunk_size, vocab_chunk_size]``.
        trained_index: optional int64 ``[n]`` positions (into the flattened ``labels``) of the trained tokens,
            already on the device: exactly ``(labels != ignore_index) & (loss_mask != 0)``. The data path knows it
            on the host (``packsft.train.data.model_input``), which spares this call the ``nonzero()``, a
            device-to-host sync.

    Returns:
        fp32 loss: ``[...]`` for ``"none"``, a scalar otherwise.

    The arguments are trusted (the trainer's config and data are checked where they enter): labels int64 in
    ``[0, v_local * tp_size)`` or ``ignore_index``, ``hidden`` and ``weight`` of one dtype, positive chunk sizes.
    """
    assert reduction in _REDUCTIONS and labels.shape == hidden.shape[:-1], (reduction, labels.shape, hidden.shape)
    idx, labels_n, scale_n = _trained_tokens(labels.reshape(-1), loss_mask, ignore_index, trained_index)
    loss = FusedLinearCrossEntropyFunction.apply(
        hidden.reshape(-1, hidden.shape[-1]), weight, idx, labels_n, scale_n, chunk_size, vocab_chunk_size,
        tp_group, reduce_hidden_grad,
    )
    if reduction == "none":
        return loss.reshape(labels.shape)
    if reduction == "sum":
        return loss.sum()
    return loss.sum() / max(idx.numel(), 1)
