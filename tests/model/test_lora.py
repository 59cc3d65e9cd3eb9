"""LoRA on Megatron's parallel linears (one process): zero init is the base model, merge, PEFT export, checkpoints."""

import dataclasses

import pytest
import torch
from distributed_helpers import megatron_optimizer, optimizer_step, parallel_state_1proc  # noqa: F401 - fixture
from test_hf_io import VOCAB, hf_model, megatron_from_hf, megatron_logits
from transformers import AutoModelForCausalLM

from packsft.model.gpt import build_gpt_model
from packsft.model.hf_io import load_hf_state_into_model, save_hf_checkpoint, save_peft_adapter
from packsft.model.lora import (
    LoraConfig,
    apply_lora,
    enable_input_gradients,
    lora_parameters,
    merge_lora,
    read_lora_config,
)
from packsft.train.config import OptimizerConfig
from packsft.train.grad_clip import torch_optimizers
from packsft.train.model_checkpoint import load_megatron_checkpoint, save_megatron_checkpoint

LORA = LoraConfig(enabled=True, rank=4, alpha=8.0)


def _tokens(seed=1, n=20):
    return torch.randint(0, VOCAB, (1, n), generator=torch.Generator().manual_seed(seed))


def _perturb_adapters(model, seed=3):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in lora_parameters(model):
            p.add_(0.1 * torch.randn(p.shape, generator=g))


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_zero_initialised_lora_gives_the_base_logits_exactly(parallel_state_1proc, family):  # noqa: F811
    megatron, _ = megatron_from_hf(hf_model(family))
    tokens = _tokens()
    before = megatron_logits(megatron, tokens, torch.arange(20)[None])
    apply_lora(megatron, LORA)
    assert torch.equal(megatron_logits(megatron, tokens, torch.arange(20)[None]), before)
    trainable = [n for n, p in megatron.named_parameters() if p.requires_grad]
    assert len(trainable) == 2 * 4 * 2 and all(".lora_" in n for n in trainable)
    assert all(p.dtype == torch.float32 for p in lora_parameters(megatron))


