"""Build a Megatron-Core ``GPTModel`` (Llama-style) from a :class:`~packsft.model.config.ModelConfig`."""

from __future__ import annotations

import re

import torch
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build

from packsft.model.attention import TorchCoreAttention
from packsft.model.config import ModelConfig
from packsft.model.cpu_compat import apply_cpu_workarounds
from packsft.model.rope import install_sync_free_rope


class RMSNorm:
    """Megatron ``WrappedTorchNorm`` for RMSNorm, also under sequence parallelism: builds ``torch.nn.RMSNorm``.

    Megatron's wrapper refuses ``sequence_parallel`` although a per-token norm runs on sequence shards
    unchanged; what SP needs is that the weight's gradient is summed over the TP group, which Megatron does for
    parameters marked ``sequence_parallel`` (``finalize_model_grads``). Same class and state-dict keys as Megatron's,
    so checkpoints are unchanged.
    """

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5, **_unused):
        """``torch.nn.RMSNorm(hidden_size, eps)`` whose weight is marked ``sequence_parallel`` under SP."""
        norm = torch.nn.RMSNorm(normalized_shape=hidden_size, eps=eps)
        norm.weight.sequence_parallel = bool(config.sequence_parallel)
        return norm


class QKNorm:
    """The per-head q/k RMSNorm (``q_layernorm`` / ``k_layernorm``, Qwen3): ``torch.nn.RMSNorm(hn, eps)``.

    Each TP rank normalises only its own heads with the replicated ``[hn]`` weight, so its gradient is partial
    over the TP group at any TP size > 1. The weight is marked ``sequence_parallel`` then; Megatron's
    ``finalize_model_grads`` sums these weights over TP (by the mark, or by name, ``qk_layernorm``), once. Same keys
    as Megatron's ``WrappedTorchNorm``.
    """

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5, **_unused):
        """``torch.nn.RMSNorm(hidden_size, eps)``; weight marked ``sequence_parallel`` when TP > 1."""
        norm = torch.nn.RMSNorm(normalized_shape=hidden_size, eps=eps)
        norm.weight.sequence_parallel = config.tensor_model_parallel_size > 1
        return norm


def layer_spec(attention_backend: str, qk_layernorm: bool = False):
    """Transformer-layer ``ModuleSpec`` for an attention backend (``model.attention_backend``, one of
    ``ATTENTION_BACKENDS``: checked by ``ModelConfig``).

    ``"torch"``: Megatron's local spec (``get_gpt_layer_local_spec(normalization="RMSNorm", qk_layernorm=...)``)
    with ``self_attention.submodules.core_attention`` replaced by :class:`TorchCoreAttention`, the layer norms by
    :class:`RMSNorm` and, with ``qk_layernorm``, the spec's ``q_layernorm`` / ``k_layernorm`` by :class:`QKNorm`.
    ``"te"``: ``get_gpt_layer_with_transformer_engine_spec(qk_layernorm=...)`` unchanged (TE fused norm+linear,
    ``TEDotProductAttention`` with THD and ring context parallelism).

    Raises:
        ImportError: for ``"te"`` when transformer_engine is not installed.
    """
    if attention_backend == "te":
        try:
            import transformer_engine  # noqa: F401
        except ImportError as err:
            raise ImportError("model.attention_backend='te' needs TransformerEngine "
                              "(pip install 'packsft[te]' on a CUDA machine); use 'torch' on CPU") from err
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

        return get_gpt_layer_with_transformer_engine_spec(qk_layernorm=qk_layernorm)
    spec = get_gpt_layer_local_spec(normalization="RMSNorm", qk_layernorm=qk_layernorm)
    attention = spec.submodules.self_attention.submodules
    attention.core_attention = TorchCoreAttention
    if qk_layernorm:
        attention.q_layernorm = attention.k_layernorm = QKNorm
    spec.submodules.input_layernorm = spec.submodules.pre_mlp_layernorm = RMSNorm
    return spec


