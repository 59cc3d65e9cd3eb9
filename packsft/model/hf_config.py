"""Hugging Face ``config.json`` <-> packsft ``ModelConfig`` (Llama, Qwen2, Qwen3, Mistral families).

:func:`model_config_from_hf` translates a transformers ``PretrainedConfig`` and refuses, with a
``ValueError`` naming the option, anything packsft's Megatron ``GPTModel`` cannot reproduce;
:func:`hf_config_from_model_config` builds the config written on export. RoPE: ``rope_theta`` ->
``rotary_base``; ``rope_type: llama3`` -> ``rope_scaling_factor``, only with the constants Megatron-Core
fixes (``MEGATRON_LLAMA3_ROPE``); ``rope_type: linear`` -> ``rope_interpolation_factor`` (Megatron
``seq_len_interpolation_factor``); ``yarn``, ``dynamic``, ``longrope`` and the rest are refused by name.
Gemma 3 is refused with the list of what the Megatron model lacks (:data:`GEMMA3_MISSING`). Sources:
transformers ``LlamaConfig`` / ``Qwen2Config`` / ``Qwen3Config`` / ``MistralConfig``; Megatron-Core
``RotaryEmbedding._apply_scaling`` and ``RotaryEmbedding.__init__`` (``seq_len_interpolation_factor``).
"""

from __future__ import annotations

from packsft.model.config import ModelConfig

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral")
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                 "mistral": "MistralForCausalLM"}
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
GEMMA3_MISSING = ("GeGLU MLP (gelu_pytorch_tanh)", "embeddings scaled by sqrt(hidden_size)",
                  "(1 + w) RMSNorm weights", "post-attention and post-feedforward norms (sandwich norms)",
                  "attention logit soft-capping", "final logit soft-capping",
                  "alternating sliding-window / global attention layers",
                  "separate RoPE bases for local and global layers", "query_pre_attn_scalar attention scale")
