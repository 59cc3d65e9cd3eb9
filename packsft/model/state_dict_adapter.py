"""HF ``*ForCausalLM`` state dict <-> Megatron ``GPTModel`` state dicts, one per TP rank (pure tensors, no I/O).

Shape legend: ``h`` hidden size, ``np`` query heads, ``ng`` key/value groups, ``qpg = np // ng`` query
heads per group, ``hn`` head dimension, ``f`` SwiGLU width, ``v`` vocabulary, ``tp`` tensor-parallel size.

Tensor layouts (Megatron-Core 0.16.1 local spec, what :func:`packsft.model.gpt.build_gpt_model` builds)::

    HF (transformers LlamaForCausalLM & co.)          Megatron GPTModel, TP rank r of tp
    model.embed_tokens.weight        [v, h]           embedding.word_embeddings.weight      rows r*v/tp..
    model.layers.i.input_layernorm.weight   [h]       decoder.layers.i.input_layernorm.weight   (replicated)
    self_attn.q_proj/k_proj/v_proj   [np*hn|ng*hn, h] decoder.layers.i.self_attention.linear_qkv.weight
                                                          [ng/tp * (qpg + 2) * hn, h], per query group
                                                          [q_g (qpg*hn rows), k_g (hn), v_g (hn)], groups
                                                          r*ng/tp.. (Qwen2: .bias alike, [.. * hn])
    self_attn.q_norm/k_norm.weight   [hn] (Qwen3)     self_attention.q_layernorm/k_layernorm.weight (replicated)
    self_attn.o_proj.weight          [h, np*hn]       self_attention.linear_proj.weight  [h, np*hn/tp] (cols)
    post_attention_layernorm.weight  [h]              decoder.layers.i.pre_mlp_layernorm.weight (replicated)
    mlp.gate_proj / up_proj.weight   [f, h] each      mlp.linear_fc1.weight [2f/tp, h] = cat(gate_r, up_r)
    mlp.down_proj.weight             [h, f]           mlp.linear_fc2.weight  [h, f/tp] (cols)
    model.norm.weight                [h]              decoder.final_layernorm.weight (replicated)
    lm_head.weight                   [v, h]           output_layer.weight  rows r*v/tp.. (absent when tied)

With ``attention_backend="te"`` the two per-layer norms are fused into the linears and are named
``self_attention.linear_qkv.layer_norm_weight`` and ``mlp.linear_fc1.layer_norm_weight``.
HF q/k weights are already in the "rotate half" RoPE layout that Megatron uses
(``rotary_interleaved=False``), so no permutation is needed. Sources: transformers
``modeling_llama.py`` / ``modeling_qwen2.py`` / ``modeling_qwen3.py``; Megatron-Core ``transformer/attention.py``
(``get_query_key_value_tensors``) and ``transformer/mlp.py`` (``glu``: ``silu(x[:f]) * x[f:]``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from packsft.model.config import ModelConfig


def _norm_keys(cfg: ModelConfig, i: int) -> tuple[str, str]:
    """Megatron names of layer ``i``'s attention and MLP RMSNorm weights for ``cfg.attention_backend``."""
    p = f"decoder.layers.{i}."
    if cfg.attention_backend == "te":
        return p + "self_attention.linear_qkv.layer_norm_weight", p + "mlp.linear_fc1.layer_norm_weight"
    return p + "input_layernorm.weight", p + "pre_mlp_layernorm.weight"


def _shard(t: Tensor, dim: int, tp_rank: int, tp_size: int) -> Tensor:
    """Slice ``tp_rank`` of ``tp_size`` equal parts along ``dim`` (divisible: ``ModelConfig.to_transformer_config``
    and Megatron's layers check the sizes), as a fresh contiguous tensor."""
    return t.chunk(tp_size, dim=dim)[tp_rank].clone()


def _pack_qkv(q: Tensor, k: Tensor, v: Tensor, cfg: ModelConfig, tp_rank: int, tp_size: int) -> Tensor:
    """HF q ``[np*hn, *]``, k/v ``[ng*hn, *]`` -> Megatron ``[ng/tp * (qpg+2) * hn, *]`` (weight or bias)."""
    ng, hn = cfg.num_query_groups, cfg.head_dim
    qpg = cfg.num_attention_heads // ng
    rest = q.shape[1:]
    grouped = torch.cat([q.reshape(ng, qpg * hn, *rest), k.reshape(ng, hn, *rest), v.reshape(ng, hn, *rest)], 1)
    return _shard(grouped, 0, tp_rank, tp_size).reshape(-1, *rest)


