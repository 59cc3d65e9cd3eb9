import pytest
import torch
import torch.nn.functional as F
from distributed_helpers import parallel_state_1proc  # noqa: F401 - fixture

from packsft.data.context_parallel import make_packed_seq_params
from packsft.model import cpu_compat, gpt
from packsft.model.config import ModelConfig
from packsft.model.gpt import build_gpt_model
from packsft.model.output_head import HiddenStateOutputLayer, use_hidden_state_output
from packsft.train.token_loss import gpt_token_loss

LENGTHS = [7, 12, 5, 8]
CU = torch.tensor([0, 7, 19, 24, 32], dtype=torch.int32)
VOCAB = 1000


def tiny_config(**overrides):
    fields = dict(num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4,
                  num_query_groups=2, vocab_size=VOCAB, max_position_embeddings=128)
    return ModelConfig(**{**fields, **overrides})


def build(seed=0, **overrides):
    torch.manual_seed(seed)
    return build_gpt_model(tiny_config(**overrides))


def packed_row(seed=0):
    gen = torch.Generator().manual_seed(seed)
    t = int(CU[-1])
    labels = torch.randint(0, VOCAB, (1, t), generator=gen)
    labels[0, [0, 1, 8, 20]] = -100                                   # prompt tokens, not trained
    return {
        "tokens": torch.randint(0, VOCAB, (1, t), generator=gen),
        "labels": labels,
        "loss_mask": (labels != -100).float(),
        "position_ids": torch.cat([torch.arange(n) for n in LENGTHS])[None],
        "packed_seq_params": make_packed_seq_params(CU, max(LENGTHS)),
    }


def grads(model, *names):
    params = dict(model.named_parameters())
    return {n: params[n].grad.clone() for n in names}


@pytest.mark.parametrize("fused", [False, True])
def test_packed_loss_equals_each_conversation_unpacked(parallel_state_1proc, fused):  # noqa: F811
    model = build()
    use_hidden_state_output(model)
    row = packed_row()
    packed, mask = gpt_token_loss(model, row, fused=fused, chunk_size=5)
    assert packed.shape == mask.shape == (32,) and packed.dtype == mask.dtype == torch.float32
    for s, e in zip(CU[:-1].tolist(), CU[1:].tolist()):
        labels = row["labels"][:, s:e]
        alone = model(row["tokens"][:, s:e], torch.arange(e - s)[None], None,
                      labels=labels.clamp(min=0))[0] * (labels[0] != -100)
        torch.testing.assert_close(packed[s:e], alone, atol=1e-5, rtol=0)


def test_untrained_tokens_have_zero_loss(parallel_state_1proc):  # noqa: F811
    model = build()
    row = packed_row()
    row["loss_mask"][0, 30] = 0.0                          # pad with a valid label id
    loss, mask = gpt_token_loss(model, row, fused=False, chunk_size=8)
    assert mask[[0, 1, 8, 20, 30]].tolist() == [0.0] * 5 and mask.sum() == 27
    assert loss[[0, 1, 8, 20, 30]].tolist() == [0.0] * 5 and bool((loss[mask > 0] > 0).all())


@pytest.mark.parametrize("tied", [False, True])
def test_fused_and_stock_paths_agree(parallel_state_1proc, tied):  # noqa: F811
    model = build(tie_word_embeddings=tied)
    use_hidden_state_output(model)
    weight_name = "embedding.word_embeddings.weight" if tied else "output_layer.weight"
    names = (weight_name, "decoder.final_layernorm.weight", "decoder.layers.0.self_attention.linear_qkv.weight")
    results = []
    for fused in (False, True):
        model.zero_grad(set_to_none=True)
        loss, mask = gpt_token_loss(model, packed_row(), fused=fused, chunk_size=7)
        (loss.sum() / mask.sum()).backward()
        results.append((loss.detach(), grads(model, *names)))
    torch.testing.assert_close(results[1][0], results[0][0], atol=1e-5, rtol=0)
    for name in names:
        torch.testing.assert_close(results[1][1][name], results[0][1][name], atol=1e-5, rtol=0)
    assert results[0][1][weight_name].abs().sum() > 0


def test_fused_needs_the_swap(parallel_state_1proc):  # noqa: F811
    with pytest.raises(ValueError, match="use_hidden_state_output"):
        gpt_token_loss(build(), packed_row(), fused=True, chunk_size=8)


