"""Context-parallel (CP) slicing of one packed THD row and its Megatron ``PackedSeqParams``.

Rank ``r`` keeps chunks ``r`` and ``2 * cp - 1 - r`` of every conversation
(:func:`packsft.layout.cp_partition_indices`, TransformerEngine's load-balanced THD split; worked example in
``docs/loader.md``), cut along ``cu_seqlens_padded``, the segment offsets in the row (each conversation
padded to a multiple of ``2 * cp``). ``cu_seqlens`` (real lengths), ``cu_seqlens_padded`` and ``max_seqlen``
stay global: Megatron's THD RoPE, TransformerEngine and packsft's attention derive the local layout from them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from megatron.core.packed_seq_params import PackedSeqParams
from torch import Tensor

from packsft.layout import TOKEN_KEYS, cp_partition_indices


def slice_batch_for_cp(batch: dict, cp_size: int, cp_rank: int) -> dict:
    """Keep this CP rank's tokens of one packed row (a :func:`packsft.data.collate.collate_rows` batch).

    ``tokens``, ``labels``, ``loss_mask`` and ``position_ids`` (shape ``[L]`` or ``[1, L]``, any
    dtype) are indexed along their last dimension with :func:`cp_partition_indices`, giving
    ``[L // cp_size]`` or ``[1, L // cp_size]``; the chunks follow ``cu_seqlens_padded`` (``cu_seqlens`` when
    a batch has no padded offsets). Every other entry (``cu_seqlens``, ``max_seqlen``, ...) is passed through
    unchanged: it stays global. Example: ``cu_seqlens_padded=[0,4,8]``, cp=2, rank 1 gets
    ``tokens[..., [1, 2, 5, 6]]``.

    Returns:
        a new dict; the input is not modified. With ``cp_size == 1`` the tensors are the same objects.
    """
    out = dict(batch)
    if cp_size == 1:
        return out
    index = cp_partition_indices(batch.get("cu_seqlens_padded", batch["cu_seqlens"]), cp_size, cp_rank)
    for key in TOKEN_KEYS:
        if key in batch:
            out[key] = batch[key].index_select(-1, index.to(batch[key].device))
    return out


@dataclass
class PackedRowParams(PackedSeqParams):
    """Megatron's ``PackedSeqParams`` plus the row's padded segment offsets as host integers.

    ``cu_seqlens_padded_host`` lets packsft's ``torch`` attention backend loop over conversations without
    reading the offsets back from the device in every layer (a host sync per layer on CUDA).
    """

    cu_seqlens_padded_host: tuple[int, ...] | None = None


def make_packed_seq_params(cu_seqlens: Tensor, max_seqlen: int | Tensor, cp_group=None,
                           cu_seqlens_padded: Tensor | None = None,
                           device: torch.device | str | None = None) -> PackedRowParams:
    """Megatron ``PackedSeqParams`` for one packed THD row (TransformerEngine's convention).

    Args:
        cu_seqlens: integer ``[num_segments + 1]`` (or ``[1, num_segments + 1]``), cumulative real
            conversation lengths; converted to int32 as TE and Megatron expect. Pass the offsets on the host
            (as the loader gives them) with ``device`` set, so they are read without a device sync.
        max_seqlen: longest real conversation in tokens (int or 0-d tensor).
        cp_group: the context-parallel process group, or None for cp=1.
        cu_seqlens_padded: the same shape (the same row's), segment offsets in the row including padding
            (0..``L``); ``None``: equal to ``cu_seqlens`` (no padding).
        device: where the offsets go (default: where they are).

    Returns:
        :class:`PackedRowParams` with ``qkv_format="thd"``, ``cu_seqlens_q = cu_seqlens_kv = cu_seqlens``,
        ``cu_seqlens_q_padded = cu_seqlens_kv_padded = cu_seqlens_padded`` (int32, on ``device``),
        ``max_seqlen_q = max_seqlen_kv = m``, ``cp_group`` and ``cu_seqlens_padded_host`` (a tuple of ints);
        ``m`` = the larger of ``max_seqlen`` and the longest padded segment: Megatron's THD RoPE builds ``m``
        positions and applies them to each padded segment, and TE only needs an upper bound. ``m`` equals
        ``cu_seqlens_padded[-1]`` only for a single-segment row, where RoPE's pack-offset mode (``rope_utils``'
        THD path) gives the same positions.
    """
    cu_seqlens = cu_seqlens.reshape(-1).to(torch.int32)
    padded = cu_seqlens if cu_seqlens_padded is None else cu_seqlens_padded.reshape(-1).to(torch.int32)
    host = tuple(padded.tolist())
    longest = max(int(max_seqlen), max(e - s for s, e in zip(host[:-1], host[1:])))
    if device is not None:
        cu_seqlens = cu_seqlens.to(device, non_blocking=True)
        padded = padded.to(device, non_blocking=True)
    return PackedRowParams(
        qkv_format="thd",
        cu_seqlens_q=cu_seqlens,
        cu_seqlens_kv=cu_seqlens,
        cu_seqlens_q_padded=padded,
        cu_seqlens_kv_padded=padded,
        max_seqlen_q=longest,
        max_seqlen_kv=longest,
        cp_group=cp_group,
        cu_seqlens_padded_host=host,
    )
