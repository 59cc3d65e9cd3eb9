"""AdamW with weight-decay groups, the warmup + decay learning-rate schedule, and TP-aware gradient clipping.

Two backends (``optimizer.backend``):

* ``torch``: ``torch.optim.AdamW`` (:func:`build_optimizer`; fused where torch has the kernel), fp32 state replicated
  on every rank, clipped by :func:`clip_grads`, scheduled by ``LambdaLR`` (:func:`build_scheduler`).
* ``megatron``: ``megatron.core.optimizer.get_megatron_optimizer`` over a Megatron ``DistributedDataParallel``
  model (:func:`build_megatron_optimizer`): Adam(W) on fp32 master weights, optionally sharded over data parallelism
  (``use_distributed_optimizer``); its inner torch AdamW switched to the fused kernel, its TP/DP-aware gradient norm
  and clipping done on the device (:func:`megatron_step_skipping_non_finite`, ``packsft.train.grad_clip``); scheduled
  by :class:`ParamGroupSchedule`. On CPU it runs through ``packsft.model.cpu_compat``'s optimizer shim.

A step reads nothing back to the host: a step whose loss or gradient norm is not finite is skipped by the fused
AdamW kernel itself (``found_inf``, as under torch's ``GradScaler``; :func:`megatron_step_skipping_non_finite`,
``Trainer.step_tensors``).

Both are checkpointed through ``dist_checkpointing`` (``packsft.train.checkpoint``).
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.distributed as dist
from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate

from packsft.train.config import OptimizerConfig, SchedulerConfig
from packsft.train.grad_clip import clip_to_norm, megatron_grad_norm, skip_update_if, total_norm, use_fused_adamw


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Split trainable parameters into a decayed and a non-decayed group.

    Matrices (``dim >= 2``: linear and embedding weights) get ``weight_decay``; vectors (RMSNorm weights, biases) get
    0, as in Megatron-LM's ``get_param_groups`` and nanoGPT. The order is ``named_parameters()`` order within each
    group, decayed group first; the checkpoint maps optimizer state to parameters through this order.

    Returns:
        ``[{"params": [...], "weight_decay": weight_decay, "name": "decay"}, {..., 0.0, "no_decay"}]`` (a group
        may be empty).
    """
    decay, no_decay = [], []
    for _, param in model.named_parameters():
        if param.requires_grad:
            (decay if param.dim() >= 2 else no_decay).append(param)
    return [{"params": decay, "weight_decay": weight_decay, "name": "decay"},
            {"params": no_decay, "weight_decay": 0.0, "name": "no_decay"}]


def build_optimizer(model: torch.nn.Module, cfg: OptimizerConfig) -> torch.optim.AdamW:
    """``torch.optim.AdamW`` over :func:`param_groups` with ``cfg``'s lr, betas and eps; the fused kernel where torch
    has one for the parameters' device (``packsft.train.grad_clip.use_fused_adamw``), else ``foreach``."""
    optimizer = torch.optim.AdamW(param_groups(model, cfg.weight_decay), lr=cfg.lr,
                                  betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_eps)
    use_fused_adamw(optimizer)
    return optimizer


def build_megatron_optimizer(model: torch.nn.Module | list[torch.nn.Module], cfg: OptimizerConfig, *, bf16: bool):
    """Megatron-Core's optimizer for a Megatron ``DistributedDataParallel`` ``model`` (or a list of model chunks,
    one per virtual pipeline stage).

    ``OptimizerConfig(optimizer="adam")`` with ``cfg``'s lr, betas, eps, weight decay (decoupled: AdamW) and
    ``clip_grad``; the inner torch AdamW uses the fused kernel where torch has one (Megatron builds it without
    ``fused=True`` when TE/Apex are absent); ``bf16`` keeps fp32 master weights of bf16 parameters;
    ``use_distributed_optimizer`` as in ``cfg`` (must match the DDP config). Megatron groups parameters by
    ``wd_mult`` (0 for 1-D parameters and biases, as :func:`param_groups`); :func:`apply_optimizer_settings` sets
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

    torch groups (:func:`param_groups`) are told apart by ``name``; Megatron groups by ``wd_mult``.
    """
    for group in optimizer.param_groups:
        mult = group["wd_mult"] if "wd_mult" in group else float(group["name"] == "decay")
        group["weight_decay"] = cfg.weight_decay * mult
        if "betas" in group:
            group["betas"] = (cfg.adam_beta1, cfg.adam_beta2)
        if "eps" in group:
            group["eps"] = cfg.adam_eps
    use_fused_adamw(optimizer)


