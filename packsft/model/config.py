"""Llama-style model configuration, its ``model_config.json`` file and its Megatron-Core ``TransformerConfig``.

The architecture is fixed to what Llama, Qwen2, Qwen3, Mistral and SmolLM2 share: RMSNorm, SwiGLU MLP
(``gated_linear_unit`` + SiLU), rotary position embeddings, grouped-query attention, no biases and
optionally tied input/output embeddings. Everything that varies between those families is a field
(QKV bias, per-head q/k RMSNorm, head dimension, RoPE scaling).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import ClassVar

import torch
import torch.nn.functional as F

from packsft.config_rules import (
    FINITE_POSITIVE,
    POSITIVE_INT,
    Exclusive,
    Needs,
    at_most,
    build_config,
    check_fields,
    config_errors,
    distinct_names,
    multiple_of,
    one_of,
    rules,
)
from packsft.io import read_json_object

ATTENTION_BACKENDS = ("torch", "te")
RECOMPUTE_GRANULARITIES = ("selective", "full")
RECOMPUTE_METHODS = ("uniform", "block")
RECOMPUTE_MODULES = ("core_attn", "mlp")
"""Megatron ``recompute_modules`` packsft accepts: the MoE / MLA ones do not apply to a dense Llama layer, and
``layernorm`` goes through ``tensor_parallel.CheckpointWithoutOutput``, whose constructor in megatron-core 0.16.1
always takes its fp8 path (``FP8GlobalStateManager``) and so fails without TransformerEngine."""
PARAMS_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
MODEL_CONFIG_FILE = "model_config.json"
"""The ``ModelConfig`` fields (``dataclasses.asdict``) in a model-only Megatron checkpoint folder."""
VISION_CONFIG_FILE = "vision_config.json"
"""Beside it for a LLaVA model: ``packsft.model.vlm.VisionConfig``'s fields and ``image_token_id`` (the trainer's
``vision:`` section)."""


@dataclass
class ModelConfig:
    """Shape of a Llama-style decoder (sizes in elements, not bytes).

    Attributes:
        num_layers: number of transformer layers.
        hidden_size: width ``h`` of the residual stream.
        ffn_hidden_size: width of the SwiGLU MLP (each of the gate and up projections).
        num_attention_heads: query heads ``np``.
        num_query_groups: key/value heads ``ng`` (GQA); equal to ``num_attention_heads`` for MHA.
        vocab_size: rows of the embedding and output weight, before any padding.
        max_position_embeddings: longest position the RoPE table is built for (tokens).
        kv_channels: head dimension ``hn``; ``None`` means ``hidden_size // num_attention_heads``.
        rotary_base: RoPE theta (10000 for Llama-2, 500000 for Llama-3, 1e6 for Qwen2).
        norm_epsilon: RMSNorm epsilon.
        tie_word_embeddings: share the input embedding with the output layer.
        add_qkv_bias: give the fused QKV projection a bias (Qwen2); every other linear stays bias-free.
        qk_layernorm: RMSNorm over each query and key head (``[hn]`` weights) before RoPE (Qwen3; Megatron's
            ``qk_layernorm``, the layer spec's ``q_layernorm`` / ``k_layernorm``).
        rope_interpolation_factor: linear RoPE scaling (HF ``rope_type: linear``): positions divided by it
            (Megatron ``seq_len_interpolation_factor``); ``None`` means none. Exclusive with
            ``rope_scaling_factor``.
        rope_scaling_factor: Llama-3.1-style RoPE frequency scaling factor (Megatron ``rope_scaling``,
            with its fixed ``low_freq_factor=1``, ``high_freq_factor=4``,
            ``original_max_position_embeddings=8192``); ``None`` means no scaling.
        attention_backend: ``"torch"`` (packsft's SDPA core attention, runs on CPU) or ``"te"``
            (TransformerEngine; GPU only).
        params_dtype: ``"float32"`` or ``"bfloat16"`` (Megatron ``params_dtype`` + ``bf16``). With the
            ``torch`` backend the linear and embedding weights take it, while the local spec's RMSNorm
            weights stay fp32 (``WrappedTorchNorm`` ignores ``params_dtype``).
        init_method_std: standard deviation of the normal weight init.
        bias_activation_fusion: Megatron's fused SwiGLU (``bias_swiglu_impl``: ``torch.compile``d, works without
            TransformerEngine; needs Triton on CUDA, a C++ compiler on CPU). Same values as unfused; shapes no weight.
        recompute_granularity: activation recompute (Megatron's names): ``None`` (keep every activation),
            ``"selective"`` (recompute the ``recompute_modules`` of every layer in backward) or ``"full"``
            (keep only each recomputed layer's input; rerun the layer in backward). Training mode only.
        recompute_method: with ``"full"`` only, required: ``"uniform"`` (checkpoint chunks of
            ``recompute_num_layers`` layers, all layers recomputed) or ``"block"`` (recompute the first
            ``recompute_num_layers`` layers, keep the rest's activations).
        recompute_num_layers: with ``"full"`` only, required: 1 to ``num_layers``.
        recompute_modules: with ``"selective"`` only: a non-empty subset of :data:`RECOMPUTE_MODULES`;
            ``None`` means Megatron's default ``["core_attn"]``.
    """

    num_layers: int = field(metadata=rules(POSITIVE_INT))
    hidden_size: int = field(metadata=rules(POSITIVE_INT))
    ffn_hidden_size: int = field(metadata=rules(POSITIVE_INT))
    num_attention_heads: int = field(metadata=rules(POSITIVE_INT))
    num_query_groups: int = field(metadata=rules(POSITIVE_INT))
    vocab_size: int = field(metadata=rules(POSITIVE_INT))
    max_position_embeddings: int = field(metadata=rules(POSITIVE_INT))
    kv_channels: int | None = field(default=None, metadata=rules(POSITIVE_INT))
    rotary_base: float = field(default=10000.0, metadata=rules(FINITE_POSITIVE))
    norm_epsilon: float = field(default=1e-5, metadata=rules(FINITE_POSITIVE))
    tie_word_embeddings: bool = False
    add_qkv_bias: bool = False
    qk_layernorm: bool = False
    rope_interpolation_factor: float | None = field(default=None, metadata=rules(FINITE_POSITIVE))
    rope_scaling_factor: float | None = field(default=None, metadata=rules(FINITE_POSITIVE))
    attention_backend: str = field(default="torch", metadata=rules(one_of(ATTENTION_BACKENDS)))
    params_dtype: str = field(default="float32", metadata=rules(one_of(PARAMS_DTYPES)))
    init_method_std: float = field(default=0.02, metadata=rules(FINITE_POSITIVE))
    bias_activation_fusion: bool = False
    recompute_granularity: str | None = field(default=None, metadata=rules(one_of(RECOMPUTE_GRANULARITIES)))
    recompute_method: str | None = field(default=None, metadata=rules(one_of(RECOMPUTE_METHODS)))
    recompute_num_layers: int | None = field(default=None, metadata=rules(POSITIVE_INT))
    recompute_modules: list[str] | None = field(default=None, metadata=rules(distinct_names(RECOMPUTE_MODULES)))

    relations: ClassVar = (
        Exclusive("rope_interpolation_factor", "rope_scaling_factor"),
        multiple_of("num_attention_heads", "num_query_groups"),
        # Megatron-LM's argument checks for activation recompute, plus no key that would be ignored
        at_most("recompute_num_layers", "num_layers"),
        Needs("recompute_method", ("recompute_granularity", "full")),
        Needs(("recompute_granularity", "full"), "recompute_method"),
        Needs("recompute_num_layers", ("recompute_granularity", "full")),
        Needs(("recompute_granularity", "full"), "recompute_num_layers"),
        Needs("recompute_modules", ("recompute_granularity", "selective")),
    )

    def __post_init__(self) -> None:
        """Check the fields (:func:`~packsft.config_rules.check_fields`) and the head dimension.

        Raises:
            ValueError: naming the offending field and its value.
        """
        check_fields("model", self)
        if self.kv_channels is None and self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"model.hidden_size ({self.hidden_size}) must be a multiple of model.num_attention_heads "
                f"({self.num_attention_heads}) when model.kv_channels is not set"
            )
        if self.head_dim % 2:
            raise ValueError(f"model head dimension ({self.head_dim}) must be even for rotary embeddings")

    @property
    def head_dim(self) -> int:
        """Per-head dimension ``hn`` (``kv_channels`` or ``hidden_size // num_attention_heads``)."""
        if self.kv_channels is not None:
            return self.kv_channels
        return self.hidden_size // self.num_attention_heads

    def check_parallel_fit(self, tp: int = 1, pp: int = 1, vp: int | None = None, prefix: str = "") -> None:
        """Refuse a model that does not split over ``tp`` tensor-parallel ranks (its key/value heads and vocabulary:
        packsft's TP shards have neither Megatron's replicated key/value heads nor a padded vocabulary) and ``pp``
        pipeline stages of ``vp`` virtual stages each (its layers). ``prefix`` names the sizes (``"parallel."``: a
        training config's). Megatron's ``TransformerConfig`` refuses ``num_attention_heads`` not divisible by ``tp``.

        Raises:
            ValueError: naming the model field, its value and the size it must be a multiple of.
        """
        layers = f"{prefix}pipeline_model_parallel_size ({pp})" + (
            f" x {prefix}virtual_pipeline_model_parallel_size ({vp})" if vp else "")
        for field_name, divisor, sizes in (
                ("num_query_groups", tp, f"{prefix}tensor_model_parallel_size ({tp})"),
                ("vocab_size", tp, f"{prefix}tensor_model_parallel_size ({tp}); pad the vocabulary"),
                ("num_layers", pp * (vp or 1), layers)):
            if getattr(self, field_name) % divisor:
                raise ValueError(f"model.{field_name} ({getattr(self, field_name)}) must be a multiple of {sizes}")

    def to_transformer_config(self, tp: int = 1, cp: int = 1, sequence_parallel: bool = False, pp: int = 1,
                              vp: int | None = None):
        """Build Megatron-Core's ``TransformerConfig`` for tensor-parallel ``tp``, context-parallel ``cp`` and
        pipeline-parallel ``pp`` (``vp`` virtual stages per pipeline rank, or None).

        The ``recompute_*`` fields are passed as Megatron's of the same names (``recompute_modules`` None:
        Megatron's default ``["core_attn"]``). Dropout is 0 (``attention_dropout``, ``hidden_dropout``), biases
        are off (``add_bias_linear``;
        ``add_qkv_bias`` follows the field of that name), and every CUDA-only fusion is off. On a machine
        without CUDA the weights are created on CPU (``use_cpu_initialization``), which also makes TP
        shards exact slices of the TP=1 weights for the same seed.

        The model fits the sizes (:meth:`check_parallel_fit`: the training config and the converter check).
        """
        from megatron.core.transformer import TransformerConfig

        dtype = PARAMS_DTYPES[self.params_dtype]
        return TransformerConfig(
            num_layers=self.num_layers,
            hidden_size=self.hidden_size,
            ffn_hidden_size=self.ffn_hidden_size,
            num_attention_heads=self.num_attention_heads,
            num_query_groups=self.num_query_groups,
            kv_channels=self.kv_channels,
            normalization="RMSNorm",
            layernorm_epsilon=self.norm_epsilon,
            gated_linear_unit=True,
            activation_func=F.silu,
            add_bias_linear=False,
            add_qkv_bias=self.add_qkv_bias,
            qk_layernorm=self.qk_layernorm,
            attention_dropout=0.0,
            hidden_dropout=0.0,
            init_method_std=self.init_method_std,
            params_dtype=dtype,
            bf16=dtype == torch.bfloat16,
            pipeline_dtype=dtype,
            tensor_model_parallel_size=tp,
            context_parallel_size=cp,
            pipeline_model_parallel_size=pp,
            virtual_pipeline_model_parallel_size=vp,
            # Megatron-LM's defaults: the interleaved schedule overlaps its p2p ops, unbatched (one process group
            # per direction when P = 2, so an activation and a gradient between the same two ranks never cross)
            overlap_p2p_comm=vp is not None,
            batch_p2p_comm=vp is None,
            sequence_parallel=sequence_parallel and tp > 1,
            use_cpu_initialization=not torch.cuda.is_available(),
            bias_activation_fusion=self.bias_activation_fusion,
            bias_dropout_fusion=False,
            masked_softmax_fusion=False,
            persist_layer_norm=False,
            apply_rope_fusion=False,
            gradient_accumulation_fusion=False,
            cross_entropy_loss_fusion=False,
            recompute_granularity=self.recompute_granularity,
            recompute_method=self.recompute_method,
            recompute_num_layers=self.recompute_num_layers,
            recompute_modules=None if self.recompute_modules is None else list(self.recompute_modules),
        )


def check_vocab_size(vocab_size: int, tokenizer, name: str | Path) -> None:
    """Refuse a tokenizer (``len()``: its tokens) with ids past the model's ``vocab_size`` embedding rows, before any
    weight is read (training, export); ``name``: the tokenizer's folder, as messages name it.

    Raises:
        ValueError: naming both sizes.
    """
    if len(tokenizer) > vocab_size:
        raise ValueError(f"model.vocab_size ({vocab_size}) is smaller than the tokenizer {name} ({len(tokenizer)} "
                         "tokens): its top ids have no embedding row")


def read_model_config(path: str | Path) -> ModelConfig:
    """``ModelConfig`` from a ``model_config.json``, a checkpoint folder holding one, or a YAML's ``model:`` section.

    Raises:
        ValueError: naming unknown or missing fields (a partial YAML ``model:`` section, as training allows with
            ``checkpoint.init_from``: see ``packsft.train.compat.read_yaml_model``), or a YAML without one.
        FileNotFoundError: a folder without ``model_config.json`` (not a packsft checkpoint), or no such file (the
            ``OSError`` of reading it, naming it).
    """
    path = Path(path)
    if path.is_dir():
        if not (path / MODEL_CONFIG_FILE).is_file():
            raise FileNotFoundError(f"{path} has no {MODEL_CONFIG_FILE}: not a packsft checkpoint folder (one "
                                    "written by `convert_checkpoint.py import` or by training, e.g. "
                                    "out/train/checkpoints/iter_0000100); or pass the run's --config YAML")
        path = path / MODEL_CONFIG_FILE
    if path.suffix in (".yaml", ".yml"):
        data = yaml_model_section(path)
        if data is None:
            raise ValueError(f"{path} has no model: section")
    else:
        data = read_json_object(path)
    return config_from_dict(ModelConfig, data, str(path))


def yaml_model_section(path: str | Path) -> dict | None:
    """A YAML file's ``model:`` section as a dict (``{}`` when null; the whole file when its keys are all
    ``ModelConfig`` fields), or None when it has none (e.g. a training config that takes the model from
    ``checkpoint.init_from``).

    Raises:
        ValueError: naming the file: not YAML, not a mapping, or a ``model:`` that is not a mapping.
    """
    import yaml

    with config_errors(str(path)):
        data = yaml.safe_load(Path(path).read_text())
    data = {} if data is None else data
    if not isinstance(data, dict):
        raise ValueError(f"{path}: not a YAML mapping of config sections")
    if "model" not in data:
        return data if data and set(data) <= {f.name for f in fields(ModelConfig)} else None
    section = {} if data["model"] is None else data["model"]
    if not isinstance(section, dict):
        raise ValueError(f"{path}: model: must be a mapping of ModelConfig fields, got {section!r}")
    return section


def config_from_dict(cls, values: dict, where: str, missing_hint: str = ""):
    """The config dataclass ``cls`` (``ModelConfig``, ``LoraConfig``) from one mapping read from a file, its fields
    checked (:func:`~packsft.config_rules.build_config`).

    Raises:
        ValueError: ``"{where}: unknown <cls> fields [...]"``, ``"{where}: missing <cls> fields [...]{missing_hint}"``
            for required ones it lacks, a value of the wrong type or an invalid one.
    """
    return build_config(cls, values, where=where, missing_hint=missing_hint)
