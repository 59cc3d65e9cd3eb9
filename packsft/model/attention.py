"""packsft's ``torch`` attention backend: per-conversation causal core attention on PyTorch SDPA.

Shape legend (Megatron notation): ``t`` packed tokens on this rank, ``s`` sequence, ``b`` batch,
``np``/``ng`` query heads / key-value groups on this TP rank, ``hn`` head dim, ``cp`` context-parallel
size, ``T = cp * t`` tokens of the whole row.

It replaces ``core_attention`` in Megatron's local layer spec with ``DotProductAttention``'s constructor and
forward signature, so ``SelfAttention`` calls it unchanged:

* ``qkv_format="thd"`` (``packed_seq_params`` given): q ``[t, np, hn]``, k/v ``[t, ng, hn]`` -> ``[t, np*hn]``;
  tokens attend causally within their own conversation (offsets ``cu_seqlens_q_padded``, else ``cu_seqlens_q``,
  global; read from ``cu_seqlens_padded_host`` when the data path gives them, so no layer reads the device).
* sbhd: q ``[s, b, np, hn]``, k/v ``[s, b, ng, hn]`` -> ``[s, b, np*hn]``, plain causal.

Without CP: one ``SDPA(is_causal=True)`` per conversation, no ``T x T`` mask. With CP: K/V are all-gathered over
the CP group (autograd-aware) and each conversation's local queries attend under a causal mask in global
positions, so every rank holds the full K/V of the row: CP divides activations and attention work but not K/V
memory; for very long rows use the ``te`` backend (ring context parallelism). Details and measurements:
``docs/model.md`` and ``docs/parallelism.md``.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from torch import Tensor

from packsft.layout import cp_partition_indices


class _AllGatherDim0(torch.autograd.Function):
    """All-gather along dim 0 in rank order; backward = all-reduce of the gradient + own slice."""

    @staticmethod
    def forward(ctx, x: Tensor, group) -> Tensor:
        ctx.group, ctx.rank, ctx.n = group, dist.get_rank(group), x.shape[0]
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts)

    @staticmethod
    def backward(ctx, grad: Tensor):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad[ctx.rank * ctx.n:(ctx.rank + 1) * ctx.n], None


def all_gather_with_grad(x: Tensor, group) -> Tensor:
    """Concatenate every rank's ``x`` (same shape ``[n, ...]``) along dim 0 in rank order, with autograd.

    Returns ``[world * n, ...]``. The gradient reaching ``x`` is the sum over ranks of the gradient of
    its slice (all-reduce, then slice), which works on gloo (no reduce-scatter there) and NCCL.
    """
    return _AllGatherDim0.apply(x, group)


def _sdpa(q: Tensor, k: Tensor, v: Tensor, scale: float, mask: Tensor | None) -> Tensor:
    """SDPA, sequence-first: q ``[sq, b, np, hn]``, k/v ``[sk, b, ng, hn]`` -> ``[sq, b, np, hn]``.

    ``mask`` None means causal with ``sq == sk``; otherwise bool ``[sq, sk]``, True = may attend.
    """
    q, k, v = (x.permute(1, 2, 0, 3) for x in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, scale=scale,
                                         enable_gqa=q.shape[1] != k.shape[1])
    return out.permute(2, 0, 1, 3)


class TorchCoreAttention(MegatronModule):
    """Causal core attention with THD packing and context parallelism on ``F.scaled_dot_product_attention``.

    Drop-in for ``DotProductAttention`` (same constructor and forward signature, megatron-core
    0.16.1); see the module docstring for shapes, masking and the CP memory cost. No parameters, so
    checkpoint keys equal the stock local spec's.

    Raises:
        NotImplementedError: for a non-causal ``attn_mask_type``, sliding windows, a softmax type
            other than ``"vanilla"``, an ``attention_bias`` or an explicit ``attention_mask``.
    """

    def __init__(self, config, layer_number: int, attn_mask_type: AttnMaskType, attention_type: str,
                 attention_dropout: float | None = None, softmax_scale: float | None = None,
                 cp_comm_type: str | None = None, pg_collection: ProcessGroupCollection | None = None):
        super().__init__(config=config)
        if attn_mask_type != AttnMaskType.causal:
            raise NotImplementedError(f"TorchCoreAttention supports causal masks only, got {attn_mask_type}")
        if config.window_size is not None:
            raise NotImplementedError("TorchCoreAttention does not support sliding-window attention")
        if config.softmax_type != "vanilla":
            raise NotImplementedError(f"TorchCoreAttention supports softmax_type='vanilla' only, "
                                      f"got {config.softmax_type!r}")
        self.layer_number = max(1, layer_number)
        self.attn_mask_type = attn_mask_type
        self.attention_type = attention_type
        if pg_collection is None:
            pg_collection = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp", "cp"])
        self.pg_collection = pg_collection
        self.cp_group = getattr(pg_collection, "cp", None)
        # apply_query_key_layer_scaling divides and re-multiplies by layer_number in fp32: net identity.
        default_scale = 1.0 / math.sqrt(config.kv_channels)
        self.softmax_scale = softmax_scale if softmax_scale is not None else default_scale
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout

    def forward(self, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None,
                attn_mask_type: AttnMaskType | None = None, attention_bias: Tensor | None = None,
                packed_seq_params=None) -> Tensor:
        """Attend; shapes as in the module docstring (thd ``[t, np*hn]``, sbhd ``[s, b, np*hn]``)."""
        if attention_bias is not None or attention_mask is not None:
            raise NotImplementedError("TorchCoreAttention builds its own causal mask; "
                                      "got an attention_mask or attention_bias")
        if self.training and self.dropout_p > 0:
            raise NotImplementedError("TorchCoreAttention does not implement attention dropout (set it to 0)")
        thd = packed_seq_params is not None and packed_seq_params.qkv_format == "thd"
        if thd:
            query, key, value = query.unsqueeze(1), key.unsqueeze(1), value.unsqueeze(1)   # [t, 1, n, hn]
            cu = packed_seq_params.cu_seqlens_q_padded
            cu = packed_seq_params.cu_seqlens_q if cu is None else cu
            group = packed_seq_params.cp_group if packed_seq_params.cp_group is not None else self.cp_group
        else:
            group = self.cp_group
        cp_size = group.size() if group is not None else 1
        if not thd:
            cu = torch.tensor([0, query.shape[0] * cp_size], device=query.device)
        # host offsets when the data path gave them (no device read per layer), else read them back
        bounds = list(getattr(packed_seq_params, "cu_seqlens_padded_host", None) or ()) or cu.tolist()
        if cp_size == 1:
            out = self._attend_local(query, key, value, bounds)
        else:
            out = self._attend_context_parallel(query, key, value, cu, bounds, group)
        out = out.flatten(2)                                    # [s, b, np*hn]
        return out.squeeze(1) if thd else out

    def _attend_local(self, q: Tensor, k: Tensor, v: Tensor, bounds: list[int]) -> Tensor:
        """cp=1: one causal SDPA per segment ``bounds[i]:bounds[i+1]`` of dim 0; returns ``[s, b, np, hn]``."""
        if bounds[-1] != q.shape[0]:
            raise ValueError(f"cu_seqlens[-1] ({bounds[-1]}) != number of tokens ({q.shape[0]})")
        if len(bounds) == 2:
            return _sdpa(q, k, v, self.softmax_scale, None)
        return torch.cat([_sdpa(q[s:e], k[s:e], v[s:e], self.softmax_scale, None)
                          for s, e in zip(bounds[:-1], bounds[1:]) if e > s])

    def _attend_context_parallel(self, q: Tensor, k: Tensor, v: Tensor, cu: Tensor, bounds: list[int],
                                 group) -> Tensor:
        """cp>1: gather K/V, restore global order, mask causally in global positions per segment."""
        cp_size, cp_rank = group.size(), group.rank()
        gathered_pos = torch.cat([cp_partition_indices(cu, cp_size, r) for r in range(cp_size)])
        order = torch.argsort(gathered_pos.to(q.device))       # gathered row -> global order
        k_all = all_gather_with_grad(k, group).index_select(0, order)   # [T, b, ng, hn]
        v_all = all_gather_with_grad(v, group).index_select(0, order)
        if bounds[-1] != q.shape[0] * cp_size:
            raise ValueError(f"cu_seqlens[-1] ({bounds[-1]}) != context_parallel_size * local tokens "
                             f"({cp_size} * {q.shape[0]})")
        q_pos = cp_partition_indices(cu, cp_size, cp_rank).to(q.device)   # global position of local queries
        outs, local = [], 0
        for s, e in zip(bounds[:-1], bounds[1:]):
            n_local = (e - s) // cp_size
            if n_local == 0:
                continue
            mask = q_pos[local:local + n_local, None] >= torch.arange(s, e, device=q.device)[None, :]
            outs.append(_sdpa(q[local:local + n_local], k_all[s:e], v_all[s:e], self.softmax_scale, mask))
            local += n_local
        return torch.cat(outs)
