"""A LLaVA-1.5 vision-language model: megatron-core's own ``LLaVAModel`` with packsft's Llama-style language model.

Parts (megatron-core 0.16.1, ``models/multimodal/llava_model.py``)::

    images [n, 3, H, W] ──► CLIPViTModel (conv1 patch embedding, class token, learned positions, ln_pre,
                            vision.num_layers pre-LN layers, full (non-causal) attention, quick_gelu MLP)
                        ──► drop the class token ──► MultimodalProjector (linear_fc1, gelu, linear_fc2)
                        ──► [L, n, h_text] image embeddings, L = image_seq_length = (H / patch) ** 2
    tokens (one image id per image) ──► GPTModel embedding; LLaVAModel._preprocess_data puts each image's L
                        embeddings where its id was ──► packsft's GPT decoder (THD, RoPE restarting per segment)

This is HF LLaVA-1.5 (``LlavaForConditionalGeneration``) with ``vision_feature_select_strategy="default"`` when
``vision.num_layers`` is the number of CLIP layers whose output HF selects (``vision_feature_layer=-2``: one fewer
than the tower has); HF's ``post_layernorm`` is unused there, as megatron's CLIP has no ``ln_post``.

Token convention: packsft rows hold the EXPANDED ids (as the HF processor writes them: ``L`` image ids per image),
so ``cu_seqlens`` and labels are in expanded coordinates; megatron's ``LLaVAModel`` wants ONE id per image and
expands it. :func:`collapse_image_tokens` goes from one to the other; :func:`llava_hidden_states` does it for the
call. Context and pipeline parallelism are refused where a run or a conversion is set up (the training config's
``VISION_RELATIONS``, ``tools/convert_checkpoint.py``: megatron's LLaVA needs TransformerEngine for CP; packsft has
no LLaVA pipeline split), not here; tensor parallelism shards the language model, the projector and the CLIP layers as
megatron does (column/row-parallel linears; norms, patch embedding, class token and positions replicated).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.activations import quick_gelu
from megatron.core.enums import ModelType
from megatron.core.models.multimodal import llava_model
from megatron.core.models.multimodal.llava_model import LLaVAModel
from megatron.core.models.vision import clip_vit_model
from megatron.core.models.vision.vit_layer_specs import get_vit_layer_with_local_spec
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.mlp import MLPSubmodules
from megatron.core.transformer.torch_norm import WrappedTorchNorm
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build
from torch import Tensor

from packsft.model.attention import TorchCoreAttention
from packsft.model.config import ModelConfig
from packsft.model.cpu_compat import apply_cpu_workarounds, eager_activation
from packsft.model.gpt import RMSNorm, layer_spec, unwrap_model
from packsft.model.output_head import HiddenStateOutputLayer, use_hidden_state_output
from packsft.model.rope import install_sync_free_rope

ACTIVATIONS = {"quick_gelu": quick_gelu, "gelu": F.gelu}
"""HF ``hidden_act`` / ``projector_hidden_act`` names -> the functions megatron's MLP applies."""


@dataclass(frozen=True)
class VisionConfig:
    """The CLIP vision tower as LLaVA uses it.

    Attributes:
        hidden_size / ffn_hidden_size / num_attention_heads: CLIP's ``hidden_size`` / ``intermediate_size`` /
            ``num_attention_heads``.
        num_layers: the CLIP layers USED (HF ``num_hidden_layers + 1 + vision_feature_layer``).
        image_size / patch_size: pixels (square images and patches); ``num_channels`` 3.
        layer_norm_eps: of ``ln_pre`` and the layers' LayerNorms.
        hidden_act: the CLIP MLP's activation (``quick_gelu``); projector_hidden_act: between the projector's
            two linears (``gelu``). Both keys of :data:`ACTIVATIONS`.
    """

    hidden_size: int
    num_layers: int
    num_attention_heads: int
    ffn_hidden_size: int
    image_size: int
    patch_size: int
    num_channels: int = 3
    layer_norm_eps: float = 1e-5
    hidden_act: str = "quick_gelu"
    projector_hidden_act: str = "gelu"

    @property
    def image_seq_length(self) -> int:
        """Embeddings per image in the language model: ``(image_size // patch_size) ** 2`` (class token dropped)."""
        return (self.image_size // self.patch_size) ** 2


@dataclass(frozen=True)
class VLMConfig:
    """A LLaVA model: ``text`` (packsft's GPT), ``vision`` (CLIP) and the id of the image token in ``text``'s
    vocabulary (HF ``image_token_index``)."""

    text: ModelConfig
    vision: VisionConfig
    image_token_id: int


class VisionCoreAttention(TorchCoreAttention):
    """Full (non-causal) core attention over each image: q ``[s, b, np, hn]``, k/v ``[s, b, ng, hn]`` ->
    ``[s, b, np * hn]`` (``s`` patches + class token, ``b`` images) on ``F.scaled_dot_product_attention``.

    Megatron's local ViT spec uses ``DotProductAttention``, which builds its mask on CUDA; CLIP attends without
    any mask. Constructor: :class:`TorchCoreAttention`'s (``DotProductAttention``'s signature); no parameters.
    """

    def forward(self, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None,
                attn_mask_type: AttnMaskType | None = None, attention_bias: Tensor | None = None,
                packed_seq_params=None) -> Tensor:
        """Attend every patch to every patch of its own image (``attention_mask`` ignored: CLIP has none)."""
        q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))              # [b, n, s, hn]
        out = F.scaled_dot_product_attention(q, k, v, scale=self.softmax_scale, enable_gqa=q.shape[1] != k.shape[1])
        return out.permute(2, 0, 1, 3).flatten(2)                                 # [s, b, np * hn]