class ParamGroupSchedule:
    """:class:`WarmupDecay` applied to the ``param_groups`` of any optimizer (Megatron's are not a torch Optimizer).

    The same attributes and calls as ``LambdaLR`` that the trainer uses (``optimizer``, ``base_lrs``,
    ``lr_lambdas``, ``last_epoch``, ``step()``, ``state_dict()``), so :func:`set_schedule_step` and checkpoints treat
    both alike; the lr of 0-based step ``n`` is ``lr * WarmupDecay(n)`` bit-identically to ``LambdaLR``.
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


def optimizer_params(optimizer: torch.optim.Optimizer) -> list[torch.nn.Parameter]:
    """The optimizer's parameters in state-dict id order (group by group)."""
    return [p for group in optimizer.param_groups for p in group["params"]]


class WarmupDecay:
    """Learning-rate multiplier of optimizer step ``step`` (0-based), for ``torch.optim.lr_scheduler.LambdaLR``.

    ``warmup``: ``(step + 1) / warmup_steps`` for ``step < warmup_steps``. Then with ``p = (step - warmup_steps) /
    decay_steps`` clamped to [0, 1] and ``m = min_lr / lr``: cosine ``m + (1 - m) * (1 + cos(pi p)) / 2``, linear
    ``m + (1 - m) * (1 - p)``, constant 1 (Megatron-LM ``OptimizerParamScheduler`` formulas).
    A plain object (not a lambda) so ``LambdaLR.state_dict`` can store it.
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


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: SchedulerConfig, lr: float,
                    train_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    """``LambdaLR`` with :class:`WarmupDecay`; call ``scheduler.step()`` once after each ``optimizer.step()``."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, WarmupDecay(cfg, lr, train_steps))


def set_schedule_step(scheduler: torch.optim.lr_scheduler.LambdaLR, last_epoch: int) -> None:
    """Put a resumed scheduler at ``last_epoch`` and set each group's lr as ``LambdaLR`` computes it.

    The schedule's shape and peak lr come from the *current* config (``base_lrs`` set at construction), not from the
    checkpoint, so ``train.train_steps`` or ``scheduler.*`` may change on resume; with an unchanged config the lr is
    bit-identical to the uninterrupted run's.
    """
    scheduler.last_epoch = last_epoch
    for group, base_lr, lmbda in zip(scheduler.optimizer.param_groups, scheduler.base_lrs, scheduler.lr_lambdas):
        group["lr"] = base_lr * lmbda(last_epoch)
    scheduler._last_lr = [group["lr"] for group in scheduler.optimizer.param_groups]


def grad_norm(params: Iterable[torch.nn.Parameter], tp_group: dist.ProcessGroup | None) -> torch.Tensor:
    """Global L2 norm of the gradients of a tensor-parallel model, identical on every rank.

    Parameters sharded over TP (Megatron attribute ``tensor_model_parallel=True``) contribute their local squares,
    summed over ``tp_group``; replicated parameters (norm weights) are counted once, on TP rank 0
    (``param_is_not_tensor_parallel_duplicate``, as Megatron's ``get_grad_norm_fp32``). Gradients must already be
    reduced over data and context parallelism (DDP does it). ``torch.nn.utils.clip_grad_norm_`` would count
    replicated parameters ``tp`` times and sharded ones only locally.

    Returns:
        fp32 scalar tensor on the gradients' device (no host read); 0 when no parameter has a gradient.
    """
    params = [p for p in params if p.grad is not None]
    device = params[0].grad.device if params else torch.device("cpu")
    grads = [p.grad.detach() for p in params if param_is_not_tensor_parallel_duplicate(p)]
    return total_norm(grads, tp_group, device)


def allreduce_sequence_parallel_grads(params: Iterable[torch.nn.Parameter], tp_group: dist.ProcessGroup | None) -> None:
    """Sum over the TP group the gradients of parameters marked ``sequence_parallel`` (the norms under SP).

    Each TP rank saw only its sequence shard, so these replicated weights hold partial gradients; Megatron's
    ``finalize_model_grads`` does the same reduction for its own DDP. One coalesced all-reduce.
    """
    grads = [p.grad for p in params if getattr(p, "sequence_parallel", False) and p.grad is not None]
    if not grads or tp_group is None or dist.get_world_size(tp_group) == 1:
        return
    flat = torch._utils._flatten_dense_tensors(grads)
    dist.all_reduce(flat, group=tp_group)
    for grad, synced in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads)):
        grad.copy_(synced)


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


def clip_grads(params: Iterable[torch.nn.Parameter], max_norm: float,
               tp_group: dist.ProcessGroup | None) -> torch.Tensor:
    """Scale gradients so their global norm (:func:`grad_norm`) is at most ``max_norm``; 0 disables clipping.

    Scale ``min(1, max_norm / (norm + 1e-6))``, as ``torch.nn.utils.clip_grad_norm_``, on the device.

    Returns:
        The norm before clipping (fp32 scalar), for logging.
    """
    params = list(params)
    norm = grad_norm(params, tp_group)
    clip_to_norm(params, max_norm, norm)
    return norm
