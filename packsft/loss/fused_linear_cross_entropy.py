"""Chunked fused linear cross-entropy: the LM-head loss without a ``[t, v]`` logits tensor.

Shape legend: ``t`` = tokens of the micro-batch (packed THD rows flattened, or Megatron's ``[s, b]``
flattened), ``h`` = hidden size, ``v`` = vocabulary size, ``v_local = v / tp`` = this rank's vocab
shard, ``c`` = ``chunk_size`` (tokens per chunk), ``n`` = trained tokens (label not ignored and
``loss_mask`` non-zero).

Reference: DESIGN section 7; memory figures measured in ``shared/notes/megatron_core_on_cpu.md`` section 7
and ``docs/loss.md``. The vocab-parallel log-sum-exp follows Megatron-Core's
``tensor_parallel/cross_entropy.py`` (``VocabParallelCrossEntropy``): max all-reduced, then the sum of
exponentials and the target logit all-reduced, over the tensor-parallel group.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

_REDUCTIONS = ("none", "sum", "mean")


def _tp_size_rank(tp_group: dist.ProcessGroup | None) -> tuple[int, int]:
    if tp_group is None:
        return 1, 0
    return dist.get_world_size(group=tp_group), dist.get_rank(group=tp_group)


def _chunk_logits_fp32(hidden_c: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Return ``hidden_c [c, h] @ weight.T`` as fp32 ``[c, v_local]``.

    fp32 inputs give fp32 logits directly. bf16/fp16 inputs run the matmul in their own dtype (fp32
    accumulation inside the GEMM, result rounded once to the input dtype, as Megatron's output layer does)
    and are then upcast, so softmax, log-sum-exp and gradients are computed in fp32.
    """
    logits = hidden_c @ weight.t()
    return logits if logits.dtype == torch.float32 else logits.float()


def _target_index(labels_c: torch.Tensor, vocab_start: int, v_local: int) -> tuple[torch.Tensor, ...]:
    """Map global label ids ``[c]`` to (local column ``[c]`` int64, owned-by-this-rank ``[c]`` fp32)."""
    local = labels_c - vocab_start
    owned = (local >= 0) & (local < v_local)
    return local.clamp(0, v_local - 1), owned.float()


class FusedLinearCrossEntropyFunction(torch.autograd.Function):
    """Autograd function behind :func:`fused_linear_cross_entropy`; returns fp32 per-token loss ``[t]``.

    Inputs are already flattened and validated by :func:`fused_linear_cross_entropy`:
    ``hidden [t, h]``, ``weight [v_local, h]``, ``idx [n]`` int64 (positions of trained tokens),
    ``labels_n [n]`` int64 (global vocab ids), ``scale_n [n]`` fp32 (the ``loss_mask`` value, 1.0
    without one), ``chunk_size``, ``tp_group``, ``reduce_hidden_grad``.
    Saved for backward: ``hidden``, ``weight`` (references, no copies), ``idx``, ``labels_n``,
    ``scale_n`` and ``lse [n]`` fp32; nothing of size ``v``.
    """

    @staticmethod
    def forward(ctx, hidden, weight, idx, labels_n, scale_n, chunk_size, tp_group, reduce_hidden_grad):
        """Per chunk: ``scale * (logsumexp(logits) - logits[label])`` for the ``n`` trained tokens."""
        tp_size, tp_rank = _tp_size_rank(tp_group)
        v_local = weight.shape[0]
        n = idx.numel()
        lse = torch.empty(n, dtype=torch.float32, device=hidden.device)
        target = torch.empty(n, dtype=torch.float32, device=hidden.device)
        for s in range(0, n, chunk_size):
            e = min(s + chunk_size, n)
            logits = _chunk_logits_fp32(hidden.index_select(0, idx[s:e]), weight)  # [c, v_local] fp32
            col, owned = _target_index(labels_n[s:e], tp_rank * v_local, v_local)
            tgt = logits.gather(1, col[:, None]).squeeze(1).mul_(owned)
            row_max = logits.max(dim=1).values
            if tp_size > 1:
                dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=tp_group)
            sum_exp = logits.sub_(row_max[:, None]).exp_().sum(dim=1)  # in place: no second [c, v] buffer
            if tp_size > 1:
                both = torch.stack((sum_exp, tgt))
                dist.all_reduce(both, op=dist.ReduceOp.SUM, group=tp_group)
                sum_exp, tgt = both[0], both[1]
            lse[s:e] = row_max + sum_exp.log()
            target[s:e] = tgt
            del logits
        loss = torch.zeros(hidden.shape[0], dtype=torch.float32, device=hidden.device)
        loss.index_copy_(0, idx, (lse - target) * scale_n)
        ctx.save_for_backward(hidden, weight, idx, labels_n, scale_n, lse)
        ctx.chunk_size, ctx.tp_group, ctx.reduce_hidden_grad = chunk_size, tp_group, reduce_hidden_grad
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        """Recompute each chunk's softmax; ``d loss_i / d logits_i = g_i * (softmax_i - onehot(label_i))``."""
        hidden, weight, idx, labels_n, scale_n, lse = ctx.saved_tensors
        want_h, want_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        tp_size, tp_rank = _tp_size_rank(ctx.tp_group)
        v_local = weight.shape[0]
        g = grad_loss.float().index_select(0, idx) * scale_n  # [n] fp32
        grad_h = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device) if want_h else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if want_w else None
        for s in range(0, idx.numel(), ctx.chunk_size):
            e = min(s + ctx.chunk_size, idx.numel())
            hidden_c = hidden.index_select(0, idx[s:e])  # [c, h]
            probs = _chunk_logits_fp32(hidden_c, weight)
            probs.sub_(lse[s:e, None]).exp_()  # softmax over the full (all-rank) vocabulary
            col, owned = _target_index(labels_n[s:e], tp_rank * v_local, v_local)
            probs[torch.arange(e - s, device=probs.device), col] -= owned  # softmax - onehot, [c, v_local]
            g_c = g[s:e, None]
            if want_h:  # g_i scales row i; applied to [c, h] instead of [c, v_local]
                gh = (probs if weight.dtype == torch.float32 else probs.to(weight.dtype)) @ weight
                grad_h.index_copy_(0, idx[s:e], gh.float().mul_(g_c))
            if want_w:
                grad_w.addmm_(probs.t(), hidden_c.float().mul_(g_c))
            del probs
        if want_h and tp_size > 1 and ctx.reduce_hidden_grad:
            dist.all_reduce(grad_h, op=dist.ReduceOp.SUM, group=ctx.tp_group)
        grad_h = grad_h.to(hidden.dtype) if want_h else None
        grad_w = grad_w.to(weight.dtype) if want_w else None
        return grad_h, grad_w, None, None, None, None, None, None


