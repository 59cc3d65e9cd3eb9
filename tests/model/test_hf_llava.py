"""HF LLaVA-1.5 <-> megatron LLaVAModel: config translation and refusals, tensor layouts, exact round trips."""

import pytest
import torch
from distributed_helpers import parallel_state_1proc  # noqa: F401 - fixture
from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration

from packsft.model.hf_files import load_hf_checkpoint
from packsft.model.hf_llava import (
    canonical_llava_name,
    hf_config_from_vlm_config,
    hf_to_megatron_llava_state_dict,
    load_hf_llava_state_into_model,
    megatron_to_hf_llava_state_dict,
    save_hf_llava_checkpoint,
    vlm_config_from_hf,
)
from packsft.model.vlm import build_llava_model

VOCAB, IMAGE_ID = 300, 299
CLIP_LAYERS = 3                     # vision_feature_layer=-2: megatron builds 2, HF's last layer is unused


def llava_config(**overrides) -> LlavaConfig:
    """Tiny LLaVA-1.5: CLIP 3 layers, width 32, 28 px images of 14 px patches (4 image tokens); Llama 2 layers,
    width 64, GQA 4/2, vocabulary 300 (image token 299), untied."""
    vision = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=CLIP_LAYERS,
                              num_attention_heads=4, image_size=28, patch_size=14, layer_norm_eps=1e-5,
                              projection_dim=16)
    text = LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=256, rope_theta=50000.0,
                       rms_norm_eps=1e-6, tie_word_embeddings=False)
    fields = dict(vision_config=vision, text_config=text, image_token_index=IMAGE_ID, image_seq_length=4,
                  vision_feature_layer=-2, vision_feature_select_strategy="default", tie_word_embeddings=False)
    return LlavaConfig(**{**fields, **overrides})


def hf_llava(seed=0, **overrides) -> LlavaForConditionalGeneration:
    """A random tiny HF LLaVA in fp32 eval mode; every weight (norms, biases) perturbed away from its init."""
    torch.manual_seed(seed)
    model = LlavaForConditionalGeneration(llava_config(**overrides)).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return model


def unused(name: str) -> bool:
    """HF tensors LLaVA-1.5 (vision_feature_layer=-2) never uses: CLIP's last layer and post_layernorm."""
    return f"encoder.layers.{CLIP_LAYERS - 1}." in name or "post_layernorm" in name


def test_config_translation():
    cfg = vlm_config_from_hf(llava_config())
    assert (cfg.vision.num_layers, cfg.vision.image_seq_length, cfg.image_token_id) == (2, 4, IMAGE_ID)
    assert (cfg.vision.hidden_act, cfg.vision.projector_hidden_act) == ("quick_gelu", "gelu")
    assert cfg.text.num_layers == 2 and cfg.text.rotary_base == 50000.0 and not cfg.text.tie_word_embeddings
    assert vlm_config_from_hf(llava_config().to_dict()) == cfg
    assert vlm_config_from_hf(llava_config(vision_feature_layer=-1)).vision.num_layers == 3
    assert vlm_config_from_hf(llava_config(tie_word_embeddings=True)).text.tie_word_embeddings
    back = hf_config_from_vlm_config(cfg, base=llava_config())
    assert back.vision_feature_layer == -1 and back.vision_config.num_hidden_layers == 2
    assert back.vision_config.projection_dim == 16 and back.architectures == ["LlavaForConditionalGeneration"]
    assert vlm_config_from_hf(back) == cfg


@pytest.mark.parametrize("overrides, key", [
    (dict(vision_feature_layer=-3), "vision_feature_layer"),
    (dict(vision_feature_layer=[-2, -1]), "vision_feature_layer"),
    (dict(vision_feature_select_strategy="full"), "vision_feature_select_strategy"),
    (dict(multimodal_projector_bias=False), "multimodal_projector_bias"),
    (dict(image_seq_length=576), "image_seq_length"),
    (dict(text_config={"model_type": "qwen2", "vocab_size": VOCAB}), "text_config.model_type"),
    (dict(vision_config={"model_type": "siglip_vision_model"}), "vision_config.model_type"),
])
def test_unsupported_configs_are_refused_by_key(overrides, key):
    with pytest.raises(ValueError, match=rf"unsupported LLaVA config {key}="):
        vlm_config_from_hf(llava_config(**overrides))


def test_llava_next_is_refused_by_name():
    config = {**llava_config().to_dict(), "model_type": "llava_next", "image_grid_pinpoints": [[336, 672]]}
    with pytest.raises(ValueError, match="model_type='llava_next'"):
        vlm_config_from_hf(config)
    config["model_type"] = "llava"
    with pytest.raises(ValueError, match="image_grid_pinpoints"):
        vlm_config_from_hf(config)


