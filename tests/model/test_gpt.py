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
        tiny_config(num_attention_heads=4, num_query_groups=1).check_parallel_fit(tp=2)
    with pytest.raises(ValueError, match=r"model.num_layers \(2\) must be a multiple of "
                                         r"parallel.pipeline_model_parallel_size \(2\) x "
                                         r"parallel.virtual_pipeline_model_parallel_size \(2\)"):
        tiny_config().check_parallel_fit(pp=2, vp=2, prefix="parallel.")


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU workarounds are off with CUDA")
def test_cpu_workarounds_are_idempotent():
    from megatron.core.models.common.embeddings import rotary_pos_embedding

    assert cpu_compat.apply_cpu_workarounds() is True
    patched = rotary_pos_embedding.RotaryEmbedding.get_emb
    assert cpu_compat.apply_cpu_workarounds() is True
    assert rotary_pos_embedding.RotaryEmbedding.get_emb is patched is cpu_compat._get_emb_on_own_device
    assert torch.cuda.current_device() == "cpu"
    from megatron.core.tensor_parallel import random as tp_random

    assert tp_random._get_cuda_rng_state is cpu_compat._no_cuda_rng_state
    assert tp_random._set_cuda_rng_state is cpu_compat._set_no_cuda_rng_state


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


RECOMPUTE = {
    "full-uniform-1": dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1),
    "full-uniform-2": dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=2),
    "full-block-1": dict(recompute_granularity="full", recompute_method="block", recompute_num_layers=1),
    "selective": dict(recompute_granularity="selective"),
    "selective-all": dict(recompute_granularity="selective", recompute_modules=["core_attn", "mlp"]),
}
# forward calls per training step of (layer 0, layer 1) and (core attention 0, 1, mlp 0, 1): 2 = recomputed
RECOMPUTED_CALLS = {
    None: ((1, 1), (1, 1, 1, 1)),
    "full-uniform-1": ((2, 2), (2, 2, 2, 2)),
    "full-uniform-2": ((2, 2), (2, 2, 2, 2)),
    "full-block-1": ((2, 1), (2, 1, 2, 1)),
    "selective": ((1, 1), (2, 2, 1, 1)),
    "selective-all": ((1, 1), (2, 2, 2, 2)),
}


def step_grads(model, fused=True):
    """Gradients of every parameter and the calls of layers / core attentions / MLPs of one forward+backward."""
    calls = {}
    modules = {}
    for i, layer in enumerate(model.decoder.layers):
        modules[f"layer{i}"] = layer
        modules[f"attn{i}"] = layer.self_attention.core_attention
        modules[f"mlp{i}"] = layer.mlp
    hooks = [m.register_forward_hook(lambda *_, n=n: calls.__setitem__(n, calls.get(n, 0) + 1))
             for n, m in modules.items()]
    model.zero_grad(set_to_none=True)
    loss, mask = gpt_token_loss(model, packed_row(), fused=fused, chunk_size=8)
    (loss.sum() / mask.sum()).backward()
    for hook in hooks:
        hook.remove()
    counts = ((calls["layer0"], calls["layer1"]), (calls["attn0"], calls["attn1"], calls["mlp0"], calls["mlp1"]))
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}, counts


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("setting", list(RECOMPUTE))
def test_recompute_gives_identical_gradients(parallel_state_1proc, setting, fused):  # noqa: F811
    models = {}
    for name, overrides in ((None, {}), (setting, RECOMPUTE[setting])):
        models[name] = build(seed=5, **overrides)
        use_hidden_state_output(models[name])
    assert models[setting].config.recompute_granularity == RECOMPUTE[setting]["recompute_granularity"]
    ref_loss, ref_grads, ref_calls = step_grads(models[None], fused)
    loss, grads, calls = step_grads(models[setting], fused)
    assert ref_calls == RECOMPUTED_CALLS[None] and calls == RECOMPUTED_CALLS[setting]   # it did recompute
    assert torch.equal(loss, ref_loss)
    assert list(grads) == list(ref_grads) and all(ref_grads[n].abs().sum() > 0 for n in ref_grads)
    for name in ref_grads:                 # bit-identical on CPU fp32 (same kernels, same order)
        assert torch.equal(grads[name], ref_grads[name]), name


def test_recompute_is_off_in_eval_mode(parallel_state_1proc):  # noqa: F811
    model = build(**RECOMPUTE["full-uniform-1"])
    model.eval()
    with torch.no_grad():
        loss, _ = gpt_token_loss(model, packed_row(), fused=False, chunk_size=8)
    model.train()
    torch.testing.assert_close(loss, gpt_token_loss(model, packed_row(), fused=False, chunk_size=8)[0])


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU workarounds are off with CUDA")
def test_megatron_checkpoint_replays_the_cpu_rng():
    from megatron.core import tensor_parallel

    cpu_compat.apply_cpu_workarounds()
    x = torch.ones(64, requires_grad=True)
    torch.manual_seed(7)
    y = tensor_parallel.checkpoint(lambda t: F.dropout(t, p=0.5, training=True), False, x)
    y.sum().backward()                     # the recompute must draw the same dropout mask
    assert torch.equal(x.grad, (y.detach() != 0).float() * 2.0) and 0 < int((y == 0).sum()) < 64


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"recompute_granularity": "some"}, "model.recompute_granularity"),
        ({"recompute_granularity": "full", "recompute_num_layers": 1}, "model.recompute_method"),
        ({"recompute_granularity": "full", "recompute_method": "uniform"}, "model.recompute_num_layers"),
        ({"recompute_granularity": "full", "recompute_method": "blocks", "recompute_num_layers": 1},
         "model.recompute_method"),
        ({"recompute_granularity": "full", "recompute_method": "block", "recompute_num_layers": 3},
         "model.recompute_num_layers"),
        ({"recompute_granularity": "full", "recompute_method": "block", "recompute_num_layers": 0},
         "model.recompute_num_layers"),
        ({"recompute_granularity": "selective", "recompute_method": "uniform"}, "model.recompute_method"),
        ({"recompute_granularity": "selective", "recompute_num_layers": 1}, "model.recompute_num_layers"),
        ({"recompute_method": "uniform", "recompute_num_layers": 1}, "model.recompute_method"),
        ({"recompute_modules": ["mlp"]}, "model.recompute_modules"),
        ({"recompute_granularity": "selective", "recompute_modules": ["moe"]}, "model.recompute_modules"),
        ({"recompute_granularity": "selective", "recompute_modules": ["layernorm"]}, "model.recompute_modules"),
        ({"recompute_granularity": "selective", "recompute_modules": []}, "model.recompute_modules"),
    ],
)
def test_recompute_config_validation_names_the_key(overrides, field):
    with pytest.raises(ValueError, match=field):
        tiny_config(**overrides)


def test_recompute_keys_reach_transformer_config():
    tc = tiny_config(recompute_granularity="full", recompute_method="block", recompute_num_layers=2)
    tc = tc.to_transformer_config()
    assert (tc.recompute_granularity, tc.recompute_method, tc.recompute_num_layers) == ("full", "block", 2)
    tc = tiny_config(recompute_granularity="selective", recompute_modules=["mlp"]).to_transformer_config()
    assert tc.recompute_granularity == "selective" and tc.recompute_modules == ["mlp"]
    assert tiny_config().to_transformer_config().recompute_granularity is None
