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

The kernel is chosen once per process and dtype (:func:`select_attention_kernel`; the trainer prints it at
start-up): on CUDA in bf16/fp16 with a PyTorch that has ``torch.nn.attention.varlen.varlen_attn`` (2.10+), **one**
varlen FlashAttention-2 call per layer over the row's segments (causal by the installed signature: ``is_causal=True``
in 2.10, ``window_size=(-1, 0)`` from 2.11; ``enable_gqa=True`` where the signature has it, else K/V repeated to the
query heads). Otherwise (CPU, fp32, older torch) the fallback: one ``SDPA(is_causal=True)`` per conversation, no
``T x T`` mask. With CP: K/V are all-gathered over the CP group (autograd-aware). The varlen path then makes one call
whose query sequences are the rank's two zigzag chunks of every conversation and whose key sequences are each chunk's
causal prefix of the gathered K/V, causal bottom-right aligned (FlashAttention's convention for ``seqlen_q !=
seqlen_k``); the fallback masks each conversation's local queries causally in global positions. Every rank holds the
full K/V of the row: CP divides activations and attention work but not K/V memory; for very long rows use the ``te``
backend (ring context parallelism). All index arithmetic uses the host offsets (``cu_seqlens_padded_host``), once
per micro-batch: no layer reads the device. Details: ``docs/model.md`` and ``docs/parallelism.md``.
"""

from __future__ import annotations

import functools
import inspect
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from torch import Tensor


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


VarlenKernel = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor, int, int, float], Tensor]
"""``kernel(q [Tq, np, hn], k [Tk, ng, hn], v [Tk, ng, hn], cu_q, cu_k, max_q, max_k, scale) -> [Tq, np, hn]``.

``cu_q`` / ``cu_k``: int32 ``[n + 1]`` on the device, the offsets of ``n`` query / key sequences (sequence ``i`` is
``q[cu_q[i]:cu_q[i+1]]`` attending ``k[cu_k[i]:cu_k[i+1]]``); ``max_q`` / ``max_k``: host ints, upper bounds of the
lengths. Causal, bottom-right aligned: query ``j`` of a sequence with ``lq`` queries and ``lk`` keys sees keys
``<= j + lk - lq``. GQA: ``np`` a multiple of ``ng``. The contract of ``varlen_attn(..., causal)``."""


@dataclass(frozen=True)
class AttentionKernel:
    """The core-attention kernel in use: ``name`` for the start-up line; ``varlen`` None means the per-conversation
    SDPA fallback."""

    name: str
    varlen: VarlenKernel | None


def _torch_varlen_kernel() -> VarlenKernel | None:
    """``torch.nn.attention.varlen.varlen_attn`` adapted to :data:`VarlenKernel` by its installed signature, or None
    when this torch has no such function (< 2.10) or a signature without a causal switch."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    params = inspect.signature(varlen_attn).parameters
    if "window_size" in params:                       # 2.11+: is_causal removed (pytorch/pytorch#172245)
        causal = {"window_size": (-1, 0)}
    elif "is_causal" in params:                       # 2.10
        causal = {"is_causal": True}
    else:
        return None
    has_gqa, has_scale = "enable_gqa" in params, "scale" in params

    def kernel(q, k, v, cu_q, cu_k, max_q, max_k, scale):
        extra = dict(causal)
        if q.shape[1] != k.shape[1]:
            if has_gqa:
                extra["enable_gqa"] = True
            else:                                     # no flag: repeat K/V to the query heads
                k, v = (x.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for x in (k, v))
        if has_scale:
            extra["scale"] = scale
        elif scale != 1.0 / math.sqrt(q.shape[-1]):   # default scale only: fold ours into q
            q = q * (scale * math.sqrt(q.shape[-1]))
        return varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, **extra)

    return kernel


@functools.cache
def select_attention_kernel(device_type: str, dtype: torch.dtype) -> AttentionKernel:
    """The ``torch`` backend's kernel for activations of ``dtype`` on a ``device_type`` device; the same answer for
    the whole process.

    ``varlen_attn (FlashAttention-2)`` on CUDA (compute capability 8.0+) in bf16/fp16 when torch has it; else the
    per-conversation SDPA fallback, named with the reason (CPU, fp32, an older GPU, torch without ``varlen_attn``).
    """
    if device_type != "cuda":
        return AttentionKernel(f"sdpa per conversation ({device_type.upper()} fallback)", None)
    if dtype not in (torch.bfloat16, torch.float16):
        return AttentionKernel(f"sdpa per conversation ({str(dtype).replace('torch.', '')} fallback: "
                               "FlashAttention needs bf16/fp16)", None)
    if torch.cuda.get_device_capability() < (8, 0):
        return AttentionKernel("sdpa per conversation (FlashAttention-2 needs compute capability 8.0+)", None)
    kernel = _torch_varlen_kernel()
    if kernel is None:
        return AttentionKernel(f"sdpa per conversation (torch {torch.__version__} has no varlen_attn)", None)
    return AttentionKernel("varlen_attn (FlashAttention-2)", kernel)


