"""HF LLaVA-1.5 (``LlavaForConditionalGeneration``, model_type ``llava``) <-> packsft's megatron LLaVA model.

Config: :func:`vlm_config_from_hf` / :func:`hf_config_from_vlm_config`. Tensors (pure, no I/O), names of
transformers 5's modules (the file names ``language_model.model.`` / ``language_model.lm_head.`` /
``vision_tower.[vision_model.]`` / ``multi_modal_projector.`` are read too: :func:`canonical_llava_name`). Folders:
:func:`save_hf_llava_checkpoint`; read one with ``hf_files.load_hf_checkpoint`` (safetensors + ``LlavaConfig``) after
:func:`check_hf_llava_weight_files`.
Shape legend: ``hv`` CLIP width, ``nv`` CLIP heads, ``hnv = hv / nv``, ``fv`` CLIP MLP width, ``p`` patch size,
``S = (image_size / p) ** 2 + 1`` CLIP positions, ``h`` text width, ``tp`` tensor-parallel size::

    HF (transformers 5)                                      megatron LLaVAModel, TP rank r of tp
    model.language_model.* , lm_head.weight                  language_model.*  (state_dict_adapter, model.* names)
    model.vision_tower.embeddings.class_embedding  [hv]      vision_model.class_token  [1, 1, hv]
      .embeddings.patch_embedding.weight  [hv, 3, p, p]      vision_model.conv1.weight  (no bias; replicated)
      .embeddings.position_embedding.weight  [S, hv]         vision_model.position_embeddings.weight
      .pre_layrnorm.weight/bias  [hv]                        vision_model.ln_pre.weight/bias
      .encoder.layers.i.layer_norm1 / layer_norm2 [hv]       vision_model.decoder.layers.i.input_layernorm /
                                                                 pre_mlp_layernorm  (weight, bias)
      .encoder.layers.i.self_attn.q/k/v_proj [hv, hv], [hv]  ...self_attention.linear_qkv  [3 hv / tp, hv], bias
                                                                 per head [q_j, k_j, v_j] (hnv rows each), heads
                                                                 r nv/tp ..
      .encoder.layers.i.self_attn.out_proj [hv, hv], [hv]    ...self_attention.linear_proj  [hv, hv / tp] (cols),
                                                                 bias [hv] replicated
      .encoder.layers.i.mlp.fc1 [fv, hv], [fv]               ...mlp.linear_fc1  rows r fv/tp ..  (weight, bias)
      .encoder.layers.i.mlp.fc2 [hv, fv], [hv]               ...mlp.linear_fc2  [hv, fv / tp], bias replicated
      .post_layernorm  [hv]                                  -  (LLaVA does not use it; written as 1 / 0)
    model.multi_modal_projector.linear_1 [h, hv], [h]        vision_projection.encoder.linear_fc1 (rows, bias rows)
    model.multi_modal_projector.linear_2 [h, h], [h]         vision_projection.encoder.linear_fc2 (cols; bias full)

CLIP layers from ``vision.num_layers`` on (HF ``vision_feature_layer=-2``: the last one) are not read; export
writes ``vision.num_layers`` layers and ``vision_feature_layer=-1``, the same model. Sources: transformers
``modeling_llava.py`` / ``modeling_clip.py``; megatron-core ``models/vision/clip_vit_model.py``,
``models/multimodal/llava_model.py``, ``transformer/attention.py`` (``get_query_key_value_tensors``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from packsft.model.hf_config import hf_config_from_model_config, model_config_from_hf
from packsft.model.hf_files import check_weight_headers, write_hf_checkpoint
from packsft.model.hf_io import load_mapped_state
from packsft.model.state_dict_adapter import (
    hf_tensor_names,
    hf_tensor_shape,
    hf_to_megatron_state_dict,
    megatron_to_hf_state_dict,
)
from packsft.model.vlm import ACTIVATIONS, VisionConfig, VLMConfig
from packsft.process_groups import barrier, global_rank, rank_and_size

VISION_FEATURE_LAYERS = (-1, -2)
LEGACY_PREFIXES = (("language_model.lm_head.", "lm_head."), ("language_model.model.", "model.language_model."),
                   ("vision_tower.vision_model.", "model.vision_tower."),
                   ("model.vision_tower.vision_model.", "model.vision_tower."),
                   ("vision_tower.", "model.vision_tower."),
                   ("multi_modal_projector.", "model.multi_modal_projector."))
"""LLaVA tensor-name prefixes of files (transformers 4 checkpoints; transformers 5's ``save_pretrained`` too, without
``vision_model.``) -> transformers 5's module names."""
TEXT, VISION, PROJECTOR = "model.language_model.", "model.vision_tower.", "model.multi_modal_projector."