def test_clip_qkv_is_interleaved_per_head_and_sharded_by_heads():
    model = hf_llava()
    cfg = vlm_config_from_hf(model.config)
    state = dict(model.state_dict())
    prefix = "model.vision_tower.encoder.layers.0.self_attn."
    for n, base in zip("qkv", (0, 100, 200)):
        state[f"{prefix}{n}_proj.bias"] = base + torch.arange(32.0)        # 4 heads of 8
    shards = [hf_to_megatron_llava_state_dict(state, cfg, r, 2) for r in range(2)]
    bias = [s["vision_model.decoder.layers.0.self_attention.linear_qkv.bias"].tolist() for s in shards]
    head = lambda h: [b + h * 8 + i for b in (0, 100, 200) for i in range(8)]   # noqa: E731 - [q_h, k_h, v_h]
    assert bias == [head(0) + head(1), head(2) + head(3)]
    fc2 = "vision_model.decoder.layers.0.mlp.linear_fc2"
    assert shards[0][fc2 + ".weight"].shape == (32, 32) and torch.equal(shards[1][fc2 + ".bias"],
                                                                         state["model.vision_tower.encoder.layers.0."
                                                                               "mlp.fc2.bias"])
    assert shards[0]["vision_model.class_token"].shape == (1, 1, 32)


@pytest.mark.parametrize("tp", [1, 2])
def test_state_dict_round_trip_is_exact(tp):
    model = hf_llava()
    cfg = vlm_config_from_hf(model.config)
    original = model.state_dict()
    shards = [hf_to_megatron_llava_state_dict(original, cfg, r, tp) for r in range(tp)]
    back = megatron_to_hf_llava_state_dict(shards, cfg)
    used = {k for k in original if not unused(k)}
    assert set(back) == used | {"model.vision_tower.post_layernorm.weight", "model.vision_tower.post_layernorm.bias"}
    assert all(torch.equal(back[k], original[k]) for k in used)
    assert torch.equal(back["model.vision_tower.post_layernorm.weight"], torch.ones(32))


def test_legacy_names_are_read():
    assert canonical_llava_name("language_model.model.layers.0.mlp.up_proj.weight") == \
        "model.language_model.layers.0.mlp.up_proj.weight"
    assert canonical_llava_name("language_model.lm_head.weight") == "lm_head.weight"
    assert canonical_llava_name("vision_tower.vision_model.pre_layrnorm.bias") == "model.vision_tower.pre_layrnorm.bias"
    model = hf_llava()
    cfg = vlm_config_from_hf(model.config)
    legacy = {k.replace("model.language_model.", "language_model.model.").replace("lm_head.", "language_model.lm_head.")
              .replace("model.vision_tower.", "vision_tower.vision_model.")
              .replace("model.multi_modal_projector.", "multi_modal_projector."): v
              for k, v in model.state_dict().items()}
    new, old = hf_to_megatron_llava_state_dict(model.state_dict(), cfg), hf_to_megatron_llava_state_dict(legacy, cfg)
    assert new.keys() == old.keys() and all(torch.equal(new[k], old[k]) for k in new)


def test_export_loads_in_transformers_and_gives_the_same_logits():
    model = hf_llava(seed=3)
    cfg = vlm_config_from_hf(model.config)
    exported = LlavaForConditionalGeneration(hf_config_from_vlm_config(cfg, base=model.config)).eval()
    state = megatron_to_hf_llava_state_dict([hf_to_megatron_llava_state_dict(model.state_dict(), cfg)], cfg)
    exported.load_state_dict(state, strict=True)
    tokens = torch.tensor([[5, 6] + [IMAGE_ID] * 4 + [7, 8, 9]])
    pixels = torch.randn(1, 3, 28, 28, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(exported(input_ids=tokens, pixel_values=pixels).logits,
                                   model(input_ids=tokens, pixel_values=pixels).logits, atol=1e-5, rtol=0)


def test_folder_round_trip_through_the_megatron_model(tmp_path, parallel_state_1proc):  # noqa: F811
    """save_pretrained folder -> load_hf_checkpoint -> megatron LLaVAModel -> save_hf_llava_checkpoint ->
    from_pretrained: the same tensors LLaVA uses and the same logits."""
    model = hf_llava(seed=5)
    model.save_pretrained(tmp_path / "src")
    hf_config, hf_state = load_hf_checkpoint(tmp_path / "src")
    cfg = vlm_config_from_hf(hf_config)
    megatron = build_llava_model(cfg).eval()
    load_hf_llava_state_into_model(megatron, hf_state, cfg)
    save_hf_llava_checkpoint(megatron, cfg, tmp_path / "out", hf_config=hf_config)
    exported = LlavaForConditionalGeneration.from_pretrained(tmp_path / "out", dtype=torch.float32).eval()
    original, back = model.state_dict(), exported.state_dict()
    assert all(torch.equal(back[k], original[k]) for k in original if not unused(k))
    tokens = torch.tensor([[IMAGE_ID] * 4 + [7, 8, 9]])
    pixels = torch.randn(1, 3, 28, 28, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(exported(input_ids=tokens, pixel_values=pixels).logits,
                                   model(input_ids=tokens, pixel_values=pixels).logits, atol=1e-5, rtol=0)