def _validate(hidden, weight, labels, loss_mask, chunk_size, reduction) -> None:
    if reduction not in _REDUCTIONS:
        raise ValueError(f"reduction must be one of {_REDUCTIONS}, got {reduction!r}")
    if not isinstance(chunk_size, int) or chunk_size <= 0:
        raise ValueError(f"chunk_size must be a positive int (tokens per chunk), got {chunk_size!r}")
    if weight.dim() != 2 or hidden.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"weight must be [v_local, h] with h = hidden.shape[-1]; got weight {tuple(weight.shape)}, "
            f"hidden {tuple(hidden.shape)}"
        )
    if labels.shape != hidden.shape[:-1]:
        raise ValueError(
            f"labels shape {tuple(labels.shape)} must equal hidden's leading shape "
            f"{tuple(hidden.shape[:-1])} "
            "(Megatron labels are [b, s]: pass labels.t() with hidden [s, b, h])"
        )
    if labels.dtype != torch.int64:
        raise TypeError(f"labels must be int64, got {labels.dtype}")
    if loss_mask is not None and loss_mask.shape != labels.shape:
        raise ValueError(
            f"loss_mask shape {tuple(loss_mask.shape)} must equal labels shape {tuple(labels.shape)}"
        )
    if hidden.dtype != weight.dtype:
        raise TypeError(f"hidden ({hidden.dtype}) and weight ({weight.dtype}) must have the same dtype")