def _unpack_qkv(shards: Sequence[Tensor], cfg: ModelConfig) -> tuple[Tensor, Tensor, Tensor]:
    """Inverse of :func:`_pack_qkv` over all TP shards (in rank order): returns HF ``(q, k, v)``."""
    ng, hn = cfg.num_query_groups, cfg.head_dim
    qpg = cfg.num_attention_heads // ng
    full = torch.cat(list(shards), 0)
    rest = full.shape[1:]
    q, k, v = full.reshape(ng, (qpg + 2) * hn, *rest).split([qpg * hn, hn, hn], dim=1)
    return q.reshape(-1, *rest), k.reshape(-1, *rest), v.reshape(-1, *rest)


def hf_tensor_shape(name: str, cfg: ModelConfig) -> tuple[int, ...] | None:
    """The full shape ``cfg`` implies for the HF tensor ``name`` (layouts above), or None for a name a model of
    ``cfg`` does not have (a layer beyond ``num_layers``, QKV biases without ``add_qkv_bias``, q/k norms without
    ``qk_layernorm``, any other name). ``lm_head.weight`` has a shape even when tied (it is read, to be compared)."""
    top, layer = _hf_shapes(cfg)
    if name in top:
        return top[name]
    parts = name.split(".", 3)
    if len(parts) != 4 or parts[:2] != ["model", "layers"] or not parts[2].isdigit() or int(parts[2]) >= cfg.num_layers:
        return None
    return layer.get(parts[3])


def hf_tensor_names(cfg: ModelConfig) -> list[str]:
    """Every HF tensor name a checkpoint of ``cfg`` must hold (:func:`hf_tensor_shape` gives their shapes):
    ``lm_head.weight`` only when the embeddings are not tied."""
    top, layer = _hf_shapes(cfg)
    names = [n for n in top if n != "lm_head.weight" or not cfg.tie_word_embeddings]
    return names + [f"model.layers.{i}.{suffix}" for i in range(cfg.num_layers) for suffix in layer]


def _hf_shapes(cfg: ModelConfig) -> tuple[dict[str, tuple[int, ...]], dict[str, tuple[int, ...]]]:
    """``(top-level name -> shape, per-layer name suffix -> shape)`` of the HF tensors of ``cfg``."""
    h, v, f, hn = cfg.hidden_size, cfg.vocab_size, cfg.ffn_hidden_size, cfg.head_dim
    q, kv = cfg.num_attention_heads * hn, cfg.num_query_groups * hn
    top = {"model.embed_tokens.weight": (v, h), "lm_head.weight": (v, h), "model.norm.weight": (h,)}
    layer = {"input_layernorm.weight": (h,), "post_attention_layernorm.weight": (h,),
             "self_attn.q_proj.weight": (q, h), "self_attn.k_proj.weight": (kv, h), "self_attn.v_proj.weight": (kv, h),
             "self_attn.o_proj.weight": (h, q),
             "mlp.gate_proj.weight": (f, h), "mlp.up_proj.weight": (f, h), "mlp.down_proj.weight": (h, f)}
    if cfg.add_qkv_bias:
        layer.update({"self_attn.q_proj.bias": (q,), "self_attn.k_proj.bias": (kv,), "self_attn.v_proj.bias": (kv,)})
    if cfg.qk_layernorm:
        layer.update({"self_attn.q_norm.weight": (hn,), "self_attn.k_norm.weight": (hn,)})
    return top, layer