def test_optimizer_state_is_proportional_to_adapter_parameters(parallel_state_1proc):  # noqa: F811
    megatron, _ = megatron_from_hf(hf_model("qwen3"))
    apply_lora(megatron, LORA)
    optimizer = megatron_optimizer(megatron, OptimizerConfig())
    logits = megatron(_tokens(), torch.arange(20)[None], None)
    logits.float().square().mean().backward()
    optimizer_step(optimizer)
    state = sum(t.numel() for opt in torch_optimizers(optimizer) for s in opt.state.values() for k, t in s.items()
                if k != "step")
    adapters = sum(p.numel() for p in lora_parameters(megatron))
    total = sum(p.numel() for p in megatron.parameters())
    assert state == 2 * adapters and adapters < total / 10        # exp_avg + exp_avg_sq of the adapters only
    print("adapter params", adapters, "of", total, "optimizer state elements", state)


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_merged_export_and_peft_adapter_equal_the_lora_model(parallel_state_1proc, family, tmp_path):  # noqa: F811
    from peft import PeftModel

    model = hf_model(family, seed=5)
    megatron, cfg = megatron_from_hf(model)
    apply_lora(megatron, LORA)
    _perturb_adapters(megatron)
    tokens = _tokens(6, 16)
    lora_logits = megatron_logits(megatron, tokens, torch.arange(16)[None])
    base_logits = megatron_logits(megatron_from_hf(model)[0], tokens, torch.arange(16)[None])
    assert (lora_logits - base_logits).abs().max() > 1e-2                      # the adapters matter

    base_dir = save_hf_checkpoint(megatron, cfg, tmp_path / "base", hf_config=model.config)
    adapter_dir = save_peft_adapter(megatron, cfg, LORA, tmp_path / "adapter", base_model_name_or_path=str(base_dir))
    assert {p.name for p in adapter_dir.iterdir()} >= {"adapter_config.json", "adapter_model.safetensors"}
    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32).eval()
    assert all(torch.equal(base.state_dict()[k], v) for k, v in model.state_dict().items())   # base unmerged
    peft_model = PeftModel.from_pretrained(base, adapter_dir).eval()
    with torch.no_grad():
        torch.testing.assert_close(peft_model(tokens).logits[0], lora_logits, atol=1e-4, rtol=0)

    bf16 = save_peft_adapter(megatron, cfg, LORA, tmp_path / "bf16", base_model_name_or_path=str(base_dir),
                             dtype=torch.bfloat16)  # export --dtype: the adapter stayed float32
    from safetensors.torch import load_file
    fp32, half = (load_file(d / "adapter_model.safetensors") for d in (adapter_dir, bf16))
    assert fp32.keys() == half.keys() and all(half[k].dtype == torch.bfloat16 and fp32[k].dtype == torch.float32
                                              and torch.equal(half[k], fp32[k].bfloat16()) for k in fp32)

    merge_lora(megatron)
    merged_dir = save_hf_checkpoint(megatron, cfg, tmp_path / "merged", hf_config=model.config)
    merged = AutoModelForCausalLM.from_pretrained(merged_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        torch.testing.assert_close(merged(tokens).logits[0], lora_logits, atol=1e-4, rtol=0)


def test_checkpoint_holds_adapters_and_a_base_checkpoint_loads_into_a_lora_model(parallel_state_1proc,  # noqa: F811
                                                                                  tmp_path):
    model = hf_model("qwen3", seed=7)
    base, cfg = megatron_from_hf(model)
    save_megatron_checkpoint(base, cfg, tmp_path / "base")           # what `convert_checkpoint.py import` writes
    lora_model = build_gpt_model(cfg)
    apply_lora(lora_model, LORA)
    load_megatron_checkpoint(lora_model, tmp_path / "base", base_only=True)
    tokens = _tokens(8)
    assert torch.equal(megatron_logits(lora_model, tokens, torch.arange(20)[None]),
                       megatron_logits(base, tokens, torch.arange(20)[None]))
    _perturb_adapters(lora_model)
    save_megatron_checkpoint(lora_model, cfg, tmp_path / "lora")
    again = build_gpt_model(cfg)
    apply_lora(again, LORA)
    load_megatron_checkpoint(again, tmp_path / "lora")               # strict: adapters and base
    before, after = lora_model.state_dict(), again.state_dict()
    params = [k for k, v in before.items() if isinstance(v, torch.Tensor)]
    assert any(".lora_" in k for k in params) and all(torch.equal(before[k], after[k]) for k in params)
    from torch.distributed.checkpoint.api import CheckpointException  # a BaseException wrapping the KeyError

    with pytest.raises(CheckpointException, match="lora_A"):
        load_megatron_checkpoint(again, tmp_path / "base")          # strict load: the adapters are missing


def test_lora_config_is_validated(tmp_path):
    with pytest.raises(ValueError, match="lora.rank"):
        LoraConfig(rank=0)
    with pytest.raises(ValueError, match="lora.target_modules"):
        LoraConfig(target_modules=["q_proj"])
    path = tmp_path / "c.yaml"
    path.write_text("model: {}\nlora: {enabled: true, rank: 2, alpha: 4, target_modules: [linear_qkv]}\n")
    assert read_lora_config(path) == LoraConfig(enabled=True, rank=2, alpha=4, target_modules=["linear_qkv"])
    path.write_text("model: {}\n")
    assert read_lora_config(path) is None
    path.write_text("lora: {enabled: true, ranks: 2}\n")
    with pytest.raises(ValueError, match=r"c.yaml lora: unknown LoraConfig fields \['ranks'\]"):
        read_lora_config(path)


@pytest.mark.parametrize("recompute", [{"recompute_granularity": "full", "recompute_method": "uniform",
                                        "recompute_num_layers": 1},
                                       {"recompute_granularity": "selective"}], ids=["full", "selective"])
def test_recompute_gives_the_adapter_gradients_of_no_recompute(parallel_state_1proc, recompute):  # noqa: F811
    """The frozen base gives the first layer an input that needs no gradient; full recompute must still
    back-propagate to the adapters (Megatron's reentrant checkpoint drops outputs of such inputs)."""
    hf = hf_model("llama")
    grads = []
    for extra in ({}, recompute):
        _, cfg = megatron_from_hf(hf)
        model = build_gpt_model(dataclasses.replace(cfg, **extra))
        load_hf_state_into_model(model, hf.state_dict(), cfg)
        apply_lora(model, LORA)
        enable_input_gradients(model)
        _perturb_adapters(model)
        model.train()
        model(_tokens(), torch.arange(20)[None], None).float().square().mean().backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad})
    assert grads[0].keys() == grads[1].keys() and grads[0]
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], rtol=1e-5, atol=1e-7)