def _as_llava_config(hf_config):
    """A transformers ``LlavaConfig`` from itself or its ``to_dict()`` / ``config.json`` dict."""
    if not isinstance(hf_config, dict):
        return hf_config
    from transformers import LlavaConfig

    return LlavaConfig(**{k: v for k, v in hf_config.items() if k not in ("model_type", "transformers_version")})


def _refuse(hf_config: dict) -> None:
    """Raise ``ValueError`` naming the first HF key whose value packsft's LLaVA model cannot reproduce."""
    vision, text = hf_config.get("vision_config") or {}, hf_config.get("text_config") or {}
    checks = (
        ("model_type", hf_config.get("model_type"), ("llava",), "only LLaVA-1.5 (llava) maps to megatron's "
         "LLaVAModel (NeXT/OneVision tiling and Qwen2-VL's M-RoPE are not in megatron-core 0.16)"),
        ("image_grid_pinpoints", hf_config.get("image_grid_pinpoints"), (None,), "LLaVA-NeXT any-resolution tiling"),
        ("vision_config.model_type", vision.get("model_type", "clip_vision_model"), ("clip_vision_model",),
         "the vision tower must be CLIP (megatron's CLIPViTModel)"),
        ("text_config.model_type", text.get("model_type", "llama"), ("llama",), "the language model must be Llama"),
        ("vision_feature_layer", hf_config.get("vision_feature_layer", -2), VISION_FEATURE_LAYERS,
         "megatron's CLIP returns the output of its last layer (-1, or -2 with one layer fewer)"),
        ("vision_feature_select_strategy", hf_config.get("vision_feature_select_strategy", "default"), ("default",),
         "megatron's LLaVAModel drops the class token (drop_vision_class_token)"),
        ("multimodal_projector_bias", hf_config.get("multimodal_projector_bias", True), (True,),
         "megatron's projector MLP has biases"),
        ("projector_hidden_act", hf_config.get("projector_hidden_act", "gelu"), tuple(ACTIVATIONS), "activation"),
        ("vision_config.hidden_act", vision.get("hidden_act", "quick_gelu"), tuple(ACTIVATIONS), "activation"),
        ("vision_config.num_channels", vision.get("num_channels", 3), (3,), "megatron's CLIP takes RGB"),
        ("vision_config.attention_dropout", vision.get("attention_dropout", 0.0), (0.0,), "packsft has no dropout"),
    )
    for key, value, allowed, why in checks:
        if value not in allowed:
            raise ValueError(f"unsupported LLaVA config {key}={value!r} (supported: {list(allowed)}): {why}")


def vlm_config_from_hf(hf_config, *, attention_backend: str = "torch", params_dtype: str = "float32") -> VLMConfig:
    """Translate a transformers ``LlavaConfig`` (or its dict) into a :class:`~packsft.model.vlm.VLMConfig`.

    ``vision.num_layers`` = CLIP ``num_hidden_layers + 1 + vision_feature_layer``; the text part through
    ``hf_config.model_config_from_hf`` (``tie_word_embeddings`` as the LLaVA model ties: either level).

    Raises:
        ValueError: naming the HF key: another ``model_type`` (LLaVA-NeXT, ...), ``image_grid_pinpoints``, a
            non-CLIP vision tower, a non-Llama text model, ``vision_feature_layer`` other than -1/-2 (or a list),
            ``vision_feature_select_strategy`` "full", projector without bias, an unknown activation,
            ``image_seq_length`` other than ``(image_size // patch_size) ** 2``; the text model's refusals.
    """
    as_dict = hf_config if isinstance(hf_config, dict) else hf_config.to_dict()
    _refuse(as_dict)
    llava = _as_llava_config(hf_config)
    v = llava.vision_config
    vision = VisionConfig(hidden_size=v.hidden_size, num_layers=v.num_hidden_layers + 1 + llava.vision_feature_layer,
                          num_attention_heads=v.num_attention_heads, ffn_hidden_size=v.intermediate_size,
                          image_size=v.image_size, patch_size=v.patch_size, num_channels=v.num_channels,
                          layer_norm_eps=float(v.layer_norm_eps), hidden_act=v.hidden_act,
                          projector_hidden_act=llava.projector_hidden_act)
    seq_length = as_dict.get("image_seq_length", vision.image_seq_length)
    if seq_length != vision.image_seq_length:
        raise ValueError(f"unsupported LLaVA config image_seq_length={seq_length}: (image_size // patch_size) ** 2 = "
                         f"{vision.image_seq_length} image embeddings per image reach the language model")
    text_config = llava.text_config.__class__(**{**llava.text_config.to_dict(), "tie_word_embeddings": bool(
        llava.tie_word_embeddings or llava.text_config.tie_word_embeddings)})
    text = model_config_from_hf(text_config, attention_backend=attention_backend, params_dtype=params_dtype)
    return VLMConfig(text=text, vision=vision, image_token_id=int(llava.image_token_index))