def vision_layer_spec():
    """Megatron's local ViT layer spec with :class:`VisionCoreAttention` and no attention mask (LayerNorms are
    megatron's ``WrappedTorchNorm``; linears column/row-parallel with biases)."""
    spec = get_vit_layer_with_local_spec()
    spec.submodules.self_attention.params = {"attn_mask_type": AttnMaskType.no_mask}
    spec.submodules.self_attention.submodules.core_attention = VisionCoreAttention
    return spec


def _vision_transformer_config(cfg: VisionConfig, text_config, tp: int):
    """Megatron ``TransformerConfig`` of the CLIP layers: pre-LN LayerNorm, biased linears, no dropout, the
    language config's dtype, parallel sizes and CPU settings; ``vision_model_type="clip"``."""
    config = dataclasses.replace(
        text_config, num_layers=cfg.num_layers, hidden_size=cfg.hidden_size, ffn_hidden_size=cfg.ffn_hidden_size,
        num_attention_heads=cfg.num_attention_heads, num_query_groups=cfg.num_attention_heads,
        kv_channels=cfg.hidden_size // cfg.num_attention_heads, normalization="LayerNorm",
        layernorm_epsilon=cfg.layer_norm_eps, gated_linear_unit=False,
        activation_func=eager_activation(ACTIVATIONS[cfg.hidden_act]),
        add_bias_linear=True, add_qkv_bias=True, qk_layernorm=False, bias_activation_fusion=False,
        tensor_model_parallel_size=tp, sequence_parallel=False, recompute_granularity=None,
        recompute_method=None, recompute_num_layers=None, recompute_modules=None)
    config.vision_model_type = "clip"
    return config


def _projector_transformer_config(cfg: VisionConfig, text_config):
    """The projector MLP's config: ``linear_fc1`` ``h_vision -> h_text``, ``projector_hidden_act``,
    ``linear_fc2`` ``h_text -> h_text``, both with biases (HF ``multi_modal_projector.linear_1/linear_2``)."""
    return dataclasses.replace(
        text_config, ffn_hidden_size=text_config.hidden_size, gated_linear_unit=False,
        activation_func=eager_activation(ACTIVATIONS[cfg.projector_hidden_act]), add_bias_linear=True,
        bias_activation_fusion=False,
        recompute_granularity=None, recompute_method=None, recompute_num_layers=None, recompute_modules=None)


@contextlib.contextmanager
def _clip_with_megatron_norms():
    """While active, ``LLaVAModel`` builds its ``CLIPViTModel`` with megatron's ``WrappedTorchNorm`` for ``ln_pre``
    / ``ln_post`` when TransformerEngine is absent: CLIP's default there, ``torch.nn.LayerNorm``, does not take the
    ``config=`` that ``build_module`` passes (with TE the default is ``TENorm``, which does). Same state-dict keys."""
    if clip_vit_model.NORM_IMPL is not torch.nn.LayerNorm:
        yield
        return
    original = llava_model.CLIPViTModel
    llava_model.CLIPViTModel = functools.partial(original, ln_pre_impl=WrappedTorchNorm, ln_post_impl=WrappedTorchNorm)
    try:
        yield
    finally:
        llava_model.CLIPViTModel = original


