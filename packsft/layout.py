"""What the packer and the loader must agree on about a packed row: costs, keys, the CP split.

A conversation of ``n`` tokens occupies :func:`conversation_cost` tokens of a row (padded for context
parallelism); the packer packs those costs and the loader lays the row out with the same numbers, so the
two can never disagree on what fits. Row layout and CP slicing: ``docs/loader.md``.

Dependency-free (torch is imported only by :func:`cp_partition_indices`), so every package can import it,
the pack path stays light, and the prompt formats can mark untrained targets with :data:`IGNORE_INDEX`.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch import Tensor

IGNORE_INDEX = -100
"""Label of a position that is not trained (``torch.nn.functional.cross_entropy``'s and Megatron's default)."""

TOKEN_KEYS = ("tokens", "labels", "loss_mask", "position_ids")
"""Per-token tensors of a row, ``[L]`` each: stacked by collate, sliced per CP rank, moved to the model."""

ROW_KEYS = (*TOKEN_KEYS, "cu_seqlens", "cu_seqlens_padded", "max_seqlen", "num_trained_tokens")
"""Every entry of a row built by :func:`packsft.data.row.build_row`."""


def cp_granularity(context_parallel_size: int) -> int:
    """Padding granularity ``g`` in tokens: ``2 * context_parallel_size`` when CP > 1, else 1."""
    return 2 * context_parallel_size if context_parallel_size > 1 else 1


def conversation_cost(num_tokens: int, context_parallel_size: int = 1) -> int:
    """Tokens a conversation occupies in a row: ``ceil(n / g) * g`` with ``g`` = :func:`cp_granularity`.

    TransformerEngine's THD context parallelism cuts every sequence into ``2 * cp`` equal chunks, so each
    conversation is padded to a multiple of ``2 * cp``.
    """
    g = cp_granularity(context_parallel_size)
    return -(-num_tokens // g) * g


def row_granularity(context_parallel_size: int = 1, sequence_parallel_size: int = 1) -> int:
    """What ``max_seq_len`` must be a multiple of: ``lcm(g, cp * sp)`` with ``g`` = :func:`cp_granularity`.

    CP needs every conversation padded to ``2 * cp`` (and so the row). Sequence parallelism splits this CP
    rank's ``L / cp`` tokens into ``sp`` (= the TP size) equal contiguous shards for the norms and the
    residual stream; attention all-gathers them back, so shards may cut through a conversation and only the
    row length must divide, not each conversation (Megatron-Bridge's ``lcm(2 * cp, cp * tp)``, applied to
    the fixed-length row).
    """
    return math.lcm(cp_granularity(context_parallel_size), context_parallel_size * sequence_parallel_size)


MAX_SEQ_LEN = 1 << 24
"""Longest row packsft takes, in tokens (16,777,216): the packer's best-fit keeps one bucket per length."""


def data_parallel_size(world_size: int, tensor_model_parallel_size: int = 1, context_parallel_size: int = 1,
                       pipeline_model_parallel_size: int = 1, parallel: str = "") -> int:
    """``world_size / (TP x CP x PP)``: the one check of a job's world size against its model-parallel sizes.

    Raises:
        ValueError: ``world_size`` is not a multiple of ``TP x CP x PP``; ``parallel`` (e.g. ``"parallel."``)
            prefixes the size names in the message.
    """
    sizes = {"tensor_model": tensor_model_parallel_size, "context": context_parallel_size,
             "pipeline_model": pipeline_model_parallel_size}
    model_parallel = math.prod(sizes.values())
    if world_size % model_parallel:
        named = " * ".join(f"{parallel}{k}_parallel_size ({v})" for k, v in sizes.items())
        raise ValueError(f"WORLD_SIZE ({world_size}) must be a multiple of {named} (world = TP x CP x PP x DP)")
    return world_size // model_parallel