def build_gpt_model(cfg: ModelConfig, *, pre_process: bool | None = None, post_process: bool | None = None,
                    sequence_parallel: bool = False, vp_stage: int | None = None) -> GPTModel:
    """Build the GPT model for ``cfg`` on this rank's tensor/context/pipeline-parallel shard.

    Requires ``megatron.core.parallel_state`` to be initialised
    (``packsft.train.distributed.init_distributed`` does it, also for a single process); TP and CP
    sizes are read from it. Weights are initialised from the current torch RNG (normal with
    ``cfg.init_method_std``), on CPU when CUDA is absent, so the same seed gives the same weights, and
    TP shards are slices of the TP=1 weights.

    The model is Llama-style: RMSNorm, SwiGLU, RoPE with ``cfg.rotary_base`` (and Llama-3.1 frequency
    scaling when ``cfg.rope_scaling_factor`` is set, linear scaling with ``cfg.rope_interpolation_factor``;
    positions restart at 0 in every THD segment, computed on the device without a host sync:
    ``packsft.model.rope``, installed here), GQA, optional per-head q/k RMSNorm (``cfg.qk_layernorm``),
    no biases except an optional QKV bias (``cfg.add_qkv_bias``), ``share_embeddings_and_output_weights =
    cfg.tie_word_embeddings``, ``parallel_output=True`` (logits stay vocab-sharded). ``sequence_parallel``:
    Megatron's sequence parallelism over the TP group (norms and residual stream on ``t / tp`` tokens).

    Pipeline parallelism (sizes read from ``parallel_state``): the model holds this rank's layers (of virtual
    stage ``vp_stage`` when virtual stages are set); ``pre_process`` (embedding) and ``post_process`` (final norm
    and output layer) default to whether this is the first / last pipeline stage. With tied embeddings the last
    stage holds a copy of the word embedding (Megatron's ``setup_embeddings_and_output_layer``: copied from the
    first stage at construction, gradients all-reduced by ``finalize_model_grads``). A stage without
    ``post_process`` returns its hidden states ``[t, 1, h]``.

    Returns:
        ``GPTModel`` in fp32 or bf16 (``cfg.params_dtype``). ``model(tokens [1, t], position_ids [1, t],
        None, labels=[1, t], packed_seq_params=...)`` returns per-token loss fp32 ``[1, t]``; see
        ``packsft.model.output_head`` for the hidden-state seam.

    ``cfg`` fits the parallel sizes (``ModelConfig.check_parallel_fit``: the training config and the converter check).
    """
    apply_cpu_workarounds()
    install_sync_free_rope()
    tp = parallel_state.get_tensor_model_parallel_world_size()
    cp = parallel_state.get_context_parallel_world_size()
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    vp = parallel_state.get_virtual_pipeline_model_parallel_world_size()
    if pre_process is None:
        pre_process = parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage)
    if post_process is None:
        post_process = parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage)
    config = cfg.to_transformer_config(tp=tp, cp=cp, sequence_parallel=sequence_parallel, pp=pp, vp=vp)
    spec = layer_spec(cfg.attention_backend, cfg.qk_layernorm)
    if cfg.attention_backend == "torch":   # the final norm too (Megatron's block default refuses SP)
        layers = get_num_layers_to_build(config, vp_stage=vp_stage)
        spec = TransformerBlockSubmodules(layer_specs=[spec] * layers, layer_norm=RMSNorm)
    return GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=cfg.vocab_size,
        max_sequence_length=cfg.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        parallel_output=True,
        share_embeddings_and_output_weights=cfg.tie_word_embeddings,
        position_embedding_type="rope",
        rotary_base=cfg.rotary_base,
        rope_scaling=cfg.rope_scaling_factor is not None,
        rope_scaling_factor=cfg.rope_scaling_factor if cfg.rope_scaling_factor is not None else 8.0,
        vp_stage=vp_stage,
        seq_len_interpolation_factor=cfg.rope_interpolation_factor,
    )


def build_gpt_stages(cfg: ModelConfig, *, sequence_parallel: bool = False) -> list[GPTModel]:
    """This pipeline rank's model chunks: one ``GPTModel`` per virtual stage (one without virtual stages).

    Chunk ``i`` holds virtual stage ``i`` (Megatron's interleaved layout: with ``P`` ranks and ``V`` virtual
    stages, rank ``p``'s chunk ``i`` holds layers ``(i * P + p) * n .. + n - 1``, ``n = num_layers / (P V)``).

    Raises:
        RuntimeError, ValueError: as :func:`build_gpt_model`.
    """
    vp = parallel_state.get_virtual_pipeline_model_parallel_world_size()
    if vp is None:
        return [build_gpt_model(cfg, sequence_parallel=sequence_parallel)]
    return [build_gpt_model(cfg, sequence_parallel=sequence_parallel, vp_stage=i) for i in range(vp)]


def unwrap_model(model: torch.nn.Module) -> torch.nn.Module:
    """The ``GPTModel`` inside DDP-style wrappers (anything with ``.module``), or the model itself."""
    while hasattr(model, "module"):
        model = model.module
    return model


_LAYER = re.compile(r"decoder\.layers\.(\d+)\.")


def global_layer_name(model: GPTModel, name: str) -> str:
    """``name`` of a parameter or module of ``model`` (one pipeline stage or virtual chunk) with its local layer
    index ``decoder.layers.<i>.`` replaced by the layer's global 0-based number; other names unchanged.

    The same layer has the same name in every pipeline layout (``layer_number`` is Megatron's global, 1-based one).
    """
    match = _LAYER.match(name)
    if not match:
        return name
    return f"decoder.layers.{model.decoder.layers[int(match.group(1))].layer_number - 1}." + name[match.end():]
