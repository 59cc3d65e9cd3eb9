"""Megatron's AdamW groups, the warmup + decay schedule, the fused kernel, and the TP-aware gradient norm /
clipping on the device."""

import copy
import math

import pytest
import torch
from distributed_helpers import parallel_state_1proc, run_distributed  # noqa: F401 - fixture
from test_loop import packed  # noqa: F401 - fixture
from test_step_syncs import trainer_for

from packsft.train.config import OptimizerConfig, SchedulerConfig
from packsft.train.grad_clip import clip_to_norm, total_norm, use_fused_adamw
from packsft.train.optim import ParamGroupSchedule, WarmupDecay, apply_optimizer_settings, set_schedule_step


def test_warmup_then_cosine_to_min_lr():
    f = WarmupDecay(SchedulerConfig(warmup_steps=4, decay_style="cosine", min_lr=0.1), lr=1.0, train_steps=14)
    assert [f(s) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert f(4) == 1.0 and math.isclose(f(9), 0.1 + 0.9 * 0.5) and math.isclose(f(14), 0.1) and f(100) == f(14)


def test_linear_and_constant():
    lin = WarmupDecay(SchedulerConfig(decay_style="linear", min_lr=0.0), lr=2.0, train_steps=10)
    assert lin(0) == 1.0 and math.isclose(lin(5), 0.5) and lin(10) == 0.0
    const = WarmupDecay(SchedulerConfig(warmup_steps=2, decay_style="constant"), lr=2.0, train_steps=10)
    assert [const(s) for s in (0, 1, 2, 9)] == [0.5, 1.0, 1.0, 1.0]


def test_megatron_groups_exclude_vectors_from_decay(tmp_path, packed, parallel_state_1proc):  # noqa: F811
    trainer = trainer_for(tmp_path, packed, optimizer={"weight_decay": 0.1})
    decay = {id(p): g["weight_decay"] for g in trainer.optimizer.param_groups for p in g["params"]}
    params = [p for p in trainer.gpt.parameters() if p.requires_grad]
    assert {decay[id(p)] for p in params if p.dim() >= 2} == {0.1}
    assert {decay[id(p)] for p in params if p.dim() < 2} == {0.0}


class _Groups:
    def __init__(self):
        self.param_groups = [{"lr": 0.0}, {"lr": 0.0}]


def test_set_schedule_step_matches_stepping():
    cfg = SchedulerConfig(warmup_steps=3, min_lr=1e-4)
    stepped_opt = _Groups()
    stepped = ParamGroupSchedule(stepped_opt, cfg, 1e-3, 20)
    for _ in range(7):
        stepped.step()
    fresh_opt = _Groups()
    set_schedule_step(ParamGroupSchedule(fresh_opt, cfg, 1e-3, 20), 7)
    assert [g["lr"] for g in fresh_opt.param_groups] == [g["lr"] for g in stepped_opt.param_groups]
    assert stepped_opt.param_groups[0]["lr"] == 1e-3 * WarmupDecay(cfg, 1e-3, 20)(7)


def test_clip_on_the_device_matches_torch():
    params = [torch.nn.Parameter(torch.randn(5, 3)), torch.nn.Parameter(torch.randn(7))]
    for p in params:
        p.grad = torch.randn_like(p) * 3
    reference = [torch.nn.Parameter(p.detach().clone()) for p in params]
    for r, p in zip(reference, params):
        r.grad = p.grad.clone()
    ref_norm = torch.nn.utils.clip_grad_norm_(reference, 1.0)
    norm = total_norm([p.grad for p in params], None, "cpu")
    clip_to_norm(params, 1.0, norm)
    assert float(norm) > 1.0
    torch.testing.assert_close(norm, ref_norm)
    for r, p in zip(reference, params):
        torch.testing.assert_close(p.grad, r.grad)
    assert float(total_norm([], None, "cpu")) == 0.0      # no gradient -> 0


def _tp_grad_norm(rank, world_size):
    from packsft.data.context_parallel import make_packed_seq_params
    from packsft.model.config import ModelConfig
    from packsft.model.gpt import build_gpt_model
    from packsft.train.distributed import init_distributed
    from packsft.train.token_loss import gpt_token_loss

    ctx = init_distributed(tensor_model_parallel_size=world_size)
    model = build_gpt_model(ModelConfig(num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4,
                                        num_query_groups=2, vocab_size=256, max_position_embeddings=64))
    gen = torch.Generator().manual_seed(0)
    cu = torch.tensor([0, 10, 32], dtype=torch.int32)
    batch = {"tokens": torch.randint(0, 256, (1, 32), generator=gen), "labels": torch.randint(0, 256, (1, 32),
             generator=gen), "loss_mask": torch.ones(1, 32), "position_ids": torch.zeros(1, 32, dtype=torch.long),
             "packed_seq_params": make_packed_seq_params(cu, 22)}
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads

    from packsft.train.grad_clip import megatron_grad_norm
    from packsft.train.optim import build_megatron_optimizer

    model.config.calculate_per_token_loss = True
    ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(grad_reduce_in_fp32=True), model)
    optimizer = build_megatron_optimizer(ddp, OptimizerConfig(), bf16=False)
    per_token, _ = gpt_token_loss(ddp, batch, fused=False, chunk_size=8)
    per_token.sum().backward()
    finalize_model_grads([ddp])
    optimizer.prepare_grads()
    assert ctx.tp_group is not None
    return float(megatron_grad_norm(optimizer, "cpu"))