def check_max_seq_len(max_seq_len: int, context_parallel_size: int = 1, sequence_parallel_size: int = 1,
                      name: str = "max_seq_len", parallel: str = "") -> None:
    """Raise ``ValueError`` unless both parallel sizes are >= 1 and ``max_seq_len`` is positive, at most
    :data:`MAX_SEQ_LEN` and a multiple of :func:`row_granularity`: the one check of the sizes every other function
    here takes (the packer's ``PackConfig.validate``, the trainer's config and ``PackedSFTDataset`` call it where
    the sizes enter). ``name`` and ``parallel`` (a prefix such as ``"parallel."``) are the keys the message names."""
    if context_parallel_size < 1 or sequence_parallel_size < 1:
        raise ValueError(f"{parallel}context_parallel_size ({context_parallel_size}) and sequence_parallel_size "
                         f"({sequence_parallel_size}) must be >= 1")
    g = row_granularity(context_parallel_size, sequence_parallel_size)
    if max_seq_len <= 0:
        raise ValueError(f"{name} must be positive, got {max_seq_len}")
    if max_seq_len > MAX_SEQ_LEN:
        raise ValueError(f"{name} ({max_seq_len}) is above packsft's limit of {MAX_SEQ_LEN:,} tokens a row")
    if max_seq_len % g:
        cp, tp = f"{parallel}context_parallel_size", f"{parallel}tensor_model_parallel_size"
        if sequence_parallel_size == 1:
            why, what = f"2 * {cp}", "equal context-parallel chunks"
        else:
            why = f"lcm(2 * {cp}, {cp} * {tp})"
            what = "equal context-parallel chunks and sequence-parallel shards"
        raise ValueError(f"{name} ({max_seq_len}) must be a multiple of {why} ({g}) so every row splits into "
                         f"{what}")


def cp_partition_indices(cu_seqlens: Tensor, cp_size: int, cp_rank: int) -> Tensor:
    """Positions in the full row of the tokens that CP rank ``cp_rank`` keeps.

    Every segment is cut into ``2 * cp_size`` equal chunks and rank ``r`` keeps chunks ``r`` and
    ``2 * cp_size - 1 - r`` of each, in segment order: the same result as TransformerEngine's
    ``thd_get_partitioned_indices``. Example: ``cu_seqlens=[0,4,8]``, ``cp_size=2``: rank 1 keeps
    ``[1, 2, 5, 6]``, rank 0 ``[0, 3, 4, 7]``.

    Args:
        cu_seqlens: integer ``[num_segments + 1]`` (or ``[1, num_segments + 1]``), padded offsets from 0
            to the row length ``L``, non-decreasing, each segment a multiple of ``2 * cp_size`` when
            ``cp_size > 1``: a row of :func:`packsft.data.row.build_row` (or several collated) built for this CP
            size, as the loader builds them.
        cp_size: context-parallel size (>= 1).
        cp_rank: this rank's index in the CP group, ``0 <= cp_rank < cp_size``.

    Returns:
        int64 ``[L // cp_size]`` on ``cu_seqlens``' device, ascending.
    """
    import torch

    cu_seqlens = cu_seqlens.reshape(-1).to(torch.int64)
    total = int(cu_seqlens[-1])
    if cp_size == 1:
        return torch.arange(total, device=cu_seqlens.device)
    chunk = (cu_seqlens[1:] - cu_seqlens[:-1]) // (2 * cp_size)                                           # [n]
    seg = torch.repeat_interleave(torch.arange(len(chunk), device=chunk.device), 2 * chunk)
    local_start = torch.cumsum(2 * chunk, 0) - 2 * chunk                       # [n]
    j = torch.arange(total // cp_size, device=chunk.device) - local_start[seg]  # offset in own 2 chunks
    c = chunk[seg]
    in_row = torch.where(j < c, cp_rank * c + j, (2 * cp_size - 1 - cp_rank) * c + (j - c))
    return cu_seqlens[:-1][seg] + in_row