def hf_config_from_vlm_config(cfg: VLMConfig, base=None):
    """The transformers ``LlavaConfig`` describing ``cfg``, for export: CLIP with ``cfg.vision.num_layers`` layers
    and ``vision_feature_layer=-1`` (the same model as an original with ``-2`` and one more layer), the text config
    through ``hf_config.hf_config_from_model_config`` (with ``base``'s ``text_config``), other keys of ``base``
    (a ``LlavaConfig`` or its dict) kept."""
    from transformers import CLIPVisionConfig, LlavaConfig

    base = base.to_dict() if hasattr(base, "to_dict") else dict(base or {})
    v = cfg.vision
    vision = {**(base.get("vision_config") or {}), "hidden_size": v.hidden_size, "num_hidden_layers": v.num_layers,
              "num_attention_heads": v.num_attention_heads, "intermediate_size": v.ffn_hidden_size,
              "image_size": v.image_size, "patch_size": v.patch_size, "num_channels": v.num_channels,
              "layer_norm_eps": v.layer_norm_eps, "hidden_act": v.hidden_act}
    vision = {k: val for k, val in vision.items() if k not in ("model_type", "transformers_version")}
    text = hf_config_from_model_config(cfg.text, base=base.get("text_config"))
    for key in ("model_type", "transformers_version", "vision_config", "text_config", "architectures"):
        base.pop(key, None)
    base.update(vision_feature_layer=-1, vision_feature_select_strategy="default", image_token_index=cfg.image_token_id,
                image_seq_length=v.image_seq_length, projector_hidden_act=v.projector_hidden_act,
                multimodal_projector_bias=True, tie_word_embeddings=cfg.text.tie_word_embeddings)
    out = LlavaConfig(vision_config=CLIPVisionConfig(**vision), text_config=text, **base)
    out.architectures = ["LlavaForConditionalGeneration"]
    return out


def canonical_llava_name(name: str) -> str:
    """transformers 5's name for an HF LLaVA tensor name of either naming (:data:`LEGACY_PREFIXES`)."""
    for old, new in LEGACY_PREFIXES:
        if name.startswith(old):
            return new + name[len(old):]
    return name


def llava_hf_tensor_shapes(cfg: VLMConfig) -> dict[str, tuple[int, ...]]:
    """Every HF tensor (transformers 5 names) a LLaVA checkpoint of ``cfg`` must hold, with its full shape (layouts
    above): ``lm_head.weight`` only when the embeddings are not tied; not CLIP's unused ``post_layernorm``."""
    shapes = {(TEXT + n[len("model."):] if n.startswith("model.") else n): hf_tensor_shape(n, cfg.text)
              for n in hf_tensor_names(cfg.text)}
    v, h = cfg.vision, cfg.text.hidden_size
    hv, fv, p = v.hidden_size, v.ffn_hidden_size, v.patch_size
    shapes.update({f"{VISION}embeddings.class_embedding": (hv,),
                   f"{VISION}embeddings.patch_embedding.weight": (hv, v.num_channels, p, p),
                   f"{VISION}embeddings.position_embedding.weight": (v.image_seq_length + 1, hv),
                   f"{VISION}pre_layrnorm.weight": (hv,), f"{VISION}pre_layrnorm.bias": (hv,),
                   f"{PROJECTOR}linear_1.weight": (h, hv), f"{PROJECTOR}linear_1.bias": (h,),
                   f"{PROJECTOR}linear_2.weight": (h, h), f"{PROJECTOR}linear_2.bias": (h,)})
    layer = {"layer_norm1.weight": (hv,), "layer_norm1.bias": (hv,), "layer_norm2.weight": (hv,),
             "layer_norm2.bias": (hv,), "mlp.fc1.weight": (fv, hv), "mlp.fc1.bias": (fv,), "mlp.fc2.weight": (hv, fv),
             "mlp.fc2.bias": (hv,), **{f"self_attn.{n}_proj.{kind}": (hv, hv) if kind == "weight" else (hv,)
                                       for n in ("q", "k", "v", "out") for kind in ("weight", "bias")}}
    for i in range(v.num_layers):
        shapes.update({f"{VISION}encoder.layers.{i}.{suffix}": shape for suffix, shape in layer.items()})
    return shapes


