"""One packed row as tensors: Megatron-LM ``SFTDataset`` semantics with packsft's boundary policy.

Shape legend: ``L`` = ``max_seq_len`` (tokens per row), ``n`` = number of segments (conversations kept in
the row; each segment is one conversation plus its CP padding, the last one also holds the tail padding).

Conversations are concatenated with positions restarting at 0, each padded to
:func:`packsft.layout.conversation_cost` tokens (the packer's cost); the row stops at exactly ``L`` or is
right-truncated to ``L`` plus one pad, or padded to ``L + 1``; then shifted once
(``tokens = toks[:-1]``, ``labels = tgts[1:]``). No label crosses from one conversation into the next, and
``labels`` is ``IGNORE_INDEX`` wherever ``loss_mask`` is 0. Source: Megatron-LM
``megatron/training/datasets/sft_dataset.py`` (``SFTDataset.__getitem__``); the step-by-step construction and
every difference from Megatron-LM: ``docs/loader.md``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from packsft.layout import IGNORE_INDEX, conversation_cost


@dataclass(frozen=True)
class RowTruncation:
    """What right-truncation removed from a row whose conversations need more than ``max_seq_len`` tokens.

    Attributes:
        needed_tokens: tokens the row's conversations occupy with CP padding (sum of their costs).
        max_seq_len: the row length ``L``.
        cut_conversation: index (0-based, in the row) of the conversation cut at ``L``, or ``None`` when the
            row was exactly full and only later conversations were dropped.
        cut_conversation_tokens: that conversation's length in tokens (0 when ``cut_conversation`` is None).
        kept_tokens: how many of its tokens stayed in the row.
        dropped_conversations: indices of conversations that start at or after ``L`` and were dropped whole.
    """

    needed_tokens: int
    max_seq_len: int
    cut_conversation: int | None
    cut_conversation_tokens: int
    kept_tokens: int
    dropped_conversations: tuple[int, ...]

    def describe(self) -> str:
        """One sentence for the warning: lengths and what was cut or dropped."""
        parts = [f"its conversations need {self.needed_tokens} tokens but max_seq_len is {self.max_seq_len}"]
        if self.cut_conversation is not None:
            cut = self.cut_conversation_tokens - self.kept_tokens
            parts.append(f"conversation {self.cut_conversation} ({self.cut_conversation_tokens} tokens) was cut "
                         f"after {self.kept_tokens} tokens ({cut} removed)")
        if self.dropped_conversations:
            parts.append(f"conversation(s) {list(self.dropped_conversations)} were dropped")
        return "; ".join(parts)


def _layout(tokens, targets, lengths: np.ndarray, pad_id: int, max_seq_len: int, context_parallel_size: int):
    """Steps 1-2 on the concatenated conversations: the ``L + 1`` long int64 token/target/position arrays,
    segment offsets, real lengths and the truncation record (see :func:`build_row_flat`)."""
    L = max_seq_len
    costs = conversation_cost(lengths, context_parallel_size)
    ends = np.cumsum(costs)
    starts = ends - costs
    kept = int(np.searchsorted(starts, L, side="left"))  # conversations starting before L
    stored = np.minimum(lengths, L)
    offsets = np.cumsum(stored) - stored  # where each conversation starts in `tokens`
    real = np.minimum(lengths[:kept], L - starts[:kept])
    toks = np.full(L + 1, pad_id, dtype=np.int64)
    tgts = np.full(L + 1, pad_id, dtype=np.int64)
    used = int(offsets[kept - 1] + real[-1])  # the kept conversations' tokens: a prefix of `tokens`
    if context_parallel_size == 1:  # no padding between conversations: one copy
        toks[:used] = tokens[:used]
        tgts[:used] = targets[:used]
    else:
        where = np.arange(used) + np.repeat(starts[:kept] - offsets[:kept], real)
        toks[where] = tokens[:used]
        tgts[where] = targets[:used]
    cu = np.append(starts[:kept], L)
    segment = np.diff(cu)
    segment[-1] += 1  # the extra position for the shift belongs to the last segment
    pos = np.arange(L + 1, dtype=np.int64) - np.repeat(starts[:kept], segment)
    truncation = None
    if ends[kept - 1] > L or kept < len(lengths):
        cut = kept - 1 if ends[kept - 1] > L else None
        truncation = RowTruncation(
            needed_tokens=int(ends[-1]), max_seq_len=L, cut_conversation=cut,
            cut_conversation_tokens=int(lengths[cut]) if cut is not None else 0,
            kept_tokens=int(real[cut]) if cut is not None else 0,
            dropped_conversations=tuple(range(kept, len(lengths))))
    return toks, tgts, pos, cu, real, truncation


def build_row(
    conversations: Sequence[tuple[Sequence[int], Sequence[int]]],
    pad_id: int,
    max_seq_len: int,
    context_parallel_size: int = 1,
) -> tuple[dict, RowTruncation | None]:
    """Build one row's tensors from its conversations' ``(tokens, targets)`` (see the module docstring).

    Concatenates them and calls :func:`build_row_flat`, which the token cache feeds directly.

    Args:
        conversations: per conversation, ``(tokens, targets)``: equally long, non-empty int lists from
            :func:`packsft.prompt_formats.tokenize_conversation` (targets hold ``IGNORE_INDEX`` = -100
            where not trained). At least one conversation.
        pad_id: the prompt format's pad token id (CP and tail padding; never trained).
        max_seq_len: ``L``, a positive multiple of ``2 * context_parallel_size`` when CP > 1 (unchecked).
        context_parallel_size: CP size; conversations are padded to a multiple of ``2 * cp`` when > 1.

    Returns:
        ``(row, truncation)``. ``row`` holds ``tokens``, ``labels``, ``position_ids`` (int64 ``[L]``),
        ``loss_mask`` (float32 ``[L]``, 1.0 = trained), ``cu_seqlens`` (int32 ``[n + 1]``, cumulative *real*
        conversation lengths, CP and tail padding excluded), ``cu_seqlens_padded`` (int32 ``[n + 1]``,
        segment offsets in the row from 0 to ``L``, padding included: TransformerEngine's THD convention),
        ``max_seqlen`` (int, longest real conversation in tokens) and ``num_trained_tokens`` (int,
        ``loss_mask.sum()``). At cp=1 the two offsets differ only in the last entry (the tail padding).
        ``truncation`` is ``None`` when every conversation fit whole, else a
        :class:`RowTruncation`.

    Raises:
        ValueError: tokens and targets of unequal length (:func:`build_row_flat`). ``max_seq_len`` is not checked
            here (per row); callers check it once with :func:`packsft.layout.check_max_seq_len`.

    Example (``cp = 1``, ``L = 6``, pad 0, conversations ``([5, 6, 7], [-100, 6, 7])`` and ``([8, 9], [8, 9])``):
    ``toks = [5, 6, 7, 8, 9, 0, 0]``, ``tgts = [-100, 6, 7, 8, 9, 0, 0]`` ->
    ``tokens = [5, 6, 7, 8, 9, 0]``, ``labels = [6, 7, -100, 9, -100, -100]`` (the 8 at position 2 is the
    next conversation's first token: masked by the boundary policy; Megatron-LM would train it),
    ``loss_mask = [1, 1, 0, 1, 0, 0]``, ``position_ids = [0, 1, 2, 0, 1, 2]``, ``cu_seqlens = [0, 3, 5]``,
    ``cu_seqlens_padded = [0, 3, 6]``, ``max_seqlen = 3``.
    """
    lengths = np.asarray([len(t) for t, _ in conversations], dtype=np.int64)
    tokens = np.concatenate([np.asarray(t[:max_seq_len], dtype=np.int64) for t, _ in conversations])
    targets = np.concatenate([np.asarray(t[:max_seq_len], dtype=np.int64) for _, t in conversations])
    return build_row_flat(tokens, targets, lengths, pad_id, max_seq_len, context_parallel_size)


def build_row_flat(
    tokens: np.ndarray,
    targets: np.ndarray,
    lengths: np.ndarray,
    pad_id: int,
    max_seq_len: int,
    context_parallel_size: int = 1,
) -> tuple[dict, RowTruncation | None]:
    """:func:`build_row` on concatenated conversations, each stored cut at ``L`` tokens (the token cache's form).

    Args:
        tokens, targets: int ``[T]`` arrays: conversation ``k``'s first ``min(lengths[k], L)`` token ids and
            targets, the conversations one after another (int32 views of :mod:`packsft.token_cache`, or the
            concatenated lists of :func:`build_row`).
        lengths: int ``[n]``, ``n >= 1``, each conversation's full length in tokens (``>= 1``: a packed row splits
            into at least one conversation, and a conversation tokenizes to at least one token): costs,
            ``cu_seqlens`` and the truncation record use it, so the row is that of the whole conversations.
        pad_id, max_seq_len, context_parallel_size: as :func:`build_row`.

    Returns:
        As :func:`build_row`.

    Raises:
        ValueError: ``T`` is not ``sum(min(lengths, L))`` (a token cache whose index disagrees with its tokens).
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    expected = int(np.minimum(lengths, max_seq_len).sum())
    if len(tokens) != expected or len(targets) != expected:
        raise ValueError(f"tokens ({len(tokens)}) and targets ({len(targets)}) must hold the first "
                         f"min(length, max_seq_len) tokens of each conversation: {expected}")
    toks, tgts, pos, cu, real, truncation = _layout(tokens, targets, lengths, pad_id, max_seq_len,
                                                    context_parallel_size)
    labels = tgts[1:]
    labels[cu[1:-1] - 1] = IGNORE_INDEX  # boundary policy: no label crosses a conversation
    trained = (labels != IGNORE_INDEX) & (labels != pad_id)
    labels[~trained] = IGNORE_INDEX
    cu_seqlens = np.zeros(len(real) + 1, dtype=np.int32)
    np.cumsum(real, out=cu_seqlens[1:])
    row = {
        "tokens": torch.from_numpy(toks[:-1]),
        "labels": torch.from_numpy(labels),
        "loss_mask": torch.from_numpy(trained.astype(np.float32)),
        "position_ids": torch.from_numpy(pos[:-1]),
        "cu_seqlens": torch.from_numpy(cu_seqlens),
        "cu_seqlens_padded": torch.from_numpy(cu.astype(np.int32)),
        "max_seqlen": int(real.max()),
        "num_trained_tokens": int(trained.sum()),
    }
    return row, truncation