@dataclass(frozen=True)
class ContextParallelPlan:
    """Index tensors of one packed row for CP rank ``r`` of ``cp`` (built once per micro-batch from host offsets).

    ``order``: int64 ``[T]``, row position -> index in the rank-ordered all-gather (``gathered[order]`` is the row in
    global order). ``q_pos``: int64 ``[T / cp]``, global position of each local token. Varlen: ``k_index`` int64 into
    the rank-ordered gather, the keys of each query chunk (its causal prefix in the conversation), concatenated;
    ``cu_q`` / ``cu_k`` int32 ``[2 n + 1]`` over the rank's two chunks of each of the ``n`` non-empty conversations;
    ``max_q`` / ``max_k`` host ints.
    """

    order: Tensor
    q_pos: Tensor
    k_index: Tensor
    cu_q: Tensor
    cu_k: Tensor
    max_q: int
    max_k: int


def context_parallel_plan(bounds: tuple[int, ...] | list[int], cp: int, r: int,
                          device: torch.device | str) -> ContextParallelPlan:
    """:class:`ContextParallelPlan` of segment offsets ``bounds`` (host ints, each segment a multiple of ``2 cp``
    long; checked where the row was loaded), on ``device``. Pure host arithmetic: no device read."""
    spans = [(s, e - s) for s, e in zip(bounds[:-1], bounds[1:]) if e > s]

    def positions(rank):                              # TE's zigzag split: chunks rank and 2 cp - 1 - rank
        out = []
        for s, n in spans:
            c = n // (2 * cp)
            out += [*range(s + rank * c, s + (rank + 1) * c),
                    *range(s + (2 * cp - 1 - rank) * c, s + (2 * cp - rank) * c)]
        return out

    gathered = torch.tensor([p for rank in range(cp) for p in positions(rank)], dtype=torch.int64)
    order = torch.empty_like(gathered)
    order[gathered] = torch.arange(gathered.numel())
    key_pos, q_lens, k_lens = [], [], []
    for s, n in spans:
        c = n // (2 * cp)
        for chunk in (r, 2 * cp - 1 - r):              # the local order of the two chunks
            key_pos += range(s, s + (chunk + 1) * c)
            q_lens.append(c)
            k_lens.append((chunk + 1) * c)
    k_index = order[torch.tensor(key_pos, dtype=torch.int64)]

    def offsets(lengths):
        return torch.tensor([0, *lengths], dtype=torch.int32).cumsum(0, dtype=torch.int32)

    to = functools.partial(Tensor.to, device=device, non_blocking=True)
    return ContextParallelPlan(order=to(order), q_pos=to(torch.tensor(positions(r), dtype=torch.int64)),
                               k_index=to(k_index), cu_q=to(offsets(q_lens)), cu_k=to(offsets(k_lens)),
                               max_q=max(q_lens, default=0), max_k=max(k_lens, default=0))


