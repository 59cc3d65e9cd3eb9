"""How much GPU memory a training layout needs per GPU, and how long a row fits: the formula of ``docs/memory.md``.

Everything is in bytes per GPU of the most loaded rank (the first pipeline stage, which also holds the
embedding). Shape legend: ``P`` parameters, ``L`` tokens per packed row (``data.max_seq_len``), ``h`` hidden,
``h_kv = num_query_groups * head_dim``, ``f`` SwiGLU width, ``v`` vocabulary, ``c`` fused-loss chunk,
``TP``/``CP``/``PP``/``DP`` the parallel sizes. Estimates, not measurements: check a new setting with a few
steps and the ``mem_gib`` field of ``metrics.jsonl``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from packsft.layout import MAX_SEQ_LEN, row_granularity
from packsft.model.config import ModelConfig

GiB = 2**30
USABLE_FRACTION = 0.9
"""Share of the GPU left after the CUDA context, NCCL buffers and allocator fragmentation."""
VOCAB_BLOCK = 32768
"""Vocabulary rows per block of the fused loss (its ``vocab_chunk_size`` default)."""


@dataclass(frozen=True)
class Layout:
    """The settings that decide memory; see :func:`layout_from_config` for their config keys.

    Attributes:
        tp, cp, pp, dp: tensor-, context-, pipeline- and data-parallel sizes.
        distributed_optimizer: shard fp32 master weights and Adam moments over ``DP x CP`` (ZeRO-1).
        bf16: bf16 parameters with fp32 main gradients and fp32 master weights (Megatron mixed precision);
            False: fp32 parameters (with ``autocast`` when ``autocast`` is True).
        autocast: ``torch.autocast`` to bf16 over fp32 weights.
        sequence_parallel: norms and residual activations split over TP too.
        recompute: ``None``, ``"selective"`` (core attention recomputed) or ``"full"``.
        recompute_num_layers: layers per recomputed chunk with ``"full"`` (Megatron ``uniform``).
        attention_backend: ``"te"`` or ``"torch"`` (the latter all-gathers K/V over CP).
        fused_loss: packsft's chunked fused linear cross-entropy; False: stock full-logit loss.
        chunk_size: tokens per chunk of the fused loss.
        micro_batch_size: rows per micro-batch (concatenated into one THD sequence).
    """

    tp: int = 1
    cp: int = 1
    pp: int = 1
    dp: int = 1
    distributed_optimizer: bool = False
    bf16: bool = False
    autocast: bool = True
    sequence_parallel: bool = False
    recompute: str | None = None
    recompute_num_layers: int = 1
    attention_backend: str = "te"
    fused_loss: bool = True
    chunk_size: int = 1024
    micro_batch_size: int = 1


def num_parameters(model: ModelConfig) -> int:
    """Parameters of the Llama-style GPT packsft builds (embedding, layers, final norm, untied output)."""
    h, f, hn = model.hidden_size, model.ffn_hidden_size, model.head_dim
    q, kv = model.num_attention_heads * hn, model.num_query_groups * hn
    layer = h * (q + 2 * kv) + q * h + 3 * h * f + 2 * h + (q + 2 * kv if model.add_qkv_bias else 0)
    embeddings = model.vocab_size * h * (1 if model.tie_word_embeddings else 2)
    return model.num_layers * layer + embeddings + h


def static_bytes_per_parameter(layout: Layout) -> float:
    """Bytes per parameter of weights, gradients and optimizer state, before dividing by TP and PP.

    Megatron's DDP and optimizer, bf16: 2 (bf16 weight) + 4 (fp32 main grad) + 12 (fp32 master + Adam moments);
    fp32: 4 + 4 + 8 (no separate master copy), + 2 for autocast's bf16 weight copies kept from forward to backward.
    The distributed optimizer divides the optimizer part by ``DP x CP``.
    """
    weights, grads = static_weights_and_grads(layout)
    shards = layout.dp * layout.cp if layout.distributed_optimizer else 1
    return weights + grads + (12 if layout.bf16 else 8) / shards


def static_weights_and_grads(layout: Layout) -> tuple[float, float]:
    """Bytes per parameter of the weights (with autocast's bf16 copies) and of the fp32 main gradients."""
    return (2 if layout.bf16 else 4 + (2 if layout.autocast else 0)), 4


def activation_bytes_per_token(model: ModelConfig, layout: Layout) -> float:
    """Activations kept for backward per token of this rank and per layer.

    Saved in bf16 (``e`` = 2; 4 without bf16 or autocast) except the residual stream (4 bytes):
    ``2 h (4 + e)`` for the two RMSNorm inputs and outputs (divided by TP with sequence parallelism, else
    replicated) plus ``e (3 h + 2 h_kv + 4 f) / TP`` for Q, K, V, the attention output and the SwiGLU
    tensors. ``"selective"`` recompute drops the attention's saved Q, K, V (``e (h + 2 h_kv) / TP``);
    ``"full"`` keeps only each layer's fp32 input (``4 h``, divided by TP with SP), plus one recomputed
    chunk's activations during backward (added in :func:`plan`).
    """
    h, f = model.hidden_size, model.ffn_hidden_size
    h_kv = model.num_query_groups * model.head_dim
    e = 2 if (layout.bf16 or layout.autocast) else 4
    sp = layout.tp if layout.sequence_parallel else 1
    if layout.recompute == "full":
        return 4 * h / sp
    per_layer = 2 * h * (4 + e) / sp + e * (3 * h + 2 * h_kv + 4 * f) / layout.tp
    if layout.recompute == "selective":
        per_layer -= e * (h + 2 * h_kv) / layout.tp
    return per_layer


@dataclass(frozen=True)
class MemoryPlan:
    """Bytes per GPU of one layout at one row length (see :func:`plan`)."""

    parameters: int
    weights_grads_optimizer: float
    activations: float
    loss: float
    row_tokens: int
    gpu_bytes: float

    @property
    def total(self) -> float:
        """Everything the plan counts."""
        return self.weights_grads_optimizer + self.activations + self.loss

    @property
    def fits(self) -> bool:
        """True when the total stays under :data:`USABLE_FRACTION` of the GPU."""
        return self.total <= USABLE_FRACTION * self.gpu_bytes


def plan(model: ModelConfig, layout: Layout, seq_len: int, gpu_bytes: float) -> MemoryPlan:
    """Memory of ``layout`` training ``model`` on rows of ``seq_len`` tokens, on GPUs of ``gpu_bytes``.

    Activations: what every layer saves for backward (:func:`activation_bytes_per_token`), plus one
    layer's worth of activation gradients during that layer's backward (the peak is reached in backward).
    Pipeline parallelism divides the static state and the layers by ``PP``; under 1F1B the first stage keeps
    up to ``PP`` micro-batches in flight, so its activations are about those of ``num_layers / PP`` layers x
    ``PP`` micro-batches, i.e. the same as without pipelining (Megatron-LM's observation).

    ``seq_len`` is a multiple of ``2 CP`` (the training config's rule; :func:`max_seq_len` steps by it), and
    ``model`` fits ``TP`` and ``PP`` (``ModelConfig.check_parallel_fit``, the training config's rule too).
    """
    params = num_parameters(model)
    static = params * static_bytes_per_parameter(layout) / (layout.tp * layout.pp)
    tokens = layout.micro_batch_size * seq_len // layout.cp                    # this rank's tokens
    per_layer = activation_bytes_per_token(model, layout)
    one_layer = tokens * activation_bytes_per_token(model, replace(layout, recompute=None))
    # saved for backward by every layer, + one layer's activation gradients while it runs backward,
    # + (full recompute) the recomputed chunk's activations
    activations = model.num_layers * per_layer * tokens + one_layer
    if layout.recompute == "full":
        activations += layout.recompute_num_layers * one_layer
    if layout.attention_backend == "torch" and layout.cp > 1:
        h_kv = model.num_query_groups * model.head_dim
        activations += model.num_layers * 2 * 2 * h_kv / layout.tp * layout.micro_batch_size * seq_len
    e = 2 if (layout.bf16 or layout.autocast) else 0
    v_local = math.ceil(model.vocab_size / layout.tp)
    if layout.fused_loss:
        block = min(VOCAB_BLOCK, v_local)
        loss = layout.chunk_size * block * (4 + 2 * e) + tokens * model.hidden_size * 4
    else:
        loss = 12 * v_local * tokens
    return MemoryPlan(parameters=params, weights_grads_optimizer=static, activations=activations, loss=loss,
                      row_tokens=seq_len, gpu_bytes=gpu_bytes)


def max_seq_len(model: ModelConfig, layout: Layout, gpu_bytes: float) -> int:
    """The longest row that fits in memory, at most packsft's ``MAX_SEQ_LEN`` and a multiple of the row
    granularity (``2 CP`` when CP > 1, ``lcm`` with ``CP x TP`` under sequence parallelism); 0 when none does.
    ``model.max_position_embeddings`` is not applied: it bounds what a config trains, not what would fit.

    Memory is affine in the row length, ``total(L) = A + B L``, so ``L_max = (usable - A) / B`` rounded down.
    """
    step = row_granularity(layout.cp, layout.tp if layout.sequence_parallel else 1)
    one, two = plan(model, layout, step, gpu_bytes).total, plan(model, layout, 2 * step, gpu_bytes).total
    per_token = (two - one) / step
    fixed = one - per_token * step
    longest = min((USABLE_FRACTION * gpu_bytes - fixed) / per_token, MAX_SEQ_LEN)
    return max(0, int(longest) // step * step)


def layout_from_config(cfg, data_parallel_size: int) -> Layout:
    """The :class:`Layout` of a training :class:`~packsft.train.config.Config` at ``data_parallel_size`` (from
    :func:`~packsft.train.config.check_parallel_layout`, which checks the config against the world size).

    Keys: ``parallel.tensor_model_parallel_size``, ``context_parallel_size``, ``pipeline_model_parallel_size``,
    ``sequence_parallel``; ``optimizer.use_distributed_optimizer``; ``train.bf16``,
    ``autocast_dtype``; ``model.recompute_granularity``, ``recompute_num_layers``, ``attention_backend``;
    ``loss.fused_linear_cross_entropy``, ``chunk_size``; ``loader.micro_batch_size``. Keys a config does not
    have take their defaults.
    """
    par, opt, train = cfg.parallel, cfg.optimizer, cfg.train
    tp, cp = par.tensor_model_parallel_size, par.context_parallel_size
    return Layout(
        tp=tp, cp=cp, pp=getattr(par, "pipeline_model_parallel_size", 1), dp=data_parallel_size,
        distributed_optimizer=bool(getattr(opt, "use_distributed_optimizer", False)),
        bf16=bool(getattr(train, "bf16", False)),
        autocast=train.autocast_dtype is not None,
        sequence_parallel=bool(getattr(par, "sequence_parallel", False)),
        recompute=getattr(cfg.model, "recompute_granularity", None),
        recompute_num_layers=getattr(cfg.model, "recompute_num_layers", None) or 1,
        attention_backend=cfg.model.attention_backend,
        fused_loss=cfg.loss.fused_linear_cross_entropy,
        chunk_size=cfg.loss.chunk_size,
        micro_batch_size=cfg.loader.micro_batch_size,
    )


def static_breakdown(layout: Layout) -> dict[str, float]:
    """Bytes per parameter (before TP/PP) of ``weights``, ``grads`` and ``optimizer`` (see
    :func:`static_bytes_per_parameter`, whose total these add up to)."""
    weights, grads = static_weights_and_grads(layout)
    return {"weights": weights, "grads": grads, "optimizer": static_bytes_per_parameter(layout) - weights - grads}


def format_plan(p: MemoryPlan, model: ModelConfig, layout: Layout) -> str:
    """The plan for people: static memory by kind, activations with the alternatives, loss, verdict (GiB)."""
    shards = layout.tp * layout.pp
    usable = USABLE_FRACTION * p.gpu_bytes

    def gib(x: float) -> str:
        return f"{x / GiB:8.2f} GiB"

    def with_(**changes) -> MemoryPlan:
        return plan(model, replace(layout, **changes), p.row_tokens, p.gpu_bytes)

    parts = static_breakdown(layout)
    bf16 = {"bf16": True, "autocast": False}
    lines = [
        f"layout: TP={layout.tp} CP={layout.cp} PP={layout.pp} DP={layout.dp}, "
        "Megatron optimizer"
        f"{' (distributed)' if layout.distributed_optimizer else ''}, "
        f"{'bf16 params' if layout.bf16 else 'fp32 params' + (' + bf16 autocast' if layout.autocast else '')}, "
        f"SP {'on' if layout.sequence_parallel else 'off'}, recompute {layout.recompute or 'none'}, "
        f"{layout.attention_backend} attention, {'fused' if layout.fused_loss else 'stock'} loss",
        f"parameters                 : {p.parameters / 1e9:.2f} B ({p.parameters / shards / 1e9:.2f} B per GPU)",
        *(f"  {name:<25}: {gib(p.parameters * b / shards)}" for name, b in parts.items()),
        f"  static, Megatron bf16    : {gib(with_(**bf16, distributed_optimizer=False).weights_grads_optimizer)}"
        f" replicated, {gib(with_(**bf16, distributed_optimizer=True).weights_grads_optimizer)} distributed optimizer",
        f"activations, L={p.row_tokens:<9} : {gib(p.activations)}",
        f"  with full recompute      : {gib(with_(recompute='full').activations)}",
        f"  with selective recompute : {gib(with_(recompute='selective').activations)}",
        f"  with sequence parallel   : "
        f"{gib(with_(sequence_parallel=True).activations) if layout.tp > 1 else '   (needs TP > 1)'}",
        f"loss buffers               : {gib(p.loss)}",
        f"total                      : {gib(p.total)} of {usable / GiB:.1f} GiB usable -> "
        f"{'fits' if p.fits else 'does NOT fit'}",
    ]
    return "\n".join(lines)
