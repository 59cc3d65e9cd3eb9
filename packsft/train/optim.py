"""Megatron-Core's optimizer, the warmup + decay learning-rate schedule, and the step that skips on the device.

``megatron.core.optimizer.get_megatron_optimizer`` over Megatron ``DistributedDataParallel`` model chunks
(:func:`build_megatron_optimizer`): Adam(W) on fp32 master weights, optionally sharded over data parallelism
(``use_distributed_optimizer``); its inner torch AdamW switched to the fused kernel, its TP/DP-aware gradient norm and
clipping done on the device (:func:`megatron_step_skipping_non_finite`, ``packsft.train.grad_clip``); scheduled by
:class:`ParamGroupSchedule`. On CPU it runs through ``packsft.model.cpu_compat``'s optimizer shim. A step reads
nothing back to the host: a step whose loss or gradient norm is not finite is skipped by the fused AdamW kernel itself
(``found_inf``, as under torch's ``GradScaler``). Checkpointed through ``dist_checkpointing``
(``packsft.train.checkpoint``).
"""

from __future__ import annotations

import math

import torch

from packsft.train.config import OptimizerConfig, SchedulerConfig
from packsft.train.grad_clip import clip_to_norm, megatron_grad_norm, skip_update_if, use_fused_adamw


def build_megatron_optimizer(model: torch.nn.Module | list[torch.nn.Module], cfg: OptimizerConfig, *, bf16: bool):
    """Megatron-Core's optimizer for a Megatron ``DistributedDataParallel`` ``model`` (or a list of model chunks,
    one per virtual pipeline stage).

    ``OptimizerConfig(optimizer="adam")`` with ``cfg``'s lr, betas, eps, weight decay (decoupled: AdamW) and
    ``clip_grad``; the inner torch AdamW uses the fused kernel where torch has one (Megatron builds it without
    ``fused=True`` when TE/Apex are absent); ``bf16`` keeps fp32 master weights of bf16 parameters;
    ``use_distributed_optimizer`` as in ``cfg`` (must match the DDP config). Megatron groups parameters by
    ``wd_mult`` (0 for 1-D parameters and biases, as Megatron-LM and nanoGPT); :func:`apply_optimizer_settings` sets
    each group's ``weight_decay`` from it.

    Returns:
        A ``megatron.core.optimizer.MegatronOptimizer`` (a ``ChainedOptimizer``); ``step()`` returns
        ``(update_successful, grad_norm, num_zeros_in_grad)``.
    """
    from megatron.core.optimizer import OptimizerConfig as MegatronOptimizerConfig
    from megatron.core.optimizer import get_megatron_optimizer

    config = MegatronOptimizerConfig(
        optimizer="adam", lr=cfg.lr, min_lr=0.0, weight_decay=cfg.weight_decay, adam_beta1=cfg.adam_beta1,
        adam_beta2=cfg.adam_beta2, adam_eps=cfg.adam_eps, clip_grad=cfg.clip_grad, bf16=bf16,
        params_dtype=torch.bfloat16 if bf16 else torch.float32, use_distributed_optimizer=cfg.use_distributed_optimizer,
        decoupled_weight_decay=True)
    optimizer = get_megatron_optimizer(config, model if isinstance(model, list) else [model])
    apply_optimizer_settings(optimizer, cfg)
    return optimizer


def apply_optimizer_settings(optimizer, cfg: OptimizerConfig) -> None:
    """Set each group's ``weight_decay`` (``cfg.weight_decay`` for matrices, 0 for 1-D parameters), ``betas`` and
    ``eps`` from ``cfg``, and the fused AdamW kernel: after a resume, whose ``load_state_dict`` restored the
    checkpoint's.
    """
    for group in optimizer.param_groups:
        group["weight_decay"] = cfg.weight_decay * group["wd_mult"]
        if "betas" in group:
            group["betas"] = (cfg.adam_beta1, cfg.adam_beta2)
        if "eps" in group:
            group["eps"] = cfg.adam_eps
    use_fused_adamw(optimizer)