def build_llava_model(cfg: VLMConfig, max_tokens: int | None = None) -> LLaVAModel:
    """Build megatron-core's ``LLaVAModel`` for ``cfg`` on this rank's tensor-parallel shard (fp32 or bf16 as
    ``cfg.text.params_dtype``; on CPU without CUDA).

    ``max_tokens``: the most tokens one call takes, a THD micro-batch of ``b`` rows of ``L`` (``b * L``; default
    ``cfg.text.max_position_embeddings``): ``LLaVAModel`` cuts its combined sequence at its
    ``language_max_sequence_length``, which RoPE does not need here (positions restart per conversation).

    Needs ``megatron.core.parallel_state`` initialised (as :func:`packsft.model.gpt.build_gpt_model`). The
    language model is packsft's GPT (``layer_spec(cfg.text.attention_backend)``, RMSNorm final norm, RoPE with
    ``cfg.text.rotary_base`` and optional Llama-3.1 scaling, THD packing with positions restarting per segment);
    ``parallel_output=True`` (logits vocab-sharded). The class token is dropped before the projector. Every weight
    of the vision side, its LayerNorms included, takes ``cfg.text.params_dtype``.

    Context and pipeline parallel sizes must be 1: the training config (``VISION_RELATIONS``) and the converter
    (``convert_llava``) refuse others before any model is built.

    Raises:
        ValueError: ``model.rope_interpolation_factor`` (LLaVAModel builds its GPTModel without
            ``seq_len_interpolation_factor``; the training config refuses it too, an HF import reaches it here).
    """
    tp = parallel_state.get_tensor_model_parallel_world_size()
    if cfg.text.rope_interpolation_factor is not None:
        raise ValueError("model.rope_interpolation_factor is not supported for LLaVA models (megatron-core's "
                         "LLaVAModel builds its language model without seq_len_interpolation_factor)")
    apply_cpu_workarounds()
    install_sync_free_rope()
    cfg.text.check_parallel_fit(tp=tp, prefix="parallel.")
    text_config = cfg.text.to_transformer_config(tp=tp)
    spec = layer_spec(cfg.text.attention_backend, cfg.text.qk_layernorm)
    if cfg.text.attention_backend == "torch":
        spec = TransformerBlockSubmodules(layer_specs=[spec] * get_num_layers_to_build(text_config),
                                          layer_norm=RMSNorm)
    vision = cfg.vision
    with _clip_with_megatron_norms():
        model = LLaVAModel(
            language_transformer_config=text_config,
            language_transformer_layer_spec=spec,
            language_vocab_size=cfg.text.vocab_size,
            language_max_sequence_length=max(cfg.text.max_position_embeddings, max_tokens or 0),
            vision_transformer_config=_vision_transformer_config(vision, text_config, tp),
            vision_transformer_layer_spec=vision_layer_spec(),
            drop_vision_class_token=True,
            vision_projection_config=_projector_transformer_config(vision, text_config),
            vision_projection_layer_spec=MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear),
            vision_projection_type="mlp",
            parallel_output=True,
            share_embeddings_and_output_weights=cfg.text.tie_word_embeddings,
            language_position_embedding_type="rope",
            img_h=vision.image_size,
            img_w=vision.image_size,
            patch_dim=vision.patch_size,
            language_rotary_base=cfg.text.rotary_base,
            language_rope_scaling=cfg.text.rope_scaling_factor is not None,
            language_rope_scaling_factor=cfg.text.rope_scaling_factor or 8.0,
            image_token_index=cfg.image_token_id,
        )
    # CLIP's conv1 and WrappedTorchNorm ignore params_dtype: in bf16 they would hand fp32 activations to bf16 layers
    model.vision_model.to(text_config.params_dtype)
    model.model_type = ModelType.encoder_or_decoder   # what megatron's schedules read (GPTModel sets its own)
    return model