def fused_linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    loss_mask: torch.Tensor | None = None,
    chunk_size: int = 256,
    reduction: str = "mean",
    tp_group: dist.ProcessGroup | None = None,
    ignore_index: int = -100,
    reduce_hidden_grad: bool = True,
) -> torch.Tensor:
    """Cross-entropy of ``hidden @ weight.T`` against ``labels``, computed chunk by chunk over tokens.

    Equals ``F.cross_entropy(hidden @ weight.T, labels, ignore_index=ignore_index)`` (times ``loss_mask``)
    but never holds the ``[t, v]`` logits: peak extra memory is one chunk's fp32 logits,
    ``chunk_size * v_local * 4`` bytes (plus one bf16 copy of it for bf16 inputs), an fp32 weight
    gradient ``v_local * h * 4`` bytes in backward and ``O(t * h)`` for the hidden gradient. At
    t=4096, h=1024, v=128256, fp32 that is 683 MiB peak above baseline against 8049 MiB for
    ``F.cross_entropy`` on full logits (measured, ``docs/loss.md``).

    Flow:
      1. Select the trained tokens: ``labels != ignore_index`` and ``loss_mask != 0``. Ignored tokens
         cost no compute and get loss 0 and gradient 0.
      2. Forward, per chunk of ``chunk_size`` trained tokens: fp32 logits ``[c, v_local]``; row max,
         all-reduced (MAX) over ``tp_group``; ``exp(logits - max)`` summed and, with the target logit
         taken on the rank whose shard holds the label, all-reduced (SUM); ``lse = max + log(sum)``;
         token loss ``= (lse - target) * loss_mask``. The chunk's logits are dropped; only ``lse [n]``
         is kept.
      3. Backward, per chunk: recompute the logits, ``softmax = exp(logits - lse)``, subtract 1 at the
         label, scale row ``i`` by ``grad_output_i * loss_mask_i``; ``grad_hidden = p @ weight`` and
         ``grad_weight += p.T @ hidden`` accumulated in fp32, cast to the parameter dtype at the end.
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

    Context parallelism: labels and ``loss_mask`` are sliced with the tokens (DESIGN section 6), so each
    CP rank's per-token loss is complete and needs no communication here; only the normaliser (number of
    trained tokens) is reduced over CP, by :func:`packsft.loss.global_num_trained_tokens`.

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
        chunk_size: trained tokens per chunk; memory grows and per-chunk overhead shrinks with it.
        reduction: ``"none"`` (fp32 ``[...]``), ``"sum"`` or ``"mean"`` (fp32 scalars).
        tp_group: tensor-parallel process group; ``None`` (or size 1) for an unsharded weight.
        ignore_index: label value of untrained positions (-100 as in Megatron and torch).
        reduce_hidden_grad: all-reduce the hidden-state gradient over ``tp_group`` (see above).

    Returns:
        fp32 loss: ``[...]`` for ``"none"``, a scalar otherwise.

    Raises:
        ValueError: unknown ``reduction``, non-positive ``chunk_size``, mismatched shapes, or a trained
            label outside ``[0, v_local * tp_size)``.
        TypeError: labels not int64, or ``hidden`` and ``weight`` of different dtypes.
    """
    _validate(hidden, weight, labels, loss_mask, chunk_size, reduction)
    lead_shape = labels.shape
    hidden_2d, labels_1d = hidden.reshape(-1, hidden.shape[-1]), labels.reshape(-1)
    trained = labels_1d != ignore_index
    if loss_mask is not None:
        trained &= loss_mask.reshape(-1) != 0
    idx = trained.nonzero().squeeze(1)
    labels_n = labels_1d.index_select(0, idx)
    v_total = weight.shape[0] * _tp_size_rank(tp_group)[0]
    if idx.numel() and not bool(((labels_n >= 0) & (labels_n < v_total)).all()):
        bad = labels_n[(labels_n < 0) | (labels_n >= v_total)][:5].tolist()
        raise ValueError(f"labels {bad} are outside the vocabulary [0, {v_total}) and not ignore_index")
    if loss_mask is None:
        scale_n = torch.ones(idx.numel(), dtype=torch.float32, device=hidden.device)
    else:
        scale_n = loss_mask.reshape(-1).index_select(0, idx).float()
    loss = FusedLinearCrossEntropyFunction.apply(
        hidden_2d, weight, idx, labels_n, scale_n, chunk_size, tp_group, reduce_hidden_grad
    )
    if reduction == "none":
        return loss.reshape(lead_shape)
    if reduction == "sum":
        return loss.sum()
    return loss.sum() / max(idx.numel(), 1)


class FusedLinearCrossEntropy(nn.Module):
    """Module form of :func:`fused_linear_cross_entropy`, holding its settings.

    ``forward(hidden [..., h], weight [v_local, h], labels [...] int64, loss_mask=None | [...] float)``
    returns the fp32 loss of the configured ``reduction``. The module owns no parameters: the output
    weight stays with the model (``output_layer.weight`` or the tied embedding), so checkpoints and
    Megatron's ``sharded_state_dict`` are unchanged.

    Args:
        chunk_size: trained tokens per chunk (default 256).
        reduction: ``"none"``, ``"sum"`` or ``"mean"``.
        tp_group: tensor-parallel process group or ``None``.
        ignore_index: label value of untrained positions.
        reduce_hidden_grad: see :func:`fused_linear_cross_entropy`.

    Raises:
        ValueError: unknown ``reduction`` or non-positive ``chunk_size`` (at construction).
    """

    def __init__(
        self,
        chunk_size: int = 256,
        reduction: str = "mean",
        tp_group: dist.ProcessGroup | None = None,
        ignore_index: int = -100,
        reduce_hidden_grad: bool = True,
    ):
        super().__init__()
        if reduction not in _REDUCTIONS:
            raise ValueError(f"reduction must be one of {_REDUCTIONS}, got {reduction!r}")
        if not isinstance(chunk_size, int) or chunk_size <= 0:
            raise ValueError(f"chunk_size must be a positive int (tokens per chunk), got {chunk_size!r}")
        self.chunk_size, self.reduction, self.tp_group = chunk_size, reduction, tp_group
        self.ignore_index, self.reduce_hidden_grad = ignore_index, reduce_hidden_grad

    def forward(self, hidden, weight, labels, loss_mask=None):
        """See :func:`fused_linear_cross_entropy`."""
        return fused_linear_cross_entropy(
            hidden, weight, labels, loss_mask, chunk_size=self.chunk_size, reduction=self.reduction,
            tp_group=self.tp_group, ignore_index=self.ignore_index,
            reduce_hidden_grad=self.reduce_hidden_grad,
        )

    def extra_repr(self) -> str:
        """Settings shown by ``print(module)``."""
        return f"chunk_size={self.chunk_size}, reduction={self.reduction!r}, ignore_index={self.ignore_index}"