def hf_to_megatron_state_dict(hf_state: dict[str, Tensor], cfg: ModelConfig, tp_rank: int = 0,
                              tp_size: int = 1, *, layers: Sequence[int] | None = None, embedding: bool = True,
                              head: bool = True) -> dict[str, Tensor]:
    """TP rank ``tp_rank``'s Megatron state dict from a full HF ``*ForCausalLM`` state dict (layouts above).

    Args:
        hf_state: HF names -> full tensors (any float dtype, kept). ``lm_head.weight`` is ignored when
            ``cfg.tie_word_embeddings``. Only the tensors of the requested parts need to be present.
        cfg: the model configuration (``model_config_from_hf``).
        tp_rank / tp_size: this rank's tensor-parallel index and the TP size.
        layers: the (0-based, global) decoder layers to convert (default: all ``cfg.num_layers``).
        embedding / head: convert the word embedding / the final norm and (untied) output layer; a pipeline
            stage's part is ``layers`` = its global layer numbers, ``embedding`` = first stage, ``head`` = last.

    Returns:
        Megatron parameter names (global layer numbers) -> fresh tensors of this rank's shard (no
        ``_extra_state`` entries).

    Raises:
        KeyError: naming a missing HF tensor (``check_hf_weight_files`` names it first for a checkpoint folder).
    """
    def get(name: str) -> Tensor:
        return hf_state[name]

    out = {}
    if embedding:
        out["embedding.word_embeddings.weight"] = _shard(get("model.embed_tokens.weight"), 0, tp_rank, tp_size)
    if head:
        out["decoder.final_layernorm.weight"] = get("model.norm.weight").clone()
        if not cfg.tie_word_embeddings:
            out["output_layer.weight"] = _shard(get("lm_head.weight"), 0, tp_rank, tp_size)
    for i in range(cfg.num_layers) if layers is None else layers:
        hf, mg = f"model.layers.{i}.", f"decoder.layers.{i}."
        attn_norm, mlp_norm = _norm_keys(cfg, i)
        out[attn_norm] = get(hf + "input_layernorm.weight").clone()
        out[mlp_norm] = get(hf + "post_attention_layernorm.weight").clone()
        for kind in ("weight", "bias") if cfg.add_qkv_bias else ("weight",):
            q, k, v = (get(f"{hf}self_attn.{n}_proj.{kind}") for n in "qkv")
            out[f"{mg}self_attention.linear_qkv.{kind}"] = _pack_qkv(q, k, v, cfg, tp_rank, tp_size)
        if cfg.qk_layernorm:
            for n in "qk":
                out[f"{mg}self_attention.{n}_layernorm.weight"] = get(f"{hf}self_attn.{n}_norm.weight").clone()
        out[mg + "self_attention.linear_proj.weight"] = _shard(get(hf + "self_attn.o_proj.weight"), 1, tp_rank,
                                                               tp_size)
        gate = _shard(get(hf + "mlp.gate_proj.weight"), 0, tp_rank, tp_size)
        up = _shard(get(hf + "mlp.up_proj.weight"), 0, tp_rank, tp_size)
        out[mg + "mlp.linear_fc1.weight"] = torch.cat([gate, up], 0)
        out[mg + "mlp.linear_fc2.weight"] = _shard(get(hf + "mlp.down_proj.weight"), 1, tp_rank, tp_size)
    return out