class ParamGroupSchedule:
    """:class:`WarmupDecay` applied to the ``param_groups`` of Megatron's optimizer (not a torch Optimizer).

    ``LambdaLR``'s attributes and calls (``optimizer``, ``base_lrs``, ``lr_lambdas``, ``last_epoch``, ``step()``,
    ``state_dict()``); the lr of 0-based step ``n`` is ``lr * WarmupDecay(n)``, as ``LambdaLR`` computes it.
    """

    def __init__(self, optimizer, cfg: SchedulerConfig, lr: float, train_steps: int) -> None:
        self.optimizer = optimizer
        groups = optimizer.param_groups
        self.base_lrs = [lr] * len(groups)
        self.lr_lambdas = [WarmupDecay(cfg, lr, train_steps)] * len(groups)
        set_schedule_step(self, 0)

    def step(self) -> None:
        """Advance one optimizer step and set every group's lr."""
        set_schedule_step(self, self.last_epoch + 1)

    def state_dict(self) -> dict:
        """``{"last_epoch": optimizer steps done}``."""
        return {"last_epoch": self.last_epoch}


class WarmupDecay:
    """Learning-rate multiplier of optimizer step ``step`` (0-based).

    ``warmup``: ``(step + 1) / warmup_steps`` for ``step < warmup_steps``. Then with ``p = (step - warmup_steps) /
    decay_steps`` clamped to [0, 1] and ``m = min_lr / lr``: cosine ``m + (1 - m) * (1 + cos(pi p)) / 2``, linear
    ``m + (1 - m) * (1 - p)``, constant 1 (Megatron-LM ``OptimizerParamScheduler`` formulas).
    """

    def __init__(self, cfg: SchedulerConfig, lr: float, train_steps: int) -> None:
        self.warmup_steps = cfg.warmup_steps
        self.decay_steps = cfg.decay_steps if cfg.decay_steps is not None else max(train_steps - cfg.warmup_steps, 1)
        self.decay_style = cfg.decay_style
        self.min_ratio = cfg.min_lr / lr

    def __call__(self, step: int) -> float:
        """Multiplier of the peak lr at 0-based optimizer ``step``."""
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        if self.decay_style == "constant":
            return 1.0
        progress = min(max((step - self.warmup_steps) / self.decay_steps, 0.0), 1.0)
        shape = (1 + math.cos(math.pi * progress)) / 2 if self.decay_style == "cosine" else 1 - progress
        return self.min_ratio + (1 - self.min_ratio) * shape


def set_schedule_step(scheduler: ParamGroupSchedule, last_epoch: int) -> None:
    """Put a (resumed) schedule at ``last_epoch`` and set each group's lr.

    The schedule's shape and peak lr come from the *current* config (``base_lrs`` set at construction), not from the
    checkpoint, so ``train.train_steps`` or ``scheduler.*`` may change on resume; with an unchanged config the lr is
    bit-identical to the uninterrupted run's.
    """
    scheduler.last_epoch = last_epoch
    for group, base_lr, lmbda in zip(scheduler.optimizer.param_groups, scheduler.base_lrs, scheduler.lr_lambdas):
        group["lr"] = base_lr * lmbda(last_epoch)
    scheduler._last_lr = [group["lr"] for group in scheduler.optimizer.param_groups]


def megatron_step_skipping_non_finite(optimizer, loss_sum: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``MegatronOptimizer.step()`` split as Megatron splits it, the update skipped on the device when anything is
    not finite: no host read.

    ``prepare_grads`` (main grads into the fp32 master grads), the TP/DP-aware gradient norm on the device
    (``packsft.train.grad_clip.megatron_grad_norm``: Megatron's ``get_grad_norm`` without its per-parameter and final
    ``.item()``), clipping of each optimizer's main grads to its ``clip_grad`` on the device, then
    ``step_with_ready_grads`` (Adam, then the copy or all-gather back into the model weights) with the fused AdamW
    kernel told to leave parameters and state as they are when the norm or ``loss_sum`` is not finite
    (:func:`~packsft.train.grad_clip.skip_update_if`).

    Returns:
        ``(skipped, grad_norm)``: a bool and an fp32 0-d tensor on ``loss_sum``'s device (the norm NaN or inf when
        skipped for it).
    """
    found_inf = optimizer.prepare_grads()       # a loss scaler's (fp16) verdict; False without one
    norm = megatron_grad_norm(optimizer, loss_sum.device)
    skipped = ~torch.isfinite(norm + loss_sum) | found_inf
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        if opt.config.clip_grad > 0.0:
            clip_to_norm(opt.get_parameters(), opt.config.clip_grad, norm)
    skip_update_if(optimizer, skipped)
    optimizer.step_with_ready_grads()
    return skipped, norm