def test_swap_keeps_checkpoint_keys_weights_and_stock_outputs(parallel_state_1proc):  # noqa: F811
    stock, swapped = build(seed=3), build(seed=3)
    use_hidden_state_output(swapped)
    use_hidden_state_output(swapped)                                  # idempotent
    assert type(swapped.output_layer) is HiddenStateOutputLayer
    stock_sd, swapped_sd = stock.state_dict(), swapped.state_dict()
    assert list(stock_sd) == list(swapped_sd)
    assert all(torch.equal(stock_sd[k], swapped_sd[k]) for k in stock_sd if torch.is_tensor(stock_sd[k]))
    assert sorted(stock.sharded_state_dict()) == sorted(swapped.sharded_state_dict())
    row = packed_row()
    args = (row["tokens"], row["position_ids"], None)
    logits = swapped(*args, packed_seq_params=row["packed_seq_params"])    # flag off: logits, not hidden
    assert logits.shape == (1, 32, VOCAB)
    torch.testing.assert_close(logits, stock(*args, packed_seq_params=row["packed_seq_params"]))
    ref = F.cross_entropy(logits[0], row["labels"][0], reduction="none", ignore_index=-100)
    loss, _ = gpt_token_loss(swapped, row, fused=True, chunk_size=8)
    torch.testing.assert_close(loss, ref, atol=1e-5, rtol=0)


def test_rotary_base_and_architecture(parallel_state_1proc):  # noqa: F811
    model = build(rotary_base=500000.0)
    dim = 16
    expected = 1.0 / 500000.0 ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    torch.testing.assert_close(model.rotary_pos_emb.inv_freq, expected)
    tc = model.config
    assert tc.normalization == "RMSNorm" and tc.gated_linear_unit and tc.activation_func is F.silu
    assert not tc.add_bias_linear and tc.attention_dropout == 0 and tc.hidden_dropout == 0
    assert model.decoder.layers[0].mlp.linear_fc1.weight.shape == (256, 64)         # gate + up
    assert model.decoder.layers[0].self_attention.linear_qkv.weight.shape == (128, 64)  # 4 q + 2 k + 2 v heads
    assert all(n.endswith("weight") for n, _ in model.named_parameters())             # no biases


def test_build_requires_parallel_state(monkeypatch):
    monkeypatch.setattr(gpt.parallel_state, "model_parallel_is_initialized", lambda: False)
    with pytest.raises(RuntimeError, match="init_distributed"):
        build_gpt_model(tiny_config())


def test_te_backend_without_transformer_engine():
    try:
        import transformer_engine  # noqa: F401
        pytest.skip("TransformerEngine is installed")
    except ImportError:
        pass
    with pytest.raises(ImportError, match="TransformerEngine"):
        gpt.layer_spec("te")


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"hidden_size": 0}, "model.hidden_size"),
        ({"num_query_groups": 3}, "model.num_query_groups"),
        ({"hidden_size": 66}, "model.num_attention_heads"),
        ({"attention_backend": "flash"}, "model.attention_backend"),
        ({"params_dtype": "float16"}, "model.params_dtype"),
        ({"rotary_base": 0.0}, "model.rotary_base"),
        ({"kv_channels": -1}, "model.kv_channels"),
    ],
)
def test_config_validation_names_the_field(overrides, field):
    with pytest.raises(ValueError, match=field):
        tiny_config(**overrides)


def test_config_tp_divisibility():
    with pytest.raises(ValueError, match="num_query_groups.*tensor_model_parallel_size"):
        tiny_config(num_attention_heads=4, num_query_groups=1).to_transformer_config(tp=2)


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU workarounds are off with CUDA")
def test_cpu_workarounds_are_idempotent():
    from megatron.core.models.common.embeddings import rotary_pos_embedding

    assert cpu_compat.apply_cpu_workarounds() is True
    patched = rotary_pos_embedding.RotaryEmbedding.get_emb
    assert cpu_compat.apply_cpu_workarounds() is True
    assert rotary_pos_embedding.RotaryEmbedding.get_emb is patched is cpu_compat._get_emb_on_own_device
    assert torch.cuda.current_device() == "cpu"


def test_bfloat16_params_run_both_loss_paths(parallel_state_1proc):  # noqa: F811
    model = build(params_dtype="bfloat16")
    use_hidden_state_output(model)
    assert model.output_layer.weight.dtype == model.embedding.word_embeddings.weight.dtype == torch.bfloat16
    stock, _ = gpt_token_loss(model, packed_row(), fused=False, chunk_size=8)
    fused, _ = gpt_token_loss(model, packed_row(), fused=True, chunk_size=8)
    fused.sum().backward()
    assert stock.dtype == fused.dtype == torch.float32 and bool(torch.isfinite(fused).all())
    torch.testing.assert_close(fused, stock, atol=1e-3, rtol=0)
    assert model.output_layer.weight.grad.dtype == torch.bfloat16


def test_init_distributed_refuses_other_sizes(parallel_state_1proc):  # noqa: F811
    from packsft.train.distributed import init_distributed

    with pytest.raises(ValueError, match="already initialised"):
        init_distributed(context_parallel_size=2)