def megatron_to_hf_state_dict(shards: Sequence[dict[str, Tensor]], cfg: ModelConfig) -> dict[str, Tensor]:
    """Full HF state dict from every TP rank's Megatron state dict (``shards[r]`` = rank ``r``; layouts above).

    ``_extra_state`` entries are ignored. With ``cfg.tie_word_embeddings`` no ``lm_head.weight`` is
    written (transformers ties it to ``model.embed_tokens.weight`` on load).

    Returns:
        HF names -> contiguous tensors in the shards' dtype.

    Raises:
        KeyError: naming a Megatron tensor missing from a shard.
    """
    def cat(name: str, dim: int) -> Tensor:
        return torch.cat([s[name] for s in shards], dim).contiguous()

    first = shards[0]
    out = {"model.embed_tokens.weight": cat("embedding.word_embeddings.weight", 0),
           "model.norm.weight": first["decoder.final_layernorm.weight"].clone()}
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = cat("output_layer.weight", 0)
    for i in range(cfg.num_layers):
        hf, mg = f"model.layers.{i}.", f"decoder.layers.{i}."
        attn_norm, mlp_norm = _norm_keys(cfg, i)
        out[hf + "input_layernorm.weight"] = first[attn_norm].clone()
        out[hf + "post_attention_layernorm.weight"] = first[mlp_norm].clone()
        for kind in ("weight", "bias") if cfg.add_qkv_bias else ("weight",):
            name = f"{mg}self_attention.linear_qkv.{kind}"
            cat(name, 0)  # presence check on every rank
            q, k, v = _unpack_qkv([s[name] for s in shards], cfg)
            for n, t in zip("qkv", (q, k, v)):
                out[f"{hf}self_attn.{n}_proj.{kind}"] = t.contiguous()
        if cfg.qk_layernorm:
            for n in "qk":
                out[f"{hf}self_attn.{n}_norm.weight"] = first[f"{mg}self_attention.{n}_layernorm.weight"].clone()
        out[hf + "self_attn.o_proj.weight"] = cat(mg + "self_attention.linear_proj.weight", 1)
        cat(mg + "mlp.linear_fc1.weight", 0)
        gate_up = [s[mg + "mlp.linear_fc1.weight"].chunk(2, 0) for s in shards]
        out[hf + "mlp.gate_proj.weight"] = torch.cat([g for g, _ in gate_up], 0).contiguous()
        out[hf + "mlp.up_proj.weight"] = torch.cat([u for _, u in gate_up], 0).contiguous()
        out[hf + "mlp.down_proj.weight"] = cat(mg + "mlp.linear_fc2.weight", 1)
    return out


LORA_HF_MODULES = {"linear_qkv": ("self_attn", ("q_proj", "k_proj", "v_proj")),
                   "linear_proj": ("self_attn", ("o_proj",)),
                   "linear_fc1": ("mlp", ("gate_proj", "up_proj")), "linear_fc2": ("mlp", ("down_proj",))}
"""Megatron LoRA target -> (HF submodule, the HF linears it fuses): the PEFT adapter's ``target_modules``."""


def megatron_lora_to_peft_state_dict(shards: Sequence[dict[str, Tensor]], cfg: ModelConfig,
                                     target_modules: Sequence[str]) -> dict[str, Tensor]:
    """A PEFT ``adapter_model.safetensors`` state dict from every TP rank's LoRA Megatron state dict.

    Fused Megatron targets become one LoRA per HF linear with the same ``A`` (``[r, h]``): ``linear_qkv``'s
    ``B`` ``[ng/tp * (qpg+2) * hn, r]`` per rank is un-interleaved into q/k/v (as the weight), ``linear_fc1``'s
    ``[2f/tp, r]`` split into gate/up; ``linear_proj`` / ``linear_fc2``'s ``A`` ``[r, in/tp]`` are concatenated
    along columns. ``B_hf @ A_hf`` is then exactly the matching rows/columns of the Megatron delta.

    Returns:
        ``base_model.model.model.layers.{i}.<submodule>.<linear>.lora_{A,B}.weight`` -> tensors.

    Raises:
        KeyError: naming an adapter tensor missing from a shard.
    """
    out = {}
    for i in range(cfg.num_layers):
        for target in target_modules:
            sub, linears = LORA_HF_MODULES[target]
            mg = f"decoder.layers.{i}.{'self_attention' if sub == 'self_attn' else 'mlp'}.{target}."
            a_name, b_name = mg + "lora_A.default.weight", mg + "lora_B.default.weight"
            if target in ("linear_proj", "linear_fc2"):
                a_parts = [torch.cat([s[a_name] for s in shards], 1)]
                b_parts = [shards[0][b_name]]
            elif target == "linear_qkv":
                a_parts = [shards[0][a_name]] * 3
                b_parts = list(_unpack_qkv([s[b_name] for s in shards], cfg))
            else:
                halves = [s[b_name].chunk(2, 0) for s in shards]
                a_parts = [shards[0][a_name]] * 2
                b_parts = [torch.cat([g for g, _ in halves], 0), torch.cat([u for _, u in halves], 0)]
            for linear, a, b in zip(linears, a_parts, b_parts):
                hf = f"base_model.model.model.layers.{i}.{sub}.{linear}."
                out[hf + "lora_A.weight"] = a.contiguous().clone()
                out[hf + "lora_B.weight"] = b.contiguous().clone()
    return out
