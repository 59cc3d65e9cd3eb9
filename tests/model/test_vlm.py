"""megatron-core's LLaVAModel with packsft's GPT: logits equal transformers' LLaVA-1.5 (one packed THD row of
image-text conversations vs each alone), TP=2 on gloo, image-token collapsing, a refused RoPE scaling."""

import dataclasses

import pytest
import torch
from distributed_helpers import parallel_state_1proc, run_distributed  # noqa: F401 - fixture
from test_hf_llava import IMAGE_ID, VOCAB, hf_llava

from packsft.data.context_parallel import make_packed_seq_params
from packsft.model.hf_llava import load_hf_llava_state_into_model, vlm_config_from_hf
from packsft.model.output_head import output_weight
from packsft.model.vlm import build_llava_model, collapse_image_tokens, llava_hidden_states, llava_logits

L = 4                                        # image tokens per image (28 px / 14 px patches, squared)


def conversations():
    """Three conversations as HF's processor expands them: (tokens [1, t], pixels [n, 3, 28, 28]); 1 image, 2
    images (one right at the start), none; lengths 13, 17, 6."""
    gen = torch.Generator().manual_seed(7)

    def text(n):
        return torch.randint(0, IMAGE_ID, (n,), generator=gen).tolist()

    image = [IMAGE_ID] * L
    layouts = [text(3) + image + text(6), image + text(2) + image + text(7), text(6)]
    return [(torch.tensor([ids]), torch.randn(ids.count(IMAGE_ID) // L, 3, 28, 28, generator=gen))
            for ids in layouts]


def megatron_from_hf(model, tp_rank=0, tp_size=1):
    cfg = vlm_config_from_hf(model.config)
    megatron = build_llava_model(cfg).eval()
    load_hf_llava_state_into_model(megatron, model.state_dict(), cfg, tp_rank, tp_size)
    return megatron


def hf_logits(model, tokens, pixels):
    with torch.no_grad():
        return model(input_ids=tokens, pixel_values=pixels if len(pixels) else None).logits[0]   # [t, v]


def packed_row(convs):
    """The conversations packed into one row: tokens [1, T], pixels [n, 3, 28, 28], THD params, offsets."""
    lengths = [t.shape[1] for t, _ in convs]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    tokens, pixels = torch.cat([t for t, _ in convs], 1), torch.cat([p for _, p in convs])
    return tokens, pixels, make_packed_seq_params(cu, max(lengths)), cu.tolist()


def test_collapse_image_tokens():
    tokens = torch.tensor([[1, 9, 9, 9, 9, 2, 9, 9, 9, 9, 9, 9, 9, 9, 3]])
    assert collapse_image_tokens(tokens, 9, 4).tolist() == [[1, 9, 2, 9, 9, 3]]           # adjacent images: 2 ids
    assert collapse_image_tokens(torch.tensor([[5, 6]]), 9, 4).tolist() == [[5, 6]]
    with pytest.raises(ValueError, match="run of 3 image tokens .id 9. at position 1"):
        collapse_image_tokens(torch.tensor([[1, 9, 9, 9, 2]]), 9, 4)


def test_linear_rope_scaling_is_refused(parallel_state_1proc):  # noqa: F811
    """An HF import reaches the builder with it (CP / PP sizes are refused by the config and the converter)."""
    cfg = vlm_config_from_hf(hf_llava().config)
    cfg = dataclasses.replace(cfg, text=dataclasses.replace(cfg.text, rope_interpolation_factor=2.0))
    with pytest.raises(ValueError, match="model.rope_interpolation_factor is not supported for LLaVA models"):
        build_llava_model(cfg)


def test_packed_row_logits_equal_transformers_per_conversation(parallel_state_1proc):  # noqa: F811
    model = hf_llava(seed=1)
    megatron = megatron_from_hf(model)
    convs = conversations()
    tokens, pixels, params, cu = packed_row(convs)
    assert tokens.shape[1] == 36 and pixels.shape[0] == 3
    with torch.no_grad():
        packed = llava_logits(megatron, pixels, tokens, params)[0]                        # [T, v]
        hidden = llava_hidden_states(megatron, pixels, tokens, params)[0]                 # [T, h]
    for (conv_tokens, conv_pixels), s, e in zip(convs, cu[:-1], cu[1:]):
        torch.testing.assert_close(packed[s:e], hf_logits(model, conv_tokens, conv_pixels), atol=1e-4, rtol=0)
    torch.testing.assert_close(hidden @ output_weight(megatron.language_model).T, packed, atol=1e-5, rtol=0)
    # the same conversation without packing (sbhd, no packed_seq_params) also equals transformers
    conv_tokens, conv_pixels = convs[1]
    with torch.no_grad():
        alone = llava_logits(megatron, conv_pixels, conv_tokens, None)[0]
    torch.testing.assert_close(alone, hf_logits(model, conv_tokens, conv_pixels), atol=1e-4, rtol=0)


def test_packing_keeps_conversations_apart(parallel_state_1proc):  # noqa: F811
    """Changing the first conversation's image changes its logits and no other conversation's."""
    megatron = megatron_from_hf(hf_llava(seed=2))
    tokens, pixels, params, cu = packed_row(conversations())
    with torch.no_grad():
        before = llava_logits(megatron, pixels, tokens, params)[0]
        after = llava_logits(megatron, torch.cat([pixels[:1] + 1.0, pixels[1:]]), tokens, params)[0]
    assert (before[:cu[1]] - after[:cu[1]]).abs().max() > 1e-3
    torch.testing.assert_close(before[cu[1]:], after[cu[1]:], atol=1e-6, rtol=0)


def _tp2_logits(rank, world_size):
    from packsft.train.distributed import init_distributed

    init_distributed(tensor_model_parallel_size=2)
    model = hf_llava(seed=4)                           # same seed: every rank holds the same HF model
    megatron = megatron_from_hf(model, rank, world_size)
    convs = conversations()
    tokens, pixels, params, cu = packed_row(convs)
    with torch.no_grad():
        packed = llava_logits(megatron, pixels, tokens, params)[0]                        # [T, v / 2]
    vocab = slice(rank * VOCAB // 2, (rank + 1) * VOCAB // 2)
    diffs = [(packed[s:e] - hf_logits(model, t, p)[:, vocab]).abs().max().item()
             for (t, p), s, e in zip(convs, cu[:-1], cu[1:])]
    return max(diffs), tuple(packed.shape)


@pytest.mark.distributed
@pytest.mark.slow
def test_tp2_logits_equal_transformers():
    results = run_distributed(_tp2_logits, 2)
    assert [r[1] for r in results] == [(36, VOCAB // 2)] * 2
    assert max(r[0] for r in results) < 1e-4


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_backward_reaches_vision_projector_and_language_model(parallel_state_1proc, dtype):  # noqa: F811
    model = hf_llava(seed=6)
    cfg = vlm_config_from_hf(model.config, params_dtype=dtype)
    megatron = build_llava_model(cfg).train()
    load_hf_llava_state_into_model(megatron, model.state_dict(), cfg)
    tokens, pixels, params, _ = packed_row(conversations())
    hidden = llava_hidden_states(megatron, pixels, tokens, params)
    assert hidden.dtype == getattr(torch, dtype) and hidden.shape == (1, 36, 64)
    hidden.float().pow(2).mean().backward()
    for name in ("vision_model.conv1.weight", "vision_model.ln_pre.weight",
                 "vision_model.decoder.layers.1.self_attention.linear_qkv.weight",
                 "vision_projection.encoder.linear_fc1.bias", "language_model.embedding.word_embeddings.weight",
                 "language_model.decoder.layers.1.mlp.linear_fc2.weight"):
        grad = megatron.get_parameter(name).grad
        assert grad is not None and grad.abs().sum() > 0 and torch.isfinite(grad).all(), name
