"""Global loss normalisation over the whole global batch: per trained token, or per conversation.

``token`` (the default): the training loss of one optimizer step is
``sum over trained tokens of token loss / number of trained tokens in the global batch``, where the
global batch is every micro-batch of the step on every DP and CP rank. Each micro-batch therefore
contributes ``loss_sum / global_count`` (torchtitan ``train_step``'s ``global_valid_tokens``; Megatron's
``calculate_per_token_loss``), and a micro-batch without a trained token contributes exactly 0.

``conversation``: each conversation's mean token loss over its own trained tokens, averaged over the
conversations of the global batch that train at least one token. Every trained token of conversation ``c``
carries the weight ``1 / n_c`` (:func:`conversation_weights`, computed on the whole row before CP slicing), so
a micro-batch contributes ``sum(weight * token loss) / global conversations``
(:func:`global_num_trained_conversations`): the same sum, whatever rows, micro-batches and DP/CP ranks the
conversations land in.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
import torch.distributed as dist

from packsft.layout import IGNORE_INDEX


def _as_list(x: torch.Tensor | Iterable[torch.Tensor] | None) -> list[torch.Tensor] | None:
    if x is None or isinstance(x, torch.Tensor):
        return None if x is None else [x]
    return list(x)


def num_trained_tokens(
    loss_mask: torch.Tensor | Iterable[torch.Tensor],
    labels: torch.Tensor | Iterable[torch.Tensor] | None = None,
    ignore_index: int = IGNORE_INDEX,
) -> torch.Tensor:
    """Count this rank's trained tokens: positions with ``loss_mask != 0`` (and ``labels != ignore_index``).

    Args:
        loss_mask: ``[...]`` float (any shape), or a sequence of them, one per micro-batch of the step.
        labels: optional int64 tensors of the same shapes; positions equal to ``ignore_index`` are not
            counted even where ``loss_mask`` is non-zero (the same rule as
            :func:`packsft.loss.fused_linear_cross_entropy`).
        ignore_index: label value of untrained positions.

    Returns:
        int64 scalar tensor on the device of the first ``loss_mask`` (0 for an empty sequence on CPU).
    """
    masks = _as_list(loss_mask)
    label_list = _as_list(labels)
    device = masks[0].device if masks else torch.device("cpu")
    total = torch.zeros((), dtype=torch.int64, device=device)
    for i, mask in enumerate(masks):
        trained = mask != 0
        if label_list is not None:
            trained &= label_list[i] != ignore_index
        total += trained.sum()
    return total


def global_num_trained_tokens(
    loss_mask: torch.Tensor | Iterable[torch.Tensor],
    groups: Sequence[dist.ProcessGroup | None] | None = None,
    labels: torch.Tensor | Iterable[torch.Tensor] | None = None,
    ignore_index: int = IGNORE_INDEX,
) -> torch.Tensor:
    """Trained tokens of the global batch: the local count all-reduced (SUM) over each group in turn.

    Pass groups that together cover every rank holding different tokens exactly once: ``(dp_cp_group,)``
    (Megatron's ``get_data_parallel_group(with_context_parallel=True)``) or ``(dp_group, cp_group)``.
    Never pass overlapping groups (``dp_cp`` and ``cp``: CP would be counted twice), nor the TP group
    (TP ranks hold the same tokens). ``None`` or ``()`` means a single process; ``None`` entries are
    skipped. Every rank must call this (it is a collective when groups are given).

    Args:
        loss_mask: ``[...]`` float, or a sequence of them (the micro-batches of this step on this rank).
        groups: process groups to sum over, in order.
        labels: optional, see :func:`num_trained_tokens`.
        ignore_index: label value of untrained positions.

    Returns:
        int64 scalar tensor, identical on all ranks of the groups.
    """
    total = num_trained_tokens(loss_mask, labels, ignore_index)
    for group in groups or ():
        if group is not None:
            dist.all_reduce(total, op=dist.ReduceOp.SUM, group=group)
    return total


def conversation_weights(
    loss_mask: torch.Tensor,
    labels: torch.Tensor,
    segment_offsets: torch.Tensor,
    ignore_index: int = IGNORE_INDEX,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token weights of the ``conversation`` normalisation of one packed sequence, and its conversation count.

    Conversation ``k`` is the segment ``[segment_offsets[k], segment_offsets[k + 1])`` (positions past the last
    offset belong to the last segment: tail padding). ``n_k`` is its trained tokens (``loss_mask != 0`` and
    ``labels != ignore_index``, as :func:`num_trained_tokens`). Pass the whole sequence, before CP slicing, so a
    conversation cut over CP ranks keeps one ``n_k``; slice the weights like ``loss_mask``.

    Args:
        loss_mask: float ``[T]`` or ``[1, T]``.
        labels: int64, the same shape.
        segment_offsets: integer ``[n + 1]``, increasing segment offsets from 0 (``cu_seqlens_padded``).
        ignore_index: label value of untrained positions.

    Returns:
        ``(weights, conversations)``: fp32 of ``loss_mask``'s shape, ``1 / n_k`` (correctly rounded) at each
        trained position of conversation ``k`` and 0 elsewhere; int64 scalar, the segments with ``n_k > 0``.
        Both on ``loss_mask``'s device, computed without a host read.
    """
    trained = ((loss_mask != 0) & (labels != ignore_index)).reshape(-1)
    offsets = segment_offsets.reshape(-1).to(device=trained.device, dtype=torch.int64)
    last = offsets.numel() - 2
    positions = torch.arange(trained.numel(), device=trained.device)
    segment = torch.searchsorted(offsets[1:].contiguous(), positions, right=True).clamp_(max=last)
    counts = torch.zeros(last + 1, dtype=torch.int64, device=trained.device).index_add_(
        0, segment, trained.to(torch.int64))
    inverse = 1.0 / counts.clamp(min=1).to(torch.float64)
    weights = torch.where(trained, inverse[segment], 0.0).to(torch.float32)
    return weights.reshape(loss_mask.shape), (counts > 0).sum()


def global_num_trained_conversations(
    conversations: torch.Tensor | Iterable[torch.Tensor],
    groups: Sequence[dist.ProcessGroup | None] | None = None,
) -> torch.Tensor:
    """Conversations of the global batch that train a token: this rank's counts summed, then all-reduced (SUM).

    Every conversation must be counted on exactly one rank of ``groups`` (under CP: one rank per CP group counts
    its rows' conversations, the others pass 0); ``groups`` as :func:`global_num_trained_tokens`.

    Args:
        conversations: int64 scalar, or a sequence of them (one per micro-batch of this step on this rank), from
            :func:`conversation_weights`.
        groups: process groups to sum over, in order.

    Returns:
        int64 scalar tensor, identical on all ranks of the groups (0 for an empty sequence, on CPU).
    """
    counts = _as_list(conversations)
    total = torch.zeros((), dtype=torch.int64, device=counts[0].device if counts else torch.device("cpu"))
    for count in counts:
        total += count
    for group in groups or ():
        if group is not None:
            dist.all_reduce(total, op=dist.ReduceOp.SUM, group=group)
    return total


def normalize_loss(
    loss_sum: torch.Tensor, num_trained_tokens: torch.Tensor | int, gradient_average_size: int = 1
) -> torch.Tensor:
    """Return this micro-batch's share of the global-batch mean loss: ``loss_sum * k / max(count, 1)``.

    Summing the returned values over all micro-batches and ranks gives the global-batch mean token loss (with
    ``loss_sum`` weighted by :func:`conversation_weights` and ``count`` the global conversations: the mean
    conversation loss).
    A micro-batch with no trained token has ``loss_sum == 0`` (with zero gradients), so it
    contributes exactly 0; a global batch with no trained token gives 0.0, not NaN.

    ``k = gradient_average_size`` undoes a gradient reduction that averages instead of summing: torch
    ``DistributedDataParallel`` and Megatron DDP (without ``calculate_per_token_loss``) divide the summed
    gradients by the size of the data-parallel(-with-CP) group, so pass that size there; pass 1 when the
    gradient reduction sums. The value to log is then ``returned / k`` summed over micro-batches, all-reduced.

    Args:
        loss_sum: fp32 scalar, ``fused_linear_cross_entropy(..., reduction="sum")`` of one micro-batch.
        num_trained_tokens: trained tokens of the global batch, from :func:`global_num_trained_tokens`.
        gradient_average_size: the divisor applied by the gradient reduction (1 when it sums).

    Returns:
        fp32 scalar with the autograd graph of ``loss_sum``.
    """
    count = torch.as_tensor(num_trained_tokens, device=loss_sum.device)
    return loss_sum * gradient_average_size / count.clamp(min=1).to(loss_sum.dtype)