@pytest.mark.distributed
@pytest.mark.slow
def test_grad_norm_is_the_same_with_tp2():
    (reference,) = run_distributed(_tp_grad_norm, 1)
    tp2 = run_distributed(_tp_grad_norm, 2)
    assert tp2[0] == tp2[1]
    assert math.isclose(tp2[0], reference, rel_tol=1e-5), (tp2, reference)
    assert reference > 0


def test_megatron_optimizer_groups_take_the_configs_betas_eps_and_weight_decay(tmp_path, packed,  # noqa: F811
                                                                               parallel_state_1proc):  # noqa: F811
    """``load_state_dict`` restores the saved groups: a resume with another ``adam_eps`` would train with the old
    one while ``config.yaml`` recorded the new one."""
    trainer = trainer_for(tmp_path, packed, optimizer={"use_distributed_optimizer": True, "weight_decay": 0.3})
    groups = trainer.optimizer.param_groups
    for group in groups:                                                     # as a loaded checkpoint's
        group["betas"], group["eps"], group["weight_decay"] = (0.1, 0.2), 0.3, 0.5
    cfg = trainer.cfg.optimizer
    apply_optimizer_settings(trainer.optimizer, cfg)
    assert {(g["betas"], g["eps"]) for g in groups} == {((cfg.adam_beta1, cfg.adam_beta2), cfg.adam_eps)}
    assert {g["weight_decay"] for g in groups} == {0.3, 0.0}


def _adamw(model, fused: bool):
    groups = [{"params": [p for p in model.parameters() if p.dim() >= 2], "weight_decay": 0.1},
              {"params": [p for p in model.parameters() if p.dim() < 2], "weight_decay": 0.0}]
    optimizer = torch.optim.AdamW(groups, lr=1e-2, foreach=not fused)
    if fused:
        use_fused_adamw(optimizer)
    return optimizer


def test_adamw_is_fused_also_after_loading_a_foreach_checkpoint():
    """use_fused_adamw (Megatron's inner torch AdamW: at build and after every load) takes torch's fused kernel (CPU
    has one since torch 2.4, CUDA always); a state saved by the foreach path (step counters on the host) is switched
    back to fused, and the fused updates equal foreach's."""
    from packsft.train.grad_clip import fused_adamw_supported, optimizer_implementation

    assert fused_adamw_supported("cpu")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3))
    twin = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3))
    twin.load_state_dict(model.state_dict())
    fused, foreach = _adamw(model, fused=True), _adamw(twin, fused=False)
    assert all(g["fused"] for g in fused.param_groups) and optimizer_implementation(fused) == "torch AdamW (fused)"
    for step in range(3):
        for m, opt in ((model, fused), (twin, foreach)):
            m(torch.ones(2, 4) * step).square().sum().backward()
            opt.step()
            opt.zero_grad()
        if step == 1:                                           # resume the fused run from foreach's state
            fused.load_state_dict(copy.deepcopy(foreach.state_dict()))   # as read from a checkpoint
            model.load_state_dict(twin.state_dict())
            assert not any(g["fused"] for g in fused.param_groups)
            use_fused_adamw(fused)
            assert all(g["fused"] for g in fused.param_groups)
    for a, b in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)


def test_megatron_optimizer_is_fused_and_its_norm_stays_on_the_device(tmp_path, packed,  # noqa: F811
                                                                     parallel_state_1proc):  # noqa: F811
    """Megatron's inner torch AdamW runs fused; packsft's device-side norm equals Megatron's get_grad_norm()."""
    from packsft.train.grad_clip import megatron_grad_norm, optimizer_implementation

    trainer = trainer_for(tmp_path, packed, optimizer={"use_distributed_optimizer": True})
    assert all(g["fused"] for g in trainer.optimizer.param_groups)
    assert optimizer_implementation(trainer.optimizer) == "Megatron DistributedOptimizer, torch AdamW (fused)"
    summary = trainer.summary()                                 # the start-up lines
    assert summary["optimizer"] == optimizer_implementation(trainer.optimizer)
    assert summary["attention"] == "sdpa per conversation (CPU fallback)"
    trainer.model.zero_grad_buffer()
    trainer.optimizer.zero_grad()
    batch = trainer.next_micro_batches()[0]
    trainer.schedule.token_losses(trainer.model, batch).sum().backward()
    trainer.optimizer.prepare_grads()
    norm = megatron_grad_norm(trainer.optimizer, "cpu")
    assert norm.shape == () and math.isclose(float(norm), trainer.optimizer.get_grad_norm(), rel_tol=1e-6)


def test_a_step_counter_shared_by_all_parameters_is_split():
    """Megatron's distributed optimizer loads one ``step`` tensor into every parameter's state (no TE/Apex); the
    fused kernel advances each parameter's counter, so a shared one would count once per parameter."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3))
    opt = _adamw(model, fused=True)
    model(torch.ones(2, 4)).sum().backward()
    opt.step()
    shared = torch.tensor(1.0)
    for state in opt.state.values():
        state["step"] = shared
    use_fused_adamw(opt)
    opt.step()
    assert [float(s["step"]) for s in opt.state.values()] == [2.0] * 4 and float(shared) == 1.0
