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


def _layout(conversations, pad_id: int, max_seq_len: int, context_parallel_size: int, lengths):
    """Steps 1-2: the ``L + 1`` long token/target/position arrays (int64), segment offsets, real lengths and the
    truncation record."""
    if lengths is None:
        lengths = [len(t) for t, _ in conversations]
    elif len(lengths) != len(conversations):
        raise ValueError(f"{len(lengths)} lengths for {len(conversations)} conversations")
    for k, (tokens, targets) in enumerate(conversations):
        if len(tokens) != len(targets) or not len(tokens):
            raise ValueError(f"conversation {k}: tokens ({len(tokens)}) and targets ({len(targets)}) must be "
                             "equally long and non-empty")
        if len(tokens) > lengths[k]:
            raise ValueError(f"conversation {k}: {len(tokens)} tokens given for a length of {lengths[k]}")
    costs = [conversation_cost(int(n), context_parallel_size) for n in lengths]
    starts: list[int] = []
    end = 0
    for cost in costs:
        if end >= max_seq_len:
            break
        starts.append(end)
        end += cost
    kept = len(starts)
    toks = np.full(max_seq_len + 1, pad_id, dtype=np.int64)
    tgts = np.full(max_seq_len + 1, pad_id, dtype=np.int64)
    real = []
    for k, start in enumerate(starts):
        n = min(int(lengths[k]), max_seq_len - start)
        tokens, targets = conversations[k]
        if len(tokens) < n:
            raise ValueError(f"conversation {k}: {len(tokens)} tokens given, the row needs its first {n}")
        toks[start:start + n] = tokens[:n]
        tgts[start:start + n] = targets[:n]
        real.append(n)
    cu = starts + [max_seq_len]
    segment = np.diff(cu)
    segment[-1] += 1  # the extra position for the shift belongs to the last segment
    pos = np.arange(max_seq_len + 1, dtype=np.int64) - np.repeat(np.asarray(starts, dtype=np.int64), segment)
    truncation = None
    if end > max_seq_len or kept < len(conversations):
        cut = kept - 1 if end > max_seq_len else None
        truncation = RowTruncation(
            needed_tokens=sum(costs), max_seq_len=max_seq_len, cut_conversation=cut,
            cut_conversation_tokens=int(lengths[cut]) if cut is not None else 0,
            kept_tokens=real[cut] if cut is not None else 0,
            dropped_conversations=tuple(range(kept, len(conversations))))
    return toks, tgts, pos, cu, real, truncation


def build_row(
    conversations: Sequence[tuple[Sequence[int], Sequence[int]]],
    pad_id: int,
    max_seq_len: int,
    context_parallel_size: int = 1,
    lengths: Sequence[int] | None = None,
) -> tuple[dict, RowTruncation | None]:
    """Build one row's tensors from its conversations' ``(tokens, targets)`` (see the module docstring).

    Args:
        conversations: per conversation, ``(tokens, targets)``: equally long, non-empty int sequences (lists
            from :func:`packsft.prompt_formats.tokenize_conversation`, or int32 arrays from the token cache,
            :mod:`packsft.token_cache`); targets hold ``IGNORE_INDEX`` = -100 where not trained. At least one.
        pad_id: the prompt format's pad token id (CP and tail padding; never trained).
        max_seq_len: ``L``, a positive multiple of ``2 * context_parallel_size`` when CP > 1 (unchecked).
        context_parallel_size: CP size; conversations are padded to a multiple of ``2 * cp`` when > 1.
        lengths: each conversation's full length in tokens, when ``tokens`` hold only a prefix of it (the token
            cache stores at most ``L`` tokens of a conversation); default ``len(tokens)``. The prefix must
            cover what the row keeps; costs, ``cu_seqlens`` and the truncation record use the full length, so
            the result is that of the whole conversation.

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
        ValueError: no conversation; a conversation with unequal or empty tokens/targets, or shorter than the
            row keeps of its ``lengths``. ``max_seq_len`` is
            not checked here (per row); callers check it once with :func:`packsft.layout.check_max_seq_len`.

    Example (``cp = 1``, ``L = 6``, pad 0, conversations ``([5, 6, 7], [-100, 6, 7])`` and ``([8, 9], [8, 9])``):
    ``toks = [5, 6, 7, 8, 9, 0, 0]``, ``tgts = [-100, 6, 7, 8, 9, 0, 0]`` ->
    ``tokens = [5, 6, 7, 8, 9, 0]``, ``labels = [6, 7, -100, 9, -100, -100]`` (the 8 at position 2 is the
    next conversation's first token: masked by the boundary policy; Megatron-LM would train it),
    ``loss_mask = [1, 1, 0, 1, 0, 0]``, ``position_ids = [0, 1, 2, 0, 1, 2]``, ``cu_seqlens = [0, 3, 5]``,
    ``cu_seqlens_padded = [0, 3, 6]``, ``max_seqlen = 3``.
    """
    if not conversations:
        raise ValueError("a row needs at least one conversation")
    toks, tgts, pos, cu, real, truncation = _layout(conversations, pad_id, max_seq_len, context_parallel_size,
                                                    lengths)
    tokens = torch.from_numpy(toks[:-1])
    labels = torch.from_numpy(tgts[1:])
    position_ids = torch.from_numpy(pos[:-1])
    cu_seqlens_padded = torch.tensor(cu, dtype=torch.int32)
    cu_seqlens = torch.zeros(len(real) + 1, dtype=torch.int32)
    cu_seqlens[1:] = torch.cumsum(torch.tensor(real, dtype=torch.int32), 0)
    labels[cu_seqlens_padded[1:-1].long() - 1] = IGNORE_INDEX  # boundary policy: no label crosses a conversation
    trained = (labels != IGNORE_INDEX) & (labels != pad_id)
    labels[~trained] = IGNORE_INDEX
    loss_mask = trained.to(torch.float32)
    row = {
        "tokens": tokens,
        "labels": labels,
        "loss_mask": loss_mask,
        "position_ids": position_ids,
        "cu_seqlens": cu_seqlens,
        "cu_seqlens_padded": cu_seqlens_padded,
        "max_seqlen": int(max(real)),
        "num_trained_tokens": int(trained.sum()),
    }
    return row, truncation