def check_hf_llava_weight_files(path, cfg: VLMConfig, clip_layers: int) -> None:
    """Check an HF LLaVA folder's safetensors files against ``cfg`` from their headers alone (no tensor is read),
    as ``hf_files.check_hf_weight_files`` does for a text model: every tensor floating point, of a name either
    naming reads (:func:`canonical_llava_name`) and of the shape ``cfg`` implies (:func:`llava_hf_tensor_shapes`),
    none missing. Tensors LLaVA does not use are accepted: CLIP's ``post_layernorm``, its layers from
    ``cfg.vision.num_layers`` to ``clip_layers`` (the HF config's ``num_hidden_layers``; ``vision_feature_layer=-2``
    leaves the last unused), a tied model's ``lm_head.weight``, rotary and position-id buffers.

    Raises:
        FileNotFoundError: ``path`` holds no safetensors file.
        ValueError: naming the file: unreadable, a tensor that is not floating point or has another shape than
            ``cfg`` implies; naming the folder: tensors of another architecture, or one ``cfg`` needs is missing.
    """
    shapes = llava_hf_tensor_shapes(cfg)
    lm_head = hf_tensor_shape("lm_head.weight", cfg.text)      # a tied model's file may hold it
    spare = (f"{VISION}post_layernorm.", *(f"{VISION}encoder.layers.{i}." for i in range(cfg.vision.num_layers,
                                                                                          clip_layers)))
    check_weight_headers(path, lambda name: shapes.get(name) or (lm_head if name == "lm_head.weight" else None),
                         shapes, canonical=canonical_llava_name, spare=spare, name_hint=" (transformers 5 name)")


def llava_hf_names(cfg: VLMConfig):
    """Predicate on HF tensor names of either naming: those :func:`hf_to_megatron_llava_state_dict` reads (for
    ``hf_files.load_hf_checkpoint(keep=...)``: the unused CLIP layer is not read)."""
    shapes = llava_hf_tensor_shapes(cfg)
    return lambda name: canonical_llava_name(name) in shapes


def _shard(t: Tensor, dim: int, tp_rank: int, tp_size: int) -> Tensor:
    return t.chunk(tp_size, dim=dim)[tp_rank].clone()


def _pack_heads_qkv(q: Tensor, k: Tensor, v: Tensor, heads: int, tp_rank: int, tp_size: int) -> Tensor:
    """HF q/k/v ``[nv * hnv, *]`` (weight or bias) -> megatron ``[nv/tp * 3 * hnv, *]``, per head ``[q, k, v]``."""
    rest = q.shape[1:]
    grouped = torch.cat([x.reshape(heads, -1, *rest) for x in (q, k, v)], 1)    # [nv, 3 hnv, *]
    return _shard(grouped, 0, tp_rank, tp_size).reshape(-1, *rest)


def _unpack_heads_qkv(shards: Sequence[Tensor], heads: int) -> tuple[Tensor, Tensor, Tensor]:
    """Inverse of :func:`_pack_heads_qkv` over every TP shard in rank order."""
    full = torch.cat(list(shards), 0)
    rest = full.shape[1:]
    q, k, v = full.reshape(heads, 3, -1, *rest).unbind(1)
    return q.reshape(-1, *rest).contiguous(), k.reshape(-1, *rest).contiguous(), v.reshape(-1, *rest).contiguous()


_CLIP_NORMS = (("layer_norm1", "input_layernorm"), ("layer_norm2", "pre_mlp_layernorm"))
_ROW_PARALLEL = (("self_attn.out_proj", "self_attention.linear_proj"), ("mlp.fc2", "mlp.linear_fc2"))