def collapse_image_tokens(tokens: Tensor, image_token_id: int, image_seq_length: int) -> Tensor:
    """Expanded ids (``image_seq_length`` image ids per image, as the HF processor and packsft rows hold them) ->
    megatron's LLaVA ids (one image id per image).

    Args:
        tokens: int64 ``[1, T]``.

    Returns:
        int64 ``[1, T - n * (image_seq_length - 1)]`` for ``n`` images; the other ids in order.

    Raises:
        ValueError: a run of image ids whose length is not a multiple of ``image_seq_length`` (naming its position
            and length); a run of ``k * L`` ids is ``k`` adjacent images.
    """
    is_image = tokens[0] == image_token_id
    edges = torch.diff(is_image.to(torch.int8), prepend=is_image.new_zeros(1, dtype=torch.int8),
                       append=is_image.new_zeros(1, dtype=torch.int8))
    starts, ends = torch.nonzero(edges == 1)[:, 0], torch.nonzero(edges == -1)[:, 0]
    bad = torch.nonzero((ends - starts) % image_seq_length)[:, 0]
    if bad.numel():
        start, end = int(starts[bad[0]]), int(ends[bad[0]])
        raise ValueError(f"a run of {end - start} image tokens (id {image_token_id}) at position {start}: each "
                         f"image takes image_seq_length={image_seq_length} tokens")
    position = torch.arange(tokens.shape[1], device=tokens.device)
    run_start = torch.zeros_like(position)
    run_start[is_image] = starts.repeat_interleave(ends - starts)           # each image id's run start
    keep = ~is_image | ((position - run_start) % image_seq_length == 0)      # the first id of each image
    return tokens[:, keep]


def language_model(model: torch.nn.Module) -> torch.nn.Module:
    """The ``GPTModel`` of ``model`` (a ``GPTModel`` or ``LLaVAModel``, or either inside DDP-style wrappers): a
    LLaVA model's ``language_model``, else the unwrapped model itself."""
    inner = unwrap_model(model)
    return inner.language_model if isinstance(inner, LLaVAModel) else inner


def _llava_forward(model: LLaVAModel, images: Tensor, tokens: Tensor, packed_seq_params) -> Tensor:
    """``model``'s output ``[1, T, *]`` for expanded ``tokens`` ``[1, T]`` (see :func:`llava_hidden_states`)."""
    inner = unwrap_model(model)
    collapsed = collapse_image_tokens(tokens, inner.image_token_index, inner.img_seq_len)
    images = images.to(inner.vision_model.conv1.weight.dtype)
    num_image_tiles = torch.ones(images.shape[0], dtype=torch.int, device=tokens.device)
    output, _ = model(images, collapsed, None, None, labels=None, loss_mask=None, num_image_tiles=num_image_tiles,
                      packed_seq_params=packed_seq_params)
    return output


def llava_hidden_states(model: LLaVAModel, images: Tensor, tokens: Tensor, packed_seq_params) -> Tensor:
    """Post-final-norm hidden states of one packed row, in expanded coordinates.

    Args:
        model: from :func:`build_llava_model` (its language model's output layer is made switchable with
            ``output_head.use_hidden_state_output``, idempotent, no parameter changed), or it inside DDP-style
            wrappers (``.module``: Megatron's DDP, ``Float16Module``), called as is so their hooks and casts run.
        images: fp32 ``[n, 3, H, W]`` (CLIP-normalised pixels), the row's images in the order their tokens appear;
            ``[0, 3, H, W]`` for a row without images.
        tokens: int64 ``[1, T]`` with ``image_seq_length`` image ids per image (what rows hold).
        packed_seq_params: ``PackedSeqParams`` with ``qkv_format="thd"`` and ``cu_seqlens`` in expanded
            coordinates (``cu_seqlens[-1] == T``); RoPE positions restart at 0 in each segment and no token
            attends across segments.

    Returns:
        ``[1, T, h]`` in the model's activation dtype. Host syncs (a handful per call, none per layer): megatron's
        ``_preprocess_data`` reads the image count per sample and the combined length and scatters with boolean
        masks (``torch.where`` / mask indexing); :func:`collapse_image_tokens` finds the image runs (``nonzero``).
        Labels and loss mask are not passed: packsft's loss reads them in expanded coordinates from the row.

    Raises:
        ValueError: from :func:`collapse_image_tokens`.
    """
    use_hidden_state_output(language_model(model))
    layer: HiddenStateOutputLayer = language_model(model).output_layer
    layer.return_hidden_states = True
    try:
        return _llava_forward(model, images, tokens, packed_seq_params)
    finally:
        layer.return_hidden_states = False


def llava_logits(model: LLaVAModel, images: Tensor, tokens: Tensor, packed_seq_params) -> Tensor:
    """As :func:`llava_hidden_states` but the logits ``[1, T, v / tp]`` (this TP rank's vocabulary shard), in the
    activation dtype."""
    return _llava_forward(model, images, tokens, packed_seq_params)