"""What packsft's Megatron GPT model would need to reproduce Gemma 3 text models (``Gemma3ForCausalLM``)."""
QWEN_MAX_WINDOW_LAYERS = 28
"""``Qwen2Config`` / ``Qwen3Config``'s default ``max_window_layers`` (for a ``config.json`` that omits it)."""
TOKEN_ID_FIELDS = ("bos_token_id", "eos_token_id", "pad_token_id")
"""The special-token ids of an exported ``config.json`` that the tokenizer supplies when the HF config does not."""
FIXED_OPTIONS = {
    "hidden_act": ("silu", "packsft's MLP is SwiGLU (silu)"),
    "attention_bias": (False, "packsft's attention has no biases but Qwen2's QKV one"),   # Llama options
    "mlp_bias": (False, "packsft's MLP has no biases"),
    "pretraining_tp": (1, "expected 1"),
    "attention_dropout": (0.0, "packsft trains without dropout, set it to 0.0"),
}
"""HF options and the one value packsft's Megatron model reproduces (an absent one has it), with the reason."""
# Megatron's fixed Llama-3.1 scaling constants (megatron.core RotaryEmbedding._apply_scaling).
MEGATRON_LLAMA3_ROPE = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def _rope_parameters(hf_config) -> dict:
    """``rope_parameters`` (transformers 5) or the older ``rope_theta`` + ``rope_scaling`` pair, as one dict."""
    params = dict(getattr(hf_config, "rope_parameters", None) or {})
    scaling = getattr(hf_config, "rope_scaling", None) or {}
    params = {**scaling, **params}
    params.setdefault("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    params.setdefault("rope_type", params.get("type", "default"))
    return params


def _rope_scaling_factor(hf_config) -> float | None:
    """Megatron ``rope_scaling_factor`` for the config's RoPE type, or ``None`` for plain RoPE.

    Raises:
        ValueError: for a RoPE type other than ``default`` / ``linear`` / ``llama3``, or ``llama3`` with constants
            Megatron cannot express (it fixes low 1, high 4, original 8192).
    """
    rope = _rope_parameters(hf_config)
    if rope["rope_type"] in ("default", "linear"):
        return None
    if rope["rope_type"] != "llama3":
        raise ValueError(f"unsupported rope_parameters.rope_type {rope['rope_type']!r}; packsft supports "
                         f"{SUPPORTED_ROPE_TYPES} (Megatron-Core's GPT RoPE has no {rope['rope_type']!r} scaling)")
    for key, expected in MEGATRON_LLAMA3_ROPE.items():
        if float(rope.get(key, expected)) != expected:
            raise ValueError(f"unsupported llama3 RoPE scaling: rope_parameters.{key} = {rope.get(key)!r}, "
                             f"Megatron-Core fixes it at {expected}")
    return float(rope["factor"])


def _rope_interpolation_factor(hf_config) -> float | None:
    """``rope_type: linear``'s ``factor`` (positions divided by it), else ``None``."""
    rope = _rope_parameters(hf_config)
    return float(rope["factor"]) if rope["rope_type"] == "linear" else None


def _refuse_unsupported(hf_config, max_seq_len: int | None) -> None:
    """Raise ``ValueError`` naming the first HF option packsft's Megatron model cannot reproduce."""
    model_type = getattr(hf_config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        gemma3 = model_type in ("gemma3", "gemma3_text")
        raise ValueError(f"unsupported model_type {model_type!r}" + (
            " (Gemma 3): packsft's Megatron GPT model lacks " + "; ".join(GEMMA3_MISSING) if gemma3
            else f"; supported: {SUPPORTED_MODEL_TYPES}"))
    for name, (value, why) in FIXED_OPTIONS.items():
        if getattr(hf_config, name, value) != value:
            raise ValueError(f"unsupported {name}={getattr(hf_config, name)!r} for model_type {model_type!r}: {why}")
    window = sliding_window(hf_config)
    if window is not None and window < hf_config.max_position_embeddings:
        if max_seq_len is None or max_seq_len > window:
            raise ValueError(
                f"unsupported sliding_window={window} (< max_position_embeddings="
                f"{hf_config.max_position_embeddings}) on {_windowed_layers(hf_config)}: packsft attention is full "
                f"causal, which equals the model's only when no conversation is longer than the window; pass "
                f"max_seq_len <= {window} (got {max_seq_len}) or set sliding_window to null")


def _get(hf_config, key: str, default=None):
    """A field of a ``PretrainedConfig`` or of its ``to_dict()``."""
    return hf_config.get(key, default) if isinstance(hf_config, dict) else getattr(hf_config, key, default)


def _windowed_layer_types(hf_config) -> list[str]:
    """Each layer's attention type as transformers builds it: ``layer_types`` where the config has it, else (a
    config saved by transformers 4) Qwen2/Qwen3's rule, ``sliding_attention`` for layers ``>= max_window_layers``
    when ``use_sliding_window``, and every layer for a Mistral with a ``sliding_window``."""
    n = _get(hf_config, "num_hidden_layers") or 0
    layer_types = _get(hf_config, "layer_types")
    if layer_types:
        return list(layer_types)
    model_type, window = _get(hf_config, "model_type"), _get(hf_config, "sliding_window")
    if model_type == "mistral" and window is not None:
        return ["sliding_attention"] * n
    if model_type in ("qwen2", "qwen3") and window is not None and _get(hf_config, "use_sliding_window", False):
        first = _get(hf_config, "max_window_layers", QWEN_MAX_WINDOW_LAYERS)
        return ["sliding_attention" if i >= first else "full_attention" for i in range(n)]
    return ["full_attention"] * n


def _windowed_layers(hf_config) -> str:
    layers = [i for i, t in enumerate(_windowed_layer_types(hf_config)) if t == "sliding_attention"]
    return f"layer{'s' * (len(layers) > 1)} {layers[0]}" + (f"-{layers[-1]}" if len(layers) > 1 else "")


def sliding_window(hf_config) -> int | None:
    """The ``sliding_window`` some layer of the model attends within, else None (``hf_config``: a
    ``PretrainedConfig`` or its ``to_dict()``).

    A Mistral's window applies to every layer; a Qwen2/Qwen3's only with ``use_sliding_window`` and only to the
    layers from ``max_window_layers`` on (transformers' ``layer_types``), so ``max_window_layers >=
    num_hidden_layers`` is full attention everywhere.

    Raises:
        ValueError: when a layer is ``sliding_attention`` but the config has no ``sliding_window``.
    """
    if "sliding_attention" not in _windowed_layer_types(hf_config):
        return None
    window = _get(hf_config, "sliding_window")
    if window is None:
        off = " (use_sliding_window is false)" if _get(hf_config, "use_sliding_window") is False else ""
        raise ValueError(f"layer_types has sliding_attention layers but sliding_window is null{off}: the layers' "
                         "attention is ambiguous; set their layer_types to full_attention (or give the window)")
    return int(window)


def full_attention_length(hf_config: dict) -> int | None:
    """The model's :func:`sliding_window` when smaller than its ``max_position_embeddings`` (``hf_config``: the
    ``config.json`` dict), else None: the longest row on which packsft's full causal attention equals the model's
    (an import records it as ``max_position_embeddings``; training refuses a longer ``data.max_seq_len``)."""
    window, limit = sliding_window(hf_config), hf_config.get("max_position_embeddings")
    return window if window is not None and limit is not None and window < limit else None


def model_config_from_hf(hf_config, *, max_seq_len: int | None = None, attention_backend: str = "torch",
                         params_dtype: str = "float32") -> ModelConfig:
    """Translate a transformers ``Llama/Qwen2/Qwen3/MistralConfig`` into a ``ModelConfig``.

    Args:
        hf_config: a transformers ``PretrainedConfig`` of a supported ``model_type``.
        max_seq_len: the longest row packsft will train on (tokens); only needed to accept a
            :func:`sliding_window` (Mistral; Qwen2/Qwen3 layers from ``max_window_layers``) smaller than
            ``max_position_embeddings`` (then it must be ``<= window``, and the
            result's ``max_position_embeddings`` is the window, so that training refuses longer rows).
        attention_backend / params_dtype: as in ``ModelConfig``.

    Raises:
        ValueError: naming the option when the config uses something the Megatron model cannot
            reproduce: another ``model_type``, a ``hidden_act`` other than silu, ``attention_bias`` /
            ``mlp_bias`` on Llama / Qwen3, ``pretraining_tp`` > 1, ``attention_dropout`` > 0, a sliding window
            that can be reached, RoPE types other than default/linear/llama3 (Megatron's constants), Gemma 3
            (the message lists :data:`GEMMA3_MISSING`).
    """
    _refuse_unsupported(hf_config, max_seq_len)
    head_dim = getattr(hf_config, "head_dim", None)
    default_head_dim = hf_config.hidden_size // hf_config.num_attention_heads
    return ModelConfig(
        num_layers=hf_config.num_hidden_layers,
        hidden_size=hf_config.hidden_size,
        ffn_hidden_size=hf_config.intermediate_size,
        num_attention_heads=hf_config.num_attention_heads,
        num_query_groups=getattr(hf_config, "num_key_value_heads", None) or hf_config.num_attention_heads,
        vocab_size=hf_config.vocab_size,
        max_position_embeddings=full_attention_length(hf_config.to_dict()) or hf_config.max_position_embeddings,
        kv_channels=head_dim if head_dim and head_dim != default_head_dim else None,
        rotary_base=float(_rope_parameters(hf_config)["rope_theta"]),
        norm_epsilon=float(hf_config.rms_norm_eps),
        tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
        add_qkv_bias=hf_config.model_type == "qwen2",
        qk_layernorm=hf_config.model_type == "qwen3",
        rope_scaling_factor=_rope_scaling_factor(hf_config),
        rope_interpolation_factor=_rope_interpolation_factor(hf_config),
        attention_backend=attention_backend,
        params_dtype=params_dtype,
    )


def hf_config_from_model_config(cfg: ModelConfig, base=None, token_ids: dict | None = None):
    """The transformers config that describes ``cfg``, for export.

    Args:
        cfg: the Megatron model's configuration.
        base: the original HF config (``PretrainedConfig`` or its ``to_dict()``) to keep model_type,
            token ids, sliding window and other metadata from; ``None`` builds a fresh ``Qwen2Config``
            when ``cfg.add_qkv_bias``, a ``Qwen3Config`` when ``cfg.qk_layernorm``, else a ``LlamaConfig``.
        token_ids: ``{field: id or None}`` for :data:`TOKEN_ID_FIELDS` (the export tokenizer's,
            ``hf_io.tokenizer_token_ids``), written where ``base`` lacks the field or holds null; a None
            there replaces the config class's default (``LlamaConfig``'s bos 1 / eos 2). Without it the
            fields the base lacks keep the class defaults.

    Returns:
        ``PretrainedConfig`` with ``architectures`` set and the shape fields taken from ``cfg``;
        ``max_position_embeddings`` is the larger of ``cfg``'s and the base's (a run that trained with a shorter
        ``model.max_position_embeddings`` keeps the original model's context).

    Raises:
        ValueError: the base's ``model_type`` is not one packsft exports (``ARCHITECTURES``); transformers refuses
            the merged config (one line: e.g. a base of another model, whose ``layer_types`` has another length
            than ``cfg.num_layers``); or the result does not describe ``cfg`` (:func:`_check_describes`: e.g.
            ``cfg.add_qkv_bias`` or ``cfg.qk_layernorm`` against a base of another family: only Qwen2 has the
            bias, only Qwen3 the q/k norms).
    """
    from transformers import AutoConfig

    try:
        from huggingface_hub.errors import StrictDataclassError  # transformers 5's config validation
    except ImportError:  # an older huggingface_hub: transformers raises ValueError
        StrictDataclassError = ValueError  # noqa: N806

    base = base.to_dict() if hasattr(base, "to_dict") else dict(base or {})
    model_type = base.get("model_type") or ("qwen2" if cfg.add_qkv_bias else "qwen3" if cfg.qk_layernorm else "llama")
    if model_type not in ARCHITECTURES:
        raise ValueError(f"model_type {model_type!r} cannot be exported; packsft writes {', '.join(ARCHITECTURES)} "
                         "configs (the HF config of another model?)")
    for key in ("model_type", "transformers_version", "architectures", "rope_scaling", "rope_theta"):
        base.pop(key, None)
    for key, value in (token_ids or {}).items():
        if base.get(key) is None:
            base[key] = value
    rope = {"rope_type": "default", "rope_theta": cfg.rotary_base}
    if cfg.rope_scaling_factor is not None:
        rope = {**rope, "rope_type": "llama3", "factor": cfg.rope_scaling_factor, **MEGATRON_LLAMA3_ROPE}
    if cfg.rope_interpolation_factor is not None:
        rope = {**rope, "rope_type": "linear", "factor": cfg.rope_interpolation_factor}
    shape = dict(num_hidden_layers=cfg.num_layers, hidden_size=cfg.hidden_size,
                 intermediate_size=cfg.ffn_hidden_size, num_attention_heads=cfg.num_attention_heads,
                 num_key_value_heads=cfg.num_query_groups, vocab_size=cfg.vocab_size,
                 max_position_embeddings=max(cfg.max_position_embeddings, base.get("max_position_embeddings") or 0),
                 head_dim=cfg.head_dim,
                 rms_norm_eps=cfg.norm_epsilon, tie_word_embeddings=cfg.tie_word_embeddings,
                 rope_parameters=rope, hidden_act="silu", dtype=cfg.params_dtype)
    if cfg.kv_channels is None and "head_dim" not in base and model_type != "qwen3":
        del shape["head_dim"]   # Qwen2Config has no head_dim field; Qwen3Config's default is 128, not h / np
    try:
        hf_config = AutoConfig.for_model(model_type, **{**base, **shape})
    except (ValueError, TypeError, KeyError, StrictDataclassError) as err:   # transformers' own validation
        detail = err.__cause__ or err      # huggingface_hub's validation error wraps the validator's message
        raise ValueError(f"transformers refuses the {model_type} config.json built from it and the model config: "
                         f"{' '.join(str(detail).split())} (the HF config of another model?)") from None
    hf_config.architectures = [ARCHITECTURES[model_type]]
    _check_describes(hf_config, cfg)
    return hf_config


_DESCRIBED = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups", "vocab_size",
              "head_dim", "rotary_base", "norm_epsilon", "tie_word_embeddings", "add_qkv_bias", "qk_layernorm",
              "rope_scaling_factor", "rope_interpolation_factor")
"""The ``ModelConfig`` fields an exported ``config.json`` must give back when imported (the computation's shape)."""


def _check_describes(hf_config, cfg: ModelConfig) -> None:
    """Refuse an export config that transformers would run differently from ``cfg``: it is read back as an import
    reads one (:func:`model_config_from_hf`, which refuses fields of the base config that change the computation:
    a reachable sliding window, attention biases, ...) and compared on :data:`_DESCRIBED`.

    Raises:
        ValueError: naming the field(s), one line.
    """
    try:
        back = model_config_from_hf(hf_config, max_seq_len=cfg.max_position_embeddings)
        differ = [f"{f}: {getattr(back, f)!r} against the model's {getattr(cfg, f)!r}" for f in _DESCRIBED
                  if getattr(back, f) != getattr(cfg, f)]
        why = f" ({'; '.join(differ)})" if differ else None
    except ValueError as err:
        why = f": {err}"
    if why:
        raise ValueError(f"the exported config.json would not describe the trained model{why}")