def hf_to_megatron_llava_state_dict(hf_state: dict[str, Tensor], cfg: VLMConfig, tp_rank: int = 0,
                                   tp_size: int = 1) -> dict[str, Tensor]:
    """TP rank ``tp_rank``'s ``LLaVAModel`` state dict from a full HF LLaVA state dict (layouts above).

    Returns:
        megatron names -> fresh tensors of this rank's shard (no ``_extra_state``), in ``hf_state``'s dtypes.

    Raises:
        KeyError: naming a missing HF tensor.
    """
    hf_state = {canonical_llava_name(k): val for k, val in hf_state.items()}
    text = {("model." + k[len(TEXT):] if k.startswith(TEXT) else k): val for k, val in hf_state.items()
            if k.startswith(TEXT) or k == "lm_head.weight"}
    out = {"language_model." + k: val for k, val in hf_to_megatron_state_dict(text, cfg.text, tp_rank, tp_size).items()}
    v, mv = VISION, "vision_model."
    out[mv + "class_token"] = hf_state[v + "embeddings.class_embedding"].reshape(1, 1, -1).clone()
    out[mv + "conv1.weight"] = hf_state[v + "embeddings.patch_embedding.weight"].clone()
    out[mv + "position_embeddings.weight"] = hf_state[v + "embeddings.position_embedding.weight"].clone()
    for kind in ("weight", "bias"):
        out[f"{mv}ln_pre.{kind}"] = hf_state[f"{v}pre_layrnorm.{kind}"].clone()
        for i in range(cfg.vision.num_layers):
            hf, mg = f"{v}encoder.layers.{i}.", f"{mv}decoder.layers.{i}."
            for hf_norm, mg_norm in _CLIP_NORMS:
                out[f"{mg}{mg_norm}.{kind}"] = hf_state[f"{hf}{hf_norm}.{kind}"].clone()
            q, k, val = (hf_state[f"{hf}self_attn.{n}_proj.{kind}"] for n in "qkv")
            out[f"{mg}self_attention.linear_qkv.{kind}"] = _pack_heads_qkv(q, k, val, cfg.vision.num_attention_heads,
                                                                         tp_rank, tp_size)
            out[f"{mg}mlp.linear_fc1.{kind}"] = _shard(hf_state[f"{hf}mlp.fc1.{kind}"], 0, tp_rank, tp_size)
            for hf_name, mg_name in _ROW_PARALLEL:
                t = hf_state[f"{hf}{hf_name}.{kind}"]
                out[f"{mg}{mg_name}.{kind}"] = _shard(t, 1, tp_rank, tp_size) if kind == "weight" else t.clone()
        out[f"vision_projection.encoder.linear_fc1.{kind}"] = _shard(hf_state[f"{PROJECTOR}linear_1.{kind}"], 0,
                                                                     tp_rank, tp_size)
        t = hf_state[f"{PROJECTOR}linear_2.{kind}"]
        out[f"vision_projection.encoder.linear_fc2.{kind}"] = _shard(t, 1, tp_rank, tp_size) if kind == "weight" \
            else t.clone()
    return out


