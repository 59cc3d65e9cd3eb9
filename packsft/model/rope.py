"""A THD rotary embedding that reads nothing back from the device, installed in place of Megatron-Core's.

Megatron-Core 0.16's unfused THD RoPE (``models.common.embeddings.rope_utils._apply_rotary_pos_emb_thd``, what runs
without TransformerEngine's ``apply_rope_fusion``) calls ``cu_seqlens.tolist()`` and evaluates
``freqs.size(0) == cu_seqlens[-1]`` as a Python bool: two host syncs per call, four per layer (q and k). On CUDA each
drains the GPU queue. :func:`apply_rotary_pos_emb_thd` computes the same rotation without them: each local token's
position in its conversation from ``cu_seqlens`` on the device (searchsorted; CP zigzag chunks included), the
frequencies gathered with ``index_select``, then Megatron's own bshd rotation (``_apply_rotary_pos_emb_bshd``), so
loss and gradients are bit-identical to Megatron's (``tests/model/test_gpt.py``). Positions and gathered frequencies
are computed by the first call of a micro-batch (keyed by the ``cu_seqlens`` and ``freqs`` objects, which every layer
shares) and reused by the others.

Megatron's two frequency modes are kept, told apart by host sizes only: ``freqs`` of ``max_seqlen`` rows (the
normal case) gives positions that restart at 0 in every conversation; ``freqs`` with one row per token of the row
(``freqs.size(0) == cp * t``, Megatron's "exact mapping" for ``cu_seqlens[-1] == cp * t``) gives each token's
position in the row.
"""

from __future__ import annotations

import torch
from megatron.core.models.common.embeddings import rope_utils
from torch import Tensor

_MEGATRON_THD = rope_utils._apply_rotary_pos_emb_thd
_CACHE: dict[str, tuple] = {}


def thd_positions(cu_seqlens: Tensor, local_tokens: int, cp_size: int = 1, cp_rank: int = 0) -> tuple[Tensor, Tensor]:
    """Row positions and segment starts of the ``local_tokens`` tokens CP rank ``cp_rank`` holds, on the device.

    Args:
        cu_seqlens: int ``[n + 1]`` (device), the row's padded segment offsets, global (0 .. ``cp * local_tokens``);
            each segment a multiple of ``2 * cp_size`` long when ``cp_size > 1``.
        local_tokens: tokens on this rank (host int).

    Returns:
        ``(row_position, segment_start)``, int64 ``[local_tokens]``: TE's zigzag split (chunks ``r`` and
        ``2 cp - 1 - r`` of each segment, in segment order); with cp = 1 ``row_position`` is ``arange``.
        No device value is read.
    """
    cu = cu_seqlens.to(torch.int64)
    j = torch.arange(local_tokens, device=cu.device)
    local_cu = cu // cp_size
    seg = torch.searchsorted(local_cu[1:].contiguous(), j, right=True)   # skips empty segments
    start = cu[seg]
    if cp_size == 1:
        return j, start
    offset = j - local_cu[seg]                                         # in the rank's two chunks of the segment
    chunk = (cu[seg + 1] - start) // (2 * cp_size)
    in_segment = torch.where(offset < chunk, cp_rank * chunk + offset,
                             (2 * cp_size - 1 - cp_rank) * chunk + (offset - chunk))
    return start + in_segment, start


@torch.compiler.disable                      # the cache compares objects: keep it out of compiled layer graphs
def _packed_freqs(t: Tensor, cu_seqlens: Tensor, freqs: Tensor, cp_size: int, cp_rank: int) -> Tensor:
    """``freqs`` rows of each local token (``[t, 1, 1, d]``), cached for the micro-batch (same objects)."""
    key = (cu_seqlens, freqs, t.shape[0], cp_size, cp_rank)
    cached = _CACHE.get("last")
    if cached is not None and all(a is b if isinstance(a, Tensor) else a == b for a, b in zip(cached[0], key)):
        return cached[1]
    row, start = thd_positions(cu_seqlens, t.shape[0], cp_size, cp_rank)
    exact = freqs.dim() >= 1 and freqs.size(0) == t.shape[0] * cp_size   # Megatron's exact-mapping mode
    packed = freqs.index_select(0, row if exact else row - start)
    _CACHE["last"] = (key, packed)
    return packed


def apply_rotary_pos_emb_thd(t: Tensor, cu_seqlens: Tensor, freqs: Tensor, rotary_interleaved: bool = False,
                             multi_latent_attention: bool = False, mscale: float = 1.0,
                             cp_group: torch.distributed.ProcessGroup = None) -> Tensor:
    """``rope_utils._apply_rotary_pos_emb_thd`` without host syncs; same arguments and result.

    Args:
        t: ``[t, h, d]`` (this CP rank's tokens).
        cu_seqlens: int32 ``[n + 1]``, global segment offsets (Megatron passes ``cu_seqlens_q_padded``).
        freqs: fp32 ``[max_s, 1, 1, d_rot]`` angles.
        cp_group: the context-parallel group (Megatron's ``apply_rotary_pos_emb`` always passes one).

    Returns:
        ``[t, h, d]``, the rotated ``t``.
    """
    packed = _packed_freqs(t, cu_seqlens, freqs, cp_group.size(), cp_group.rank())
    return rope_utils._apply_rotary_pos_emb_bshd(t.unsqueeze(1), packed, rotary_interleaved=rotary_interleaved,
                                                 multi_latent_attention=multi_latent_attention,
                                                 mscale=mscale).squeeze(1)


def install_sync_free_rope() -> None:
    """Route Megatron's unfused THD RoPE (``rope_utils.apply_rotary_pos_emb``) to :func:`apply_rotary_pos_emb_thd`.

    Idempotent; on CPU and CUDA alike. TransformerEngine's fused RoPE (``apply_rope_fusion``) is not touched.
    """
    rope_utils._apply_rotary_pos_emb_thd = apply_rotary_pos_emb_thd


def uninstall_sync_free_rope() -> None:
    """Put Megatron's own THD RoPE back (for comparisons)."""
    rope_utils._apply_rotary_pos_emb_thd = _MEGATRON_THD
