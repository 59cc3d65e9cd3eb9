"""The ``vision:`` section of the training configuration: the CLIP tower and image token of a LLaVA-1.5 model.

``vision: null`` (the default) trains a text model; a ``vision:`` section trains megatron-core's ``LLaVAModel``
(:func:`packsft.model.vlm.build_llava_model`): ``model`` is its language model, this section its vision side. Its
fields are :class:`packsft.model.vlm.VisionConfig`'s plus ``image_token_id``; the rules between it and the other
sections are :data:`VISION_RELATIONS` (in :attr:`packsft.train.config.Config.relations`), checked once at load.
What the processor of ``data.tokenizer`` says (image size, image token) is checked against it when the trainer
builds the model (:func:`vlm_config`). The section is saved in checkpoints with the rest of the config and may not
change at resume (``packsft.train.compat.MAY_CHANGE``).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import ClassVar

from omegaconf import MISSING

from packsft.config_rules import POSITIVE, Needs, Rule, check_fields, ge, multiple_of, one_of, rules

VISION_ACTIVATIONS = ("quick_gelu", "gelu")
"""The activations the CLIP MLP and the projector may use (``packsft.model.vlm.ACTIVATIONS``' keys)."""


@dataclass
class VisionSectionConfig:
    """The ``vision:`` section (LLaVA-1.5: CLIP ViT-L/14-336 ``hidden_size`` 1024, ``num_layers`` 23 of its 24,
    ``num_attention_heads`` 16, ``ffn_hidden_size`` 4096, ``image_size`` 336, ``patch_size`` 14)."""

    hidden_size: int = field(default=MISSING, metadata=rules(*POSITIVE))
    """CLIP's ``hidden_size``."""
    num_layers: int = field(default=MISSING, metadata=rules(*POSITIVE))
    """The CLIP layers USED: HF ``num_hidden_layers + 1 + vision_feature_layer`` (LLaVA-1.5: 24 - 1 = 23)."""
    num_attention_heads: int = field(default=MISSING, metadata=rules(*POSITIVE))
    ffn_hidden_size: int = field(default=MISSING, metadata=rules(*POSITIVE))
    """CLIP's ``intermediate_size``."""
    image_size: int = field(default=MISSING, metadata=rules(*POSITIVE))
    """Pixels of the square image the tower takes: the processor's center crop (``data.tokenizer``)."""
    patch_size: int = field(default=MISSING, metadata=rules(*POSITIVE))
    """Pixels of a square patch; an image is ``(image_size / patch_size) ** 2`` image tokens."""
    num_channels: int = field(default=3, metadata=rules(one_of((3,))))
    """3 (RGB): megatron-core's CLIP patch embedding takes 3 channels."""
    layer_norm_eps: float = field(default=1e-5, metadata=rules(*POSITIVE))
    """Of CLIP's ``ln_pre`` and its layers' LayerNorms."""
    hidden_act: str = field(default="quick_gelu", metadata=rules(one_of(VISION_ACTIVATIONS)))
    """The CLIP MLP's activation."""
    projector_hidden_act: str = field(default="gelu", metadata=rules(one_of(VISION_ACTIVATIONS)))
    """Between the projector's two linears (HF ``projector_hidden_act``)."""
    image_token_id: int | None = field(default=None, metadata=rules(ge(0)))
    """The image token's id in ``model``'s vocabulary; null: the processor's (``data.tokenizer``); set, it must
    equal the processor's."""

    relations: ClassVar = (
        multiple_of("image_size", "patch_size"),
        multiple_of("hidden_size", "num_attention_heads"),
    )

    def __post_init__(self) -> None:
        """Raise ``ValueError`` naming the field for invalid values."""
        check_fields("vision", self)


VISION_RELATIONS = (
    Needs("vision", ("data.backend", "energon"), "image-text rows are read from an Energon dataset (a "
          "checkpoint.init_from that holds a LLaVA model brings its vision: section)"),
    Needs("vision", ("data.energon.model_family", "llava"), "the Energon loader reads the images of a LLaVA model"),
    Needs(("data.energon.model_family", Rule(lambda family: family is not None, "set")), "vision",
          "an image-text dataset trains a LLaVA model: give its vision: section"),
    Needs("vision", ("lora.enabled", False), "packsft's LoRA adapts a text model (its adapters-only checkpoints "
          "name a text base)"),
    Needs("vision", ("parallel.context_parallel_size", 1), "megatron-core's LLaVAModel needs TransformerEngine for "
          "context parallelism"),
    Needs("vision", ("parallel.pipeline_model_parallel_size", 1), "packsft has no pipeline split of a LLaVA model "
          "(one stage holds the vision encoder, the projector and the language model)"),
    Needs("vision", ("parallel.sequence_parallel", False), "megatron-core's LLaVAModel runs sequence parallelism "
          "only with TransformerEngine's attention"),
    Needs("vision", ("model.rope_interpolation_factor", None), "megatron-core's LLaVAModel builds its language "
          "model without seq_len_interpolation_factor"),
)
"""The rules between ``vision`` and the other sections: a LLaVA model <=> ``data.backend: energon`` with
``data.energon.model_family: llava``, and what it runs without."""


def vlm_config(model, vision: VisionSectionConfig, image):
    """The :class:`packsft.model.vlm.VLMConfig` of the ``model`` and ``vision`` sections, checked against the
    processor's :class:`packsft.data.multimodal.ImageSettings` ``image`` (of ``data.tokenizer``).

    Raises:
        ValueError: naming the keys: ``vision.image_size`` is not the processor's crop, the ids per image differ,
            or ``vision.image_token_id`` is set and is not the processor's image token id.
    """
    from packsft.model.vlm import VisionConfig, VLMConfig

    cfg = VisionConfig(**{f.name: getattr(vision, f.name) for f in fields(VisionConfig)})
    if (image.height, image.width) != (vision.image_size, vision.image_size):
        raise ValueError(f"vision.image_size ({vision.image_size}) is not the crop of the processor of "
                         f"data.tokenizer ({image.height} x {image.width} pixels)")
    if cfg.image_seq_length != image.image_seq_length:
        raise ValueError(f"vision: (image_size / patch_size) ** 2 = {cfg.image_seq_length} image tokens per image, "
                         f"the processor of data.tokenizer writes {image.image_seq_length} (its patch_size and "
                         "vision_feature_select_strategy)")
    token_id = image.image_token_id if vision.image_token_id is None else vision.image_token_id
    if token_id != image.image_token_id:
        raise ValueError(f"vision.image_token_id ({vision.image_token_id}) is not the id of the image token "
                         f"{image.image_token!r} of data.tokenizer ({image.image_token_id}); null takes the latter")
    return VLMConfig(text=model, vision=cfg, image_token_id=token_id)