class TorchCoreAttention(MegatronModule):
    """Causal core attention with THD packing and context parallelism on ``F.scaled_dot_product_attention``.

    Drop-in for ``DotProductAttention`` (same constructor and forward signature, megatron-core
    0.16.1); see the module docstring for shapes, masking and the CP memory cost. No parameters, so
    checkpoint keys equal the stock local spec's. It implements what packsft's layer spec and
    ``ModelConfig.transformer_config`` give it, and nothing else: a causal ``attn_mask_type``, no sliding
    window, ``softmax_type="vanilla"``, no attention dropout, no ``attention_mask`` / ``attention_bias``
    (it builds its own causal mask; others are ignored, not refused).
    """

    def __init__(self, config, layer_number: int, attn_mask_type: AttnMaskType, attention_type: str,
                 attention_dropout: float | None = None, softmax_scale: float | None = None,
                 cp_comm_type: str | None = None, pg_collection: ProcessGroupCollection | None = None):
        super().__init__(config=config)
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
        self.kernel: AttentionKernel | None = None     # select_attention_kernel's answer, at the first call

    def forward(self, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None,
                attn_mask_type: AttnMaskType | None = None, attention_bias: Tensor | None = None,
                packed_seq_params=None) -> Tensor:
        """Attend; shapes as in the module docstring (thd ``[t, np*hn]``, sbhd ``[s, b, np*hn]``).

        The offsets' last entry is the row's token count (``cp * t``): the data path builds them so (asserted).
        """
        if self.kernel is None:                         # chosen once, at the first call
            self.kernel = select_attention_kernel(query.device.type, query.dtype)
        thd = packed_seq_params is not None and packed_seq_params.qkv_format == "thd"
        if thd:
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
        assert bounds[-1] == query.shape[0] * cp_size, \
            f"cu_seqlens[-1] ({bounds[-1]}) != context_parallel_size * local tokens ({cp_size} * {query.shape[0]})"
        if thd and self.kernel.varlen is not None:
            return self._attend_varlen(query, key, value, cu, bounds, group, packed_seq_params).flatten(1)
        if thd:
            query, key, value = query.unsqueeze(1), key.unsqueeze(1), value.unsqueeze(1)   # [t, 1, n, hn]
        if cp_size == 1:
            out = self._attend_local(query, key, value, bounds)
        else:
            out = self._attend_context_parallel(query, key, value, bounds, group, packed_seq_params)
        out = out.flatten(2)                                    # [s, b, np*hn]
        return out.squeeze(1) if thd else out

    def _attend_varlen(self, q: Tensor, k: Tensor, v: Tensor, cu: Tensor, bounds: list[int], group,
                       packed_seq_params) -> Tensor:
        """THD through ``self.kernel.varlen``: one call per layer; q ``[t, np, hn]``, k/v ``[t, ng, hn]`` ->
        ``[t, np, hn]``. cp=1: the row's own offsets ``cu`` (device int32); cp>1: :class:`ContextParallelPlan`."""
        varlen = self.kernel.varlen
        if group is None or group.size() == 1:
            longest = max(e - s for s, e in zip(bounds[:-1], bounds[1:]))
            return varlen(q, k, v, cu.to(torch.int32), cu.to(torch.int32), longest, longest, self.softmax_scale)
        plan = _plan_for(packed_seq_params, bounds, group, q.device)
        k_sel = all_gather_with_grad(k, group).index_select(0, plan.k_index)    # each chunk's causal key prefix
        v_sel = all_gather_with_grad(v, group).index_select(0, plan.k_index)
        return varlen(q, k_sel, v_sel, plan.cu_q, plan.cu_k, plan.max_q, plan.max_k, self.softmax_scale)

    def _attend_local(self, q: Tensor, k: Tensor, v: Tensor, bounds: list[int]) -> Tensor:
        """cp=1 fallback: one causal SDPA per segment ``bounds[i]:bounds[i+1]`` of dim 0; returns ``[s, b, np, hn]``."""
        if len(bounds) == 2:
            return _sdpa(q, k, v, self.softmax_scale, None)
        return torch.cat([_sdpa(q[s:e], k[s:e], v[s:e], self.softmax_scale, None)
                          for s, e in zip(bounds[:-1], bounds[1:]) if e > s])

    def _attend_context_parallel(self, q: Tensor, k: Tensor, v: Tensor, bounds: list[int], group,
                                 packed_seq_params) -> Tensor:
        """cp>1 fallback: gather K/V, restore global order, mask causally in global positions per segment."""
        cp_size = group.size()
        plan = _plan_for(packed_seq_params, bounds, group, q.device)
        k_all = all_gather_with_grad(k, group).index_select(0, plan.order)   # [T, b, ng, hn]
        v_all = all_gather_with_grad(v, group).index_select(0, plan.order)
        outs, local = [], 0
        for s, e in zip(bounds[:-1], bounds[1:]):
            n_local = (e - s) // cp_size
            if n_local == 0:
                continue
            mask = plan.q_pos[local:local + n_local, None] >= torch.arange(s, e, device=q.device)[None, :]
            outs.append(_sdpa(q[local:local + n_local], k_all[s:e], v_all[s:e], self.softmax_scale, mask))
            local += n_local
        return torch.cat(outs)


def _plan_for(packed_seq_params, bounds: list[int], group, device) -> ContextParallelPlan:
    """The row's :class:`ContextParallelPlan`, built by the first layer and kept on ``packed_seq_params`` (one
    object per micro-batch) for the others; built each call without one (sbhd)."""
    key = (tuple(bounds), group.size(), group.rank(), str(device))
    cached = getattr(packed_seq_params, "context_parallel_plan", None)
    if cached is not None and cached[0] == key:
        return cached[1]
    plan = context_parallel_plan(bounds, group.size(), group.rank(), device)
    if packed_seq_params is not None:
        packed_seq_params.context_parallel_plan = (key, plan)
    return plan


def describe_attention(backend: str, device_type: str, dtype: torch.dtype) -> str:
    """The attention kernel a run of ``model.attention_backend`` ``backend`` uses, for its start-up line."""
    if backend == "te":
        return "TransformerEngine DotProductAttention (THD)"
    return select_attention_kernel(device_type, dtype).name
