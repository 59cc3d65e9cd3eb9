"""Context-parallel (CP) slicing of one packed THD row: which tokens each CP rank keeps.

Layout (TransformerEngine ``thd_get_partitioned_indices``, the load-balanced causal split): every
segment of ``cu_seqlens`` (one conversation, padded to a multiple of ``2 * cp_size`` by the loader,
DESIGN §4-5) is cut into ``2 * cp_size`` equal chunks, and rank ``r`` keeps chunks ``r`` and
``2 * cp_size - 1 - r`` of every segment, in segment order. Pairing an early chunk with a late one
gives every rank the same amount of causal-attention work.

Worked example (DESIGN §6): ``cu_seqlens = [0, 4, 8]``, ``cp_size = 2``: each segment has 4 chunks of
1 token; rank 0 keeps chunks 0 and 3 of each segment -> ``[0, 3, 4, 7]``; rank 1 keeps chunks 1 and 2
-> ``[1, 2, 5, 6]``.

All functions here are pure torch and take plain integers, so they are tested without process
groups. ``cu_seqlens`` and ``max_seqlen`` stay global (Megatron's THD RoPE and packsft's attention
derive the local layout from them).
"""

from __future__ import annotations

import torch
from torch import Tensor

CP_SLICED_KEYS = ("tokens", "labels", "loss_mask", "position_ids")


def _check_cu_seqlens(cu_seqlens: Tensor) -> Tensor:
    if cu_seqlens.dim() == 2 and cu_seqlens.shape[0] == 1:
        cu_seqlens = cu_seqlens[0]
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError(f"cu_seqlens must be 1-D with at least 2 entries, "
                         f"got shape {tuple(cu_seqlens.shape)}")
    if cu_seqlens.dtype.is_floating_point:
        raise ValueError(f"cu_seqlens must be an integer tensor, got {cu_seqlens.dtype}")
    if int(cu_seqlens[0]) != 0:
        raise ValueError(f"cu_seqlens must start at 0, got {int(cu_seqlens[0])}")
    if bool((cu_seqlens[1:] < cu_seqlens[:-1]).any()):
        raise ValueError(f"cu_seqlens must be non-decreasing, got {cu_seqlens.tolist()}")
    return cu_seqlens


def cp_partition_indices(cu_seqlens: Tensor, cp_size: int, cp_rank: int) -> Tensor:
    """Positions in the full row of the tokens that CP rank ``cp_rank`` keeps.

    Same result as TransformerEngine ``tex.thd_get_partitioned_indices(cu_seqlens, total, cp_size,
    cp_rank)``. Example (DESIGN §6): ``cu_seqlens=[0,4,8]``, ``cp_size=2``, ``cp_rank=1`` ->
    ``[1, 2, 5, 6]``; ``cp_rank=0`` -> ``[0, 3, 4, 7]``.

    Args:
        cu_seqlens: int32 (any integer dtype) ``[num_segments + 1]``, token offsets from 0 to the row
            length ``L``; ``[1, num_segments + 1]`` is accepted too.
        cp_size: context-parallel size (>= 1).
        cp_rank: this rank's index in the CP group, ``0 <= cp_rank < cp_size``.

    Returns:
        int64 ``[L // cp_size]`` on ``cu_seqlens``' device, ascending.

    Raises:
        ValueError: on a malformed ``cu_seqlens``, a bad ``cp_size``/``cp_rank``, or (``cp_size > 1``) a
            segment whose length is not a multiple of ``2 * cp_size``.
    """
    cu_seqlens = _check_cu_seqlens(cu_seqlens).to(torch.int64)
    if cp_size < 1 or not 0 <= cp_rank < cp_size:
        raise ValueError(f"need context_parallel_size >= 1 and 0 <= cp_rank < context_parallel_size, "
                         f"got cp_size={cp_size}, cp_rank={cp_rank}")
    total = int(cu_seqlens[-1])
    if cp_size == 1:
        return torch.arange(total, device=cu_seqlens.device)
    lengths = cu_seqlens[1:] - cu_seqlens[:-1]
    bad = (lengths % (2 * cp_size)).nonzero().flatten()
    if bad.numel():
        i = int(bad[0])
        raise ValueError(f"segment {i} of cu_seqlens has length {int(lengths[i])}, not a multiple of "
                         f"2 * context_parallel_size = {2 * cp_size} (pad conversations when packing)")
    chunk = lengths // (2 * cp_size)                                           # [n]
    seg = torch.repeat_interleave(torch.arange(len(chunk), device=chunk.device), 2 * chunk)
    local_start = torch.cumsum(2 * chunk, 0) - 2 * chunk                       # [n]
    j = torch.arange(total // cp_size, device=chunk.device) - local_start[seg]  # offset in own 2 chunks
    c = chunk[seg]
    in_row = torch.where(j < c, cp_rank * c + j, (2 * cp_size - 1 - cp_rank) * c + (j - c))
    return cu_seqlens[:-1][seg] + in_row


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
    for key in CP_SLICED_KEYS:
        if key not in batch:
            continue
        value = batch[key]
        if value.shape[-1] != total:
            raise ValueError(f"batch[{key!r}] has length {value.shape[-1]} but cu_seqlens[-1] is {total}")
        out[key] = value.index_select(-1, index.to(value.device))
    return out


def make_packed_seq_params(cu_seqlens: Tensor, max_seqlen: int | Tensor, cp_group=None):
    """Megatron ``PackedSeqParams`` for one packed THD row (DESIGN §6).

    Args:
        cu_seqlens: integer ``[num_segments + 1]`` (or ``[1, num_segments + 1]``), global offsets
            0..``L``; converted to int32 as TE and Megatron expect.
        max_seqlen: longest segment in tokens (int or 0-d tensor). Use the true longest segment:
            Megatron's THD RoPE switches to pack-offset positions when it equals ``cu_seqlens[-1]``
            (``rope_utils.py:211``), harmless for the loss but not what packsft means.
        cp_group: the context-parallel process group, or None for cp=1.

    Returns:
        ``PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu_seqlens_kv=cu_seqlens_q_padded=
        cu_seqlens_kv_padded=cu_seqlens, max_seqlen_q=max_seqlen_kv=max_seqlen, cp_group=cp_group)``.
    """
    from megatron.core.packed_seq_params import PackedSeqParams

    cu_seqlens = _check_cu_seqlens(cu_seqlens).to(torch.int32)
    max_seqlen = int(max_seqlen)
    return PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=cu_seqlens,
        cu_seqlens_kv=cu_seqlens,
        cu_seqlens_q_padded=cu_seqlens,
        cu_seqlens_kv_padded=cu_seqlens,
        max_seqlen_q=max_seqlen,
        max_seqlen_kv=max_seqlen,
        cp_group=cp_group,
    )
