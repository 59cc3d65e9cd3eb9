"""Collate packed rows into one micro-batch: a single THD (``qkv_format="thd"``) sequence of ``b * L`` tokens.

Shape legend: ``b`` = rows in the micro-batch (``loader.micro_batch_size``), ``L`` = ``max_seq_len``, ``n_i`` =
segments of row ``i``.

Every row is already exactly ``L`` long (:func:`packsft.data.row.build_row`), so ``b`` rows concatenate into
one packed sequence: ``cu_seqlens_padded`` is the concatenation of each row's segment offsets shifted by
``i * L``, so no attention crosses a row (nor a conversation), and ``cu_seqlens`` the cumulative real lengths of
all conversations in order (TransformerEngine's THD convention); the model sees batch dimension 1 as THD needs.
With ``b == 1`` this is the row itself.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from packsft.layout import TOKEN_KEYS


def collate_rows(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Stack rows from :class:`~packsft.data.dataset.PackedSFTDataset` into one micro-batch.

    Args:
        rows: ``b >= 1`` row dicts of :func:`packsft.data.row.build_row`, each with ``tokens``, ``labels``,
            ``position_ids`` (int64 ``[L]``), ``loss_mask`` (float32 ``[L]``), ``cu_seqlens`` (int32
            ``[n_i + 1]``, real lengths), ``cu_seqlens_padded`` (int32 ``[n_i + 1]``, 0 to ``L``), ``max_seqlen``
            (int) and ``num_trained_tokens`` (int), all with the same ``L`` (one data config opens every file of
            a run); in a mixture also ``source`` (int, :class:`~packsft.data.mixing.MixedDataset`).

    Returns:
        ``tokens``, ``labels``, ``position_ids`` int64 ``[1, b * L]``; ``loss_mask`` float32 ``[1, b * L]``;
        ``cu_seqlens_padded`` int32 ``[sum(n_i) + 1]`` over the flattened ``b * L`` tokens (row ``i``'s offsets
        ``+ i * L``); ``cu_seqlens`` int32 ``[sum(n_i) + 1]``, the cumulative real lengths of every
        conversation; ``max_seqlen`` int, the longest real conversation of any row; ``num_trained_tokens``
        int, the sum; in a mixture ``trained_tokens_by_source``, ``[(source, num_trained_tokens)]`` per row.
        Example: two rows of ``L = 8`` with ``cu_seqlens_padded`` ``[0, 3, 8]`` and ``[0, 8]``
        and ``cu_seqlens`` ``[0, 3, 7]`` and ``[0, 6]`` give ``[0, 3, 8, 16]`` and ``[0, 3, 7, 13]``.
    """
    length = rows[0]["tokens"].shape[-1]
    offsets, lengths = [], []
    for i, row in enumerate(rows):
        offsets.append(row["cu_seqlens_padded"][1:].to(torch.int32) + i * length)
        lengths.append(row["cu_seqlens"][1:] - row["cu_seqlens"][:-1])
    batch = {key: torch.cat([row[key] for row in rows]).unsqueeze(0) for key in TOKEN_KEYS}
    zero = torch.zeros(1, dtype=torch.int32)
    batch["cu_seqlens_padded"] = torch.cat([zero, *offsets])
    batch["cu_seqlens"] = torch.cat([zero, torch.cumsum(torch.cat(lengths), 0).to(torch.int32)])
    batch["max_seqlen"] = max(int(row["max_seqlen"]) for row in rows)
    batch["num_trained_tokens"] = sum(int(row["num_trained_tokens"]) for row in rows)
    if "source" in rows[0]:
        batch["trained_tokens_by_source"] = [(int(row["source"]), int(row["num_trained_tokens"])) for row in rows]
    return batch
