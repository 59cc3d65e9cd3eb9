"""Llama-style model configuration, its ``model_config.json`` file and its Megatron-Core ``TransformerConfig``.

The architecture is fixed to what Llama, Qwen2, Qwen3, Mistral and SmolLM2 share: RMSNorm, SwiGLU MLP
(``gated_linear_unit`` + SiLU), rotary position embeddings, grouped-query attention, no biases and
optionally tied input/output embeddings. Everything that varies between those families is a field
(QKV bias, per-head q/k RMSNorm, head dimension, RoPE scaling).
"""

from __future__ import annotations

import math
from dataclasses import MISSING, dataclass, fields
from pathlib import Path

import torch
import torch.nn.functional as F

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

    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    vocab_size: int
    max_position_embeddings: int
    kv_channels: int | None = None
    rotary_base: float = 10000.0
    norm_epsilon: float = 1e-5
    tie_word_embeddings: bool = False
    add_qkv_bias: bool = False
    qk_layernorm: bool = False
    rope_interpolation_factor: float | None = None
    rope_scaling_factor: float | None = None
    attention_backend: str = "torch"
    params_dtype: str = "float32"
    init_method_std: float = 0.02
    bias_activation_fusion: bool = False
    recompute_granularity: str | None = None
    recompute_method: str | None = None
    recompute_num_layers: int | None = None
    recompute_modules: list[str] | None = None

    def __post_init__(self) -> None:
        """Validate the fields.

        Raises:
            ValueError: naming the offending field and its value.
        """
        for name in ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads",
                     "num_query_groups", "vocab_size", "max_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"model.{name} must be a positive integer, got {value!r}")
        if self.kv_channels is not None and (not isinstance(self.kv_channels, int) or self.kv_channels <= 0):
            raise ValueError(f"model.kv_channels must be a positive integer or None, "
                             f"got {self.kv_channels!r}")
        if self.kv_channels is None and self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"model.hidden_size ({self.hidden_size}) must be a multiple of model.num_attention_heads "
                f"({self.num_attention_heads}) when model.kv_channels is not set"
            )
        if self.num_attention_heads % self.num_query_groups:
            raise ValueError(
                f"model.num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"model.num_query_groups ({self.num_query_groups})"
            )
        if self.head_dim % 2:
            raise ValueError(f"model head dimension ({self.head_dim}) must be even for rotary embeddings")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"model.attention_backend must be one of {ATTENTION_BACKENDS}, "
                             f"got {self.attention_backend!r}")
        if self.params_dtype not in PARAMS_DTYPES:
            raise ValueError(f"model.params_dtype must be one of {tuple(PARAMS_DTYPES)}, "
                             f"got {self.params_dtype!r}")
        if not isinstance(self.bias_activation_fusion, bool):
            raise ValueError(f"model.bias_activation_fusion must be true or false, got {self.bias_activation_fusion!r}")
        if self.rope_scaling_factor is not None and not 0 < self.rope_scaling_factor < math.inf:
            raise ValueError(f"model.rope_scaling_factor must be a finite number > 0 or None, "
                             f"got {self.rope_scaling_factor!r}")
        if self.rope_interpolation_factor is not None:
            if not 0 < self.rope_interpolation_factor < math.inf:
                raise ValueError(f"model.rope_interpolation_factor must be a finite number > 0 or None, "
                                 f"got {self.rope_interpolation_factor!r}")
            if self.rope_scaling_factor is not None:
                raise ValueError("model.rope_interpolation_factor and model.rope_scaling_factor are exclusive")
        for name in ("rotary_base", "norm_epsilon", "init_method_std"):
            if not 0 < getattr(self, name) < math.inf:
                raise ValueError(f"model.{name} must be a finite number > 0, got {getattr(self, name)!r}")
        self._check_recompute()

    def _check_recompute(self) -> None:
        """Megatron-LM's argument checks for activation recompute, plus no key that would be ignored.

        Raises:
            ValueError: naming the ``model.recompute_*`` key and its value.
        """
        granularity, method, layers, modules = (self.recompute_granularity, self.recompute_method,
                                                self.recompute_num_layers, self.recompute_modules)
        if granularity is not None and granularity not in RECOMPUTE_GRANULARITIES:
            raise ValueError(f"model.recompute_granularity must be null or one of {RECOMPUTE_GRANULARITIES}, "
                             f"got {granularity!r}")
        if method is not None and method not in RECOMPUTE_METHODS:
            raise ValueError(f"model.recompute_method must be null or one of {RECOMPUTE_METHODS}, got {method!r}")
        if layers is not None and (not isinstance(layers, int) or isinstance(layers, bool)
                                   or not 1 <= layers <= self.num_layers):
            raise ValueError(f"model.recompute_num_layers must be an integer from 1 to model.num_layers "
                             f"({self.num_layers}), got {layers!r}")
        if granularity == "full":
            if method is None:
                raise ValueError("model.recompute_method must be set ('uniform' or 'block') with "
                                 "model.recompute_granularity 'full'")
            if layers is None:
                raise ValueError("model.recompute_num_layers must be set with model.recompute_granularity 'full'")
        else:
            for name, value in (("recompute_method", method), ("recompute_num_layers", layers)):
                if value is not None:
                    raise ValueError(f"model.{name} ({value!r}) applies to model.recompute_granularity 'full' "
                                     f"only, got {granularity!r}; set it to null")
        if modules is not None:
            if granularity != "selective":
                raise ValueError(f"model.recompute_modules ({modules!r}) applies to model.recompute_granularity "
                                 f"'selective' only, got {granularity!r}; set it to null")
            bad = [m for m in modules if m not in RECOMPUTE_MODULES]
            if not modules or bad or len(set(modules)) != len(modules):
                raise ValueError(f"model.recompute_modules must be a non-empty list of distinct names from "
                                 f"{RECOMPUTE_MODULES}, got {list(modules)!r}")

    @property
    def head_dim(self) -> int:
        """Per-head dimension ``hn`` (``kv_channels`` or ``hidden_size // num_attention_heads``)."""
        if self.kv_channels is not None:
            return self.kv_channels
        return self.hidden_size // self.num_attention_heads

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

        Raises:
            ValueError: if ``num_attention_heads``/``num_query_groups`` are not divisible by ``tp``, or
                ``num_layers`` not by ``pp * vp`` (the sizes are positive: the CLI and the training config check).
        """
        from megatron.core.transformer import TransformerConfig

        for name in ("num_attention_heads", "num_query_groups"):
            if getattr(self, name) % tp:
                raise ValueError(f"model.{name} ({getattr(self, name)}) must be a multiple of "
                                 f"tensor_model_parallel_size ({tp})")
        if self.num_layers % (pp * (vp or 1)):
            raise ValueError(f"model.num_layers ({self.num_layers}) must be a multiple of "
                             f"pipeline_model_parallel_size ({pp}) x virtual_pipeline_model_parallel_size ({vp})")
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


def read_model_config(path: str | Path) -> ModelConfig:
    """``ModelConfig`` from a ``model_config.json``, a checkpoint folder holding one, or a YAML's ``model:`` section.

    Raises:
        ValueError: naming unknown or missing fields (a partial YAML ``model:`` section, as training allows with
            ``checkpoint.init_from``: see ``packsft.train.compat.read_yaml_model``), or a YAML without one.
        FileNotFoundError: no such file (a folder without ``model_config.json``: not a packsft checkpoint).
    """
    path = Path(path)
    if path.is_dir():
        if not (path / MODEL_CONFIG_FILE).is_file():
            raise FileNotFoundError(f"{path} has no {MODEL_CONFIG_FILE}: not a packsft checkpoint folder (one "
                                    "written by `convert_checkpoint.py import` or by training, e.g. "
                                    "out/train/checkpoints/iter_0000100); or pass the run's --config YAML")
        path = path / MODEL_CONFIG_FILE
    elif not path.is_file():
        raise FileNotFoundError(f"model config not found: {path}")
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

    try:
        data = yaml.safe_load(Path(path).read_text())
    except yaml.YAMLError as err:
        raise ValueError(f"{path}: not valid YAML: {' '.join(str(err).split())}") from None
    data = {} if data is None else data
    if not isinstance(data, dict):
        raise ValueError(f"{path}: not a YAML mapping of config sections")
    if "model" not in data:
        return data if data and set(data) <= {f.name for f in fields(ModelConfig)} else None
    section = {} if data["model"] is None else data["model"]
    if not isinstance(section, dict):
        raise ValueError(f"{path}: model: must be a mapping of ModelConfig fields, got {section!r}")
    return section


def check_field_names(cls, values: dict, where: str) -> None:
    """Refuse ``values`` that is not a mapping or has keys that are not fields of the dataclass ``cls``.

    Raises:
        ValueError: ``"{where}: unknown <cls> fields [...]"``, or naming the value that is not a mapping.
    """
    if not isinstance(values, dict):
        raise ValueError(f"{where}: expected a mapping of {cls.__name__} fields, got {values!r}")
    unknown = set(values) - {f.name for f in fields(cls)}
    if unknown:
        raise ValueError(f"{where}: unknown {cls.__name__} fields {sorted(unknown)}")


def config_from_dict(cls, values: dict, where: str, missing_hint: str = ""):
    """``cls(**values)`` for a config dataclass (``ModelConfig``, ``LoraConfig``) read from a file.

    Raises:
        ValueError: unknown fields or not a mapping (:func:`check_field_names`), ``"{where}: missing <cls> fields
            [...]{missing_hint}"`` for required ones it lacks, or a value of the wrong type.
    """
    check_field_names(cls, values, where)
    missing = [f.name for f in fields(cls) if f.default is MISSING and f.default_factory is MISSING
               and f.name not in values]
    if missing:
        raise ValueError(f"{where}: missing {cls.__name__} fields {missing}{missing_hint}")
    try:
        return cls(**values)
    except TypeError as err:        # a value of the wrong type compared in __post_init__
        raise ValueError(f"{where}: {cls.__name__} field of the wrong type: {err}") from None