def megatron_to_hf_llava_state_dict(shards: Sequence[dict[str, Tensor]], cfg: VLMConfig) -> dict[str, Tensor]:
    """Full HF LLaVA state dict (transformers 5 names) from every TP rank's ``LLaVAModel`` state dict (``shards[r]``
    = rank ``r``'s; ``_extra_state`` ignored). CLIP's unused ``post_layernorm`` is written as weight 1, bias 0 (its
    initial value) so that transformers loads the folder without missing tensors.

    Raises:
        KeyError: naming a megatron tensor missing from a shard.
    """
    def cat(name: str, dim: int) -> Tensor:
        return torch.cat([s[name] for s in shards], dim).contiguous()

    first = shards[0]
    text_shards = [{k[len("language_model."):]: val for k, val in s.items() if k.startswith("language_model.")}
                   for s in shards]
    out = {(TEXT + k[len("model."):] if k.startswith("model.") else k): val
           for k, val in megatron_to_hf_state_dict(text_shards, cfg.text).items()}
    v, mv = VISION, "vision_model."
    out[v + "embeddings.class_embedding"] = first[mv + "class_token"].reshape(-1).clone()
    out[v + "embeddings.patch_embedding.weight"] = first[mv + "conv1.weight"].clone()
    out[v + "embeddings.position_embedding.weight"] = first[mv + "position_embeddings.weight"].clone()
    for kind in ("weight", "bias"):
        out[f"{v}pre_layrnorm.{kind}"] = first[f"{mv}ln_pre.{kind}"].clone()
        for i in range(cfg.vision.num_layers):
            hf, mg = f"{v}encoder.layers.{i}.", f"{mv}decoder.layers.{i}."
            for hf_norm, mg_norm in _CLIP_NORMS:
                out[f"{hf}{hf_norm}.{kind}"] = first[f"{mg}{mg_norm}.{kind}"].clone()
            q, k, val = _unpack_heads_qkv([s[f"{mg}self_attention.linear_qkv.{kind}"] for s in shards],
                                          cfg.vision.num_attention_heads)
            for n, t in zip("qkv", (q, k, val)):
                out[f"{hf}self_attn.{n}_proj.{kind}"] = t
            out[f"{hf}mlp.fc1.{kind}"] = cat(f"{mg}mlp.linear_fc1.{kind}", 0)
            for hf_name, mg_name in _ROW_PARALLEL:
                name = f"{mg}{mg_name}.{kind}"
                out[f"{hf}{hf_name}.{kind}"] = cat(name, 1) if kind == "weight" else first[name].clone()
        out[f"{PROJECTOR}linear_1.{kind}"] = cat(f"vision_projection.encoder.linear_fc1.{kind}", 0)
        name = f"vision_projection.encoder.linear_fc2.{kind}"
        out[f"{PROJECTOR}linear_2.{kind}"] = cat(name, 1) if kind == "weight" else first[name].clone()
    norm = first[mv + "ln_pre.weight"]
    out[v + "post_layernorm.weight"] = torch.ones_like(norm)
    out[v + "post_layernorm.bias"] = torch.zeros_like(norm)
    return out


def load_hf_llava_state_into_model(model, hf_state: dict[str, Tensor], cfg: VLMConfig, tp_rank: int = 0,
                                   tp_size: int = 1) -> None:
    """Copy a full HF LLaVA state dict into this rank's ``LLaVAModel`` (``vlm.build_llava_model(cfg)``), cast to
    the model's dtypes. Tied embeddings: ``lm_head.weight`` is not read.

    Raises:
        KeyError: naming a missing HF tensor; RuntimeError: (torch's ``load_state_dict``) a shape that differs.
    """
    load_mapped_state(model, hf_to_megatron_llava_state_dict(hf_state, cfg, tp_rank, tp_size))


def save_hf_llava_checkpoint(model, cfg: VLMConfig, out_dir, hf_config=None, tokenizer_dir=None,
                             tp_group=None, dtype: torch.dtype | None = None) -> None:
    """Write ``model`` (this rank's ``LLaVAModel`` shard) as an HF LLaVA folder that
    ``LlavaForConditionalGeneration.from_pretrained`` loads: the TP shards are all-gathered over ``tp_group``
    (every TP rank briefly holds the full tensors), global rank 0 writes (``hf_files.write_hf_checkpoint``:
    safetensors in ``dtype``, default the model's, ``config.json`` from :func:`hf_config_from_vlm_config` with
    ``hf_config`` as base, the tokenizer and processor files of ``tokenizer_dir`` (a ``LlavaProcessor`` folder's
    ``processor_config.json`` / ``preprocessor_config.json`` too)), then every rank waits.
    """
    state = {k: v.detach() if dtype is None else v.detach().to(dtype) for k, v in model.state_dict().items()
             if not k.endswith("_extra_state")}
    _, tp_size = rank_and_size(tp_group)
    shards = [state]
    if tp_size > 1:
        gathered = {}
        for name, t in state.items():
            parts = [torch.empty_like(t) for _ in range(tp_size)]
            torch.distributed.all_gather(parts, t.contiguous(), group=tp_group)
            gathered[name] = parts
        shards = [{name: parts[r] for name, parts in gathered.items()} for r in range(tp_size)]
    if global_rank() == 0:
        write_hf_checkpoint(megatron_to_hf_llava_state_dict(shards, cfg), hf_config_from_vlm_config(cfg, hf_config),
                            out_dir, tokenizer_dir, processor=True)
    barrier()
