"""Gradient norm, clipping and the fused AdamW switch, on the device: nothing is read back to the host.

Megatron-Core 0.16 without TransformerEngine/Apex computes its gradient norm with ``local_multi_tensor_l2_norm``
(``torch.tensor`` of a list of device scalars: one host read per parameter) and returns it as a Python float
(``get_grad_norm_fp32``: ``.item()``), then clips with a host-side ``if``; and it builds ``torch.optim.AdamW``
without ``fused=True``. packsft's step (``packsft.train.optim``) uses the functions here instead, on CPU and CUDA
alike: the norm stays a device tensor (``torch.nn.utils.get_total_norm``, foreach), clipping multiplies by
``min(1, max_norm / (norm + 1e-6))`` on the device (``torch.nn.utils.clip_grads_with_norm_``; a factor of exactly
1.0 leaves the gradients bit-identical, as Megatron's skipped clip does), and AdamW runs its fused kernel where torch
has one for the parameters' device, skipping its update on the device when told to (:func:`skip_update_if`).
"""

from __future__ import annotations

import functools
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import Tensor


def total_norm(grads: list[Tensor], group: dist.ProcessGroup | None, device: torch.device | str) -> Tensor:
    """L2 norm of ``grads`` (this rank's share) combined over ``group`` as ``sqrt(all_reduce(sum of squares))``.

    Returns:
        fp32 0-d tensor on ``device`` (0 without gradients); no host read.
    """
    if grads:
        squared = torch.nn.utils.get_total_norm(grads, norm_type=2.0).float().square().to(device)
    else:
        squared = torch.zeros((), dtype=torch.float32, device=device)
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(squared, op=dist.ReduceOp.SUM, group=group)
    return squared.sqrt()


def clip_to_norm(params: Iterable[torch.nn.Parameter], max_norm: float, norm: Tensor) -> None:
    """Scale the ``.grad`` of ``params`` by ``min(1, max_norm / (norm + 1e-6))`` in place, on the device; ``max_norm``
    0 disables clipping."""
    params = [p for p in params if p.grad is not None]
    if max_norm > 0 and params:
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)


def megatron_grad_norm(optimizer, device: torch.device | str) -> Tensor:
    """``MegatronOptimizer.get_grad_norm()`` kept on the device: each chained optimizer's
    ``get_main_grads_for_grad_norm()`` (no TP duplicates, no shared copies) reduced over its
    ``get_grad_stats_parallel_group()``, combined as the root of the sum of squares.

    Returns:
        fp32 0-d tensor on ``device``.
    """
    squares = [total_norm(opt.get_main_grads_for_grad_norm(), opt.get_grad_stats_parallel_group(), device).square()
               for opt in getattr(optimizer, "chained_optimizers", [optimizer])]
    return torch.stack(squares).sum().sqrt()


@functools.cache
def fused_adamw_supported(device_type: str) -> bool:
    """Whether this torch has a fused AdamW kernel for ``device_type`` parameters (CUDA; CPU since torch 2.4)."""
    try:
        torch.optim.AdamW([torch.zeros(1, device=device_type, requires_grad=True)], fused=True)
    except (RuntimeError, ValueError):
        return False
    return True


def torch_optimizers(optimizer) -> list[torch.optim.Optimizer]:
    """The torch optimizers that update parameters: ``optimizer`` itself, or those inside Megatron's (chained)
    optimizer."""
    inner = [getattr(opt, "optimizer", opt) for opt in getattr(optimizer, "chained_optimizers", [optimizer])]
    return [opt for opt in inner if isinstance(opt, torch.optim.Optimizer)]


def use_fused_adamw(optimizer) -> None:
    """Switch every ``torch.optim.AdamW`` group in ``optimizer`` (torch's, or inside Megatron's) to the fused kernel
    where :func:`fused_adamw_supported`, making existing ``step`` counters one fp32 tensor per parameter on its device
    as the fused kernel keeps them (also after a checkpoint saved by the foreach path was loaded; Megatron's
    distributed optimizer loads one counter shared by all parameters, which the kernel would advance once per
    parameter)."""
    for opt in torch_optimizers(optimizer):
        if not isinstance(opt, torch.optim.AdamW):
            continue
        for group in opt.param_groups:
            if not group["params"] or not fused_adamw_supported(group["params"][0].device.type):
                continue
            group["fused"], group["foreach"] = True, False
            for p in group["params"]:
                state = opt.state.get(p)
                if state and "step" in state:     # a copy each: a loaded state may share one counter among all
                    step = torch.as_tensor(state["step"]).detach()
                    state["step"] = step.to(device=p.device, dtype=torch.float32, copy=True)


def skip_update_if(optimizer, skipped: Tensor) -> None:
    """Make the next ``step()`` of every torch optimizer in ``optimizer`` (torch's, or inside Megatron's) a no-op on
    the device where ``skipped`` (bool 0-d tensor) is true: parameters, moments and step counters stay as they were.

    torch's fused AdamW kernel reads the optimizer's ``found_inf`` attribute (as ``torch.amp.GradScaler`` sets it)
    on the device; no host read. Needs the fused kernel (:func:`use_fused_adamw`; CPU and CUDA).
    """
    found_inf = skipped.to(torch.float32)
    for opt in torch_optimizers(optimizer):
        opt.found_inf = found_inf


def optimizer_implementation(optimizer) -> str:
    """A short description for the start-up line, e.g. ``torch AdamW (fused)`` or ``Megatron DistributedOptimizer,
    torch AdamW (fused)``."""
    inner = torch_optimizers(optimizer)
    kinds = sorted({f"torch {type(opt).__name__} (" + ("fused" if all(g.get("fused") for g in opt.param_groups)
                                                       else "foreach") + ")" for opt in inner}) or ["none"]
    if inner and inner[0] is optimizer:
        return ", ".join(kinds)
    wrappers = sorted({type(opt).__name__ for opt in getattr(optimizer, "chained_optimizers", [optimizer])})
    return f"Megatron {'/'.join(wrappers)}, {', '.join(kinds)}"
