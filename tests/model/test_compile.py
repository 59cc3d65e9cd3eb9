"""Compile options: ``model.bias_activation_fusion`` (Megatron's compiled SwiGLU) and ``train.compile`` (each
transformer layer compiled). Compiling costs minutes on a CPU runner, so the compiled code runs eagerly here
(``torch.compiler.set_stance("force_eager")``): these tests check that the options build, are wired, and compute what
the unfused, uncompiled model does; the compiled kernels themselves run on the GPU check."""

import warnings

import torch
from distributed_helpers import parallel_state_1proc  # noqa: F401 - fixture
from test_loop import packed  # noqa: F401 - fixture
from test_step_syncs import trainer_for

from packsft.data.context_parallel import make_packed_seq_params
from packsft.model.compile import compile_transformer_layers
from packsft.model.config import ModelConfig
from packsft.model.gpt import build_gpt_model
from packsft.model.output_head import use_hidden_state_output
from packsft.train.token_loss import gpt_token_loss


def _model(**overrides):
    torch.manual_seed(0)
    model = build_gpt_model(ModelConfig(num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4,
                                        num_query_groups=2, vocab_size=256, max_position_embeddings=64, **overrides))
    use_hidden_state_output(model)
    return model


def _loss_and_grads(model):
    gen = torch.Generator().manual_seed(1)
    batch = {"tokens": torch.randint(0, 256, (1, 32), generator=gen),
             "labels": torch.randint(0, 256, (1, 32), generator=gen), "loss_mask": torch.ones(1, 32),
             "position_ids": torch.cat([torch.arange(12), torch.arange(20)])[None], "trained_index": torch.arange(32),
             "packed_seq_params": make_packed_seq_params(torch.tensor([0, 12, 32]), 20)}
    model.zero_grad(set_to_none=True)
    with torch.compiler.set_stance("force_eager"):
        loss, _ = gpt_token_loss(model, batch, fused=True, chunk_size=16)
        loss.sum().backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _assert_same(a, b, atol):
    torch.testing.assert_close(a[0], b[0], atol=atol, rtol=0)
    for name in a[1]:
        torch.testing.assert_close(a[1][name], b[1][name], atol=atol, rtol=0, msg=name)


def test_swiglu_fusion_builds_and_equals_unfused(parallel_state_1proc):  # noqa: F811
    fused = _model(bias_activation_fusion=True)
    assert fused.decoder.layers[0].mlp.config.bias_activation_fusion
    _assert_same(_loss_and_grads(fused), _loss_and_grads(_model()), atol=1e-6)


def test_compiled_layers_compute_the_eager_model_without_tp_group_warnings(parallel_state_1proc):  # noqa: F811
    eager, compiled = _model(), _model()
    assert compile_transformer_layers(compiled) == 2
    assert all(layer._compiled_call_impl is not None for layer in compiled.decoder.layers)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = _loss_and_grads(compiled)
    assert not [w for w in caught if "tp_group is None" in str(w.message)]
    _assert_same(result, _loss_and_grads(eager), atol=0)


def test_train_compile_compiles_the_trainers_layers(tmp_path, packed, parallel_state_1proc):  # noqa: F811
    trainer = trainer_for(tmp_path, packed, train={"compile": True}, model={"bias_activation_fusion": True})
    assert all(layer._compiled_call_impl is not None for layer in trainer.gpt.decoder.layers)
    assert trainer.gpt.config.bias_activation_fusion
