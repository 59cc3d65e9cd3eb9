"""The image-text half of ``tools/convert_checkpoint.py``: HF LLaVA-1.5 (``LlavaForConditionalGeneration``) <->
packsft's megatron ``LLaVAModel`` checkpoint (:mod:`packsft.train.convert` routes here).

``import``: an HF folder whose ``config.json`` has a ``vision_config`` (an image-text model) -> the same model-only
checkpoint as a text import (``model_checkpoint.save_megatron_checkpoint`` of the ``LLaVAModel``, any TP size) with
``model_config.json`` (the language model's ``ModelConfig``) and ``vision_config.json`` (:func:`vision_fields`).
Only LLaVA-1.5 maps: megatron-core 0.16's ``LLaVAModel`` is CLIP ViT + MLP projector + GPT, so LLaVA-NeXT /
OneVision (image tiling), Qwen2-VL (M-RoPE, its own ViT) and others are refused naming the key
(``hf_llava.vlm_config_from_hf``). ``export``: such a folder, or a training checkpoint of a run with a ``vision:``
section, -> an HF LLaVA folder (``hf_llava.save_hf_llava_checkpoint``) with the tokenizer and processor files of
``--tokenizer`` (default for a training checkpoint: the run's ``data.tokenizer``, its processor folder).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import asdict, fields
from pathlib import Path

import torch

from packsft.io import read_json_object
from packsft.model.config import VISION_CONFIG_FILE, ModelConfig, config_from_dict
from packsft.model.hf_files import load_hf_checkpoint
from packsft.model.hf_llava import (
    check_hf_llava_weight_files,
    hf_config_from_vlm_config,
    llava_hf_names,
    load_hf_llava_state_into_model,
    save_hf_llava_checkpoint,
    vlm_config_from_hf,
)
from packsft.model.vlm import VisionConfig, VLMConfig, build_llava_model
from packsft.process_groups import rank_and_size
from packsft.train.model_checkpoint import load_megatron_checkpoint, save_megatron_checkpoint


def is_image_text(hf_config) -> bool:
    """Whether an HF config (a transformers config or its dict) describes an image-text model (it has a
    ``vision_config``): imported by :func:`import_llava`, which refuses all but LLaVA-1.5 by key."""
    vision = hf_config.get("vision_config") if isinstance(hf_config, dict) else getattr(hf_config, "vision_config",
                                                                                          None)
    return vision is not None


def vision_fields(cfg: VLMConfig) -> dict:
    """``vision_config.json``'s content: ``VisionConfig`` fields and ``image_token_id`` (the ``vision:`` section)."""
    return {**asdict(cfg.vision), "image_token_id": cfg.image_token_id}


def vlm_config_from_fields(text: ModelConfig, vision: dict, where: str) -> VLMConfig:
    """The ``VLMConfig`` of a language model and a ``vision_config.json`` / recorded ``vision:`` section.

    Raises:
        ValueError: ``"{where}: ..."`` naming unknown, missing or invalid fields; ``image_token_id`` null (a run
            that took it from its processor: the caller resolves it first).
    """
    values = {k: v for k, v in vision.items() if k != "image_token_id"}
    token_id = vision.get("image_token_id")
    if not isinstance(token_id, int) or isinstance(token_id, bool) or token_id < 0:
        raise ValueError(f"{where}: image_token_id is {token_id!r}, not the image token's id (an int >= 0)")
    fields_of = config_from_dict(VisionConfig, values, where)
    return VLMConfig(text=text, vision=VisionConfig(**{f.name: getattr(fields_of, f.name)
                                                       for f in fields(VisionConfig)}), image_token_id=token_id)


def recorded_vision(megatron: Path, sections: dict | None) -> tuple[dict | None, str]:
    """The vision side of a checkpoint to export, and where it was read: a training checkpoint's recorded
    ``vision:`` section (``sections``: ``compat.recorded_architecture``; empty: a text run), else the folder's
    ``vision_config.json`` (an import); ``(None, "")`` for a text model."""
    if sections is not None:
        return (sections.get("vision") or None), f"{megatron}/train_state.json vision"
    file = megatron / VISION_CONFIG_FILE
    return (read_json_object(file), str(file)) if file.is_file() else (None, "")


def _one_stage(args: argparse.Namespace, verb: str) -> None:
    """Refuse ``--pipeline-model-parallel-size`` > 1: packsft has no pipeline split of a LLaVA model (the training
    config's ``VISION_RELATIONS`` refuse it too). Raises ``ValueError`` naming the option."""
    if args.pipeline_model_parallel_size > 1:
        raise ValueError(f"--pipeline-model-parallel-size {args.pipeline_model_parallel_size}: a LLaVA model is "
                         f"{verb} as one pipeline stage (the checkpoint loads at any TP size)")


