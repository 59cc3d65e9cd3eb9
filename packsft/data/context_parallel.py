"""Context-parallel (CP) slicing of one packed THD row and its Megatron ``PackedSeqParams``.

Rank ``r`` keeps chunks ``r`` and ``2 * cp - 1 - r`` of every conversation
(:func:`packsft.layout.cp_partition_indices`, TransformerEngine's load-balanced THD split; worked example in
``docs/loader.md``). ``cu_seqlens`` and ``max_seqlen`` stay global: Megatron's THD RoPE and packsft's
attention derive the local layout from them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from megatron.core.packed_seq_params import PackedSeqParams
from torch import Tensor

from packsft.layout import TOKEN_KEYS, check_cu_seqlens, cp_partition_indices


def slice_batch_for_cp(batch: dict, cp_size: int, cp_rank: int) -> dict:
    """Keep this CP rank's tokens of one packed row.

    ``tokens``, ``labels``, ``loss_mask`` and ``position_ids`` (shape ``[L]`` or ``[1, L]``, any
    dtype) are indexed along their last dimension with :func:`cp_partition_indices`, giving
    ``[L // cp_size]`` or ``[1, L // cp_size]``. Every other entry (``cu_seqlens``, ``max_seqlen``, ...)
    is passed through unchanged: it stays global. Example: ``cu_seqlens=[0,4,8]``, cp=2, rank 1 gets
    ``tokens[..., [1, 2, 5, 6]]``.

    Returns:
        a new dict; the input is not modified. With ``cp_size == 1`` the tensors are the same objects.

    Raises:
        ValueError: if ``cu_seqlens`` is missing, a sliced tensor's last dimension differs from
            ``cu_seqlens[-1]``, or as :func:`cp_partition_indices`.
    """
    if "cu_seqlens" not in batch:
        raise ValueError("batch has no 'cu_seqlens'; context-parallel slicing needs the segment offsets")
    out = dict(batch)
    if cp_size == 1:
        return out
    index = cp_partition_indices(batch["cu_seqlens"], cp_size, cp_rank)
    total = index.numel() * cp_size
    for key in TOKEN_KEYS:
        if key not in batch:
            continue
        value = batch[key]
        if value.shape[-1] != total:
            raise ValueError(f"batch[{key!r}] has length {value.shape[-1]} but cu_seqlens[-1] is {total}")
        out[key] = value.index_select(-1, index.to(value.device))
    return out


@dataclass
class PackedRowParams(PackedSeqParams):
    """Megatron's ``PackedSeqParams`` plus the row's padded segment offsets as host integers.

    ``cu_seqlens_padded_host`` lets packsft's ``torch`` attention backend loop over conversations without
    reading ``cu_seqlens`` back from the device in every layer (a host sync per layer on CUDA).
    """

    cu_seqlens_padded_host: tuple[int, ...] | None = None


def make_packed_seq_params(cu_seqlens: Tensor, max_seqlen: int | Tensor, cp_group=None,
                           device: torch.device | str | None = None) -> PackedRowParams:
    """Megatron ``PackedSeqParams`` for one packed THD row.

    Args:
        cu_seqlens: integer ``[num_segments + 1]`` (or ``[1, num_segments + 1]``), global offsets
            0..``L``; converted to int32 as TE and Megatron expect. Pass it on the host (as the loader gives
            it) with ``device`` set, so it is checked and read without a device sync.
        max_seqlen: longest segment in tokens (int or 0-d tensor). Use the true longest segment:
            Megatron's THD RoPE switches to pack-offset positions when it equals ``cu_seqlens[-1]``
            (``rope_utils``' THD path), harmless for the loss but not what packsft means.
        cp_group: the context-parallel process group, or None for cp=1.
        device: where the offsets go (default: where ``cu_seqlens`` is).

    Returns:
        :class:`PackedRowParams` with ``qkv_format="thd"``, ``cu_seqlens_q = cu_seqlens_kv =
        cu_seqlens_q_padded = cu_seqlens_kv_padded = cu_seqlens`` (int32, on ``device``), ``max_seqlen_q =
        max_seqlen_kv = max_seqlen``, ``cp_group`` and ``cu_seqlens_padded_host`` (a tuple of ints).
    """
    cu_seqlens = check_cu_seqlens(cu_seqlens).to(torch.int32)
    host = tuple(cu_seqlens.tolist())
    if device is not None:
        cu_seqlens = cu_seqlens.to(device, non_blocking=True)
    max_seqlen = int(max_seqlen)
    return PackedRowParams(
        qkv_format="thd",
        cu_seqlens_q=cu_seqlens,
        cu_seqlens_kv=cu_seqlens,
        cu_seqlens_q_padded=cu_seqlens,
        cu_seqlens_kv_padded=cu_seqlens,
        max_seqlen_q=max_seqlen,
        max_seqlen_kv=max_seqlen,
        cp_group=cp_group,
        cu_seqlens_padded_host=host,
    )