def import_llava(args: argparse.Namespace, ctx, hf_config) -> None:
    """``convert_checkpoint.py import`` of an image-text HF folder (``hf_config``: its config, read already):
    refusals before any weight is read (the config by key, ``--pipeline-model-parallel-size`` > 1, the weight files'
    headers), then every rank builds its TP shard of the ``LLaVAModel``, reads the tensors it uses and saves.

    Raises:
        ValueError: naming the HF key (``vlm_config_from_hf``), the option, or the weight file / tensor.
    """
    _one_stage(args, "imported")
    cfg = vlm_config_from_hf(hf_config, attention_backend=args.attention_backend, params_dtype=args.params_dtype)
    tp_rank, tp_size = rank_and_size(ctx.tp_group)
    cfg.text.check_parallel_fit(tp_size)
    check_hf_llava_weight_files(args.hf, cfg, clip_layers=hf_config.vision_config.num_hidden_layers)
    model = build_llava_model(cfg)
    hf_config, hf_state = load_hf_checkpoint(args.hf, keep=llava_hf_names(cfg))
    load_hf_llava_state_into_model(model, hf_state, cfg, tp_rank, tp_size)
    del hf_state
    save_megatron_checkpoint(model, cfg.text, args.out, hf_config=hf_config, vision=vision_fields(cfg))


def resolve_image_token(vision: dict, tokenizer: str | None, hf_config: dict | None, where: str) -> dict:
    """``vision`` with ``image_token_id`` set: a run that left it null took its processor's (``data.tokenizer``),
    which ``tokenizer`` (the export's processor folder) gives again, else the HF config's ``image_token_index``.

    Raises:
        ValueError: neither is there (naming ``where`` and what to pass), or the processor does not load.
    """
    if vision.get("image_token_id") is not None:
        return vision
    if tokenizer is not None:
        from packsft.data.multimodal import load_processor

        return {**vision, "image_token_id": load_processor(tokenizer)[1].image_token_id}
    if hf_config is not None and hf_config.get("image_token_index") is not None:
        return {**vision, "image_token_id": int(hf_config["image_token_index"])}
    raise ValueError(f"{where}: image_token_id is null (the run took its processor's): pass --tokenizer <the "
                     "processor folder of data.tokenizer>")


def default_processor(args: argparse.Namespace, saved: dict | None) -> str | None:
    """The processor folder an export of a LLaVA checkpoint copies: ``--tokenizer``, else a training
    checkpoint's (``saved``: its ``train_state.json``) recorded ``data.tokenizer`` when that folder exists here (a
    note says so), else None. The folder is checked as training checks ``data.tokenizer``
    (:func:`packsft.data.multimodal.load_processor`), before anything is written.

    Raises:
        ValueError: ``"--tokenizer: FOLDER: ..."`` (or ``"the run's data.tokenizer: ..."``): not a LLaVA-1.5
            processor folder (a text tokenizer's, say) or one that does not load.
    """
    folder, field = args.tokenizer, "--tokenizer"
    if not folder and saved is not None:
        import yaml

        recorded = ((yaml.safe_load(saved.get("config") or "") or {}).get("data") or {}).get("tokenizer")
        if recorded and Path(recorded).is_dir():
            print(f"note: the processor and tokenizer files are copied from the run's data.tokenizer {recorded} "
                  "(--tokenizer overrides)", file=sys.stderr)
            folder, field = str(recorded), "the run's data.tokenizer"
    if folder:
        from packsft.data.multimodal import load_processor

        load_processor(folder, field)
    return folder


def export_llava(args: argparse.Namespace, ctx, cfg: VLMConfig, hf_config: dict | None, origin: str,
                 megatron: Path) -> None:
    """``convert_checkpoint.py export`` of a LLaVA checkpoint: the HF config checked before any weight is read
    (transformers builds the ``LlavaConfig`` from ``cfg`` over ``hf_config``), then every rank builds its TP shard,
    loads ``megatron`` and the TP shards are gathered and written by rank 0 (``save_hf_llava_checkpoint``: safetensors
    in ``--dtype``, default the parameters', ``config.json``, the files of ``args.tokenizer``).

    Raises:
        ValueError: ``origin`` named: transformers refuses the config; ``--pipeline-model-parallel-size`` > 1.
    """
    _one_stage(args, "exported")
    try:                        # before any weight is read, on every rank
        hf_config_from_vlm_config(cfg, base=hf_config)
    except (ValueError, TypeError) as err:
        raise ValueError(f"{origin}: transformers refuses the LLaVA config.json built from it and the model config: "
                         f"{' '.join(str(err).split())}") from None
    model = build_llava_model(cfg)
    load_megatron_checkpoint(model, megatron)
    save_hf_llava_checkpoint(model, cfg, args.out, hf_config=hf_config, tokenizer_dir=args.tokenizer,
                             tp_group=ctx.tp_group, dtype=getattr(torch, args.dtype) if args.dtype else None)
