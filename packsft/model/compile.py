"""Opt-in ``torch.compile`` of each transformer layer (``train.compile: true``).

Each ``TransformerLayer`` of the model gets ``nn.Module.compile()`` (torch.compile of its forward: fuses the residual
adds, norms, RoPE rotation, SwiGLU and casts around the GEMMs); the core attention stays eager
(``torch.compiler.disable``): its per-row offsets are host ints that would recompile the graph for every row, and
``varlen_attn`` is an opaque custom op anyway. Megatron-Core 0.16's ``get_tensor_model_parallel_group_if_none``
calls ``warnings.warn`` whenever a linear is called with ``tp_group=None`` (every ``RowParallelLinear``), a graph
break in every layer; the layer-side modules get a copy without the warning. The compiled layers compute what the
eager ones do (``tests/model/test_compile.py``, run eagerly there because compiling costs minutes on a CPU runner).
"""

from __future__ import annotations

import torch
from megatron.core import parallel_state


def tp_group_if_none(tp_group, is_expert: bool = False, check_initialized: bool = True):
    """Megatron's ``get_tensor_model_parallel_group_if_none`` without its deprecation warning: ``tp_group``, or the
    (expert) tensor-parallel group of ``parallel_state`` when it is None."""
    if not torch.distributed.is_initialized():
        return None
    if not parallel_state.is_initialized() or tp_group is not None:
        return tp_group
    if is_expert:
        return parallel_state.get_expert_tensor_parallel_group(check_initialized=check_initialized)
    return parallel_state.get_tensor_model_parallel_group(check_initialized=check_initialized)


def compile_transformer_layers(gpt: torch.nn.Module) -> int:
    """``torch.compile`` every transformer layer of ``gpt`` (a ``GPTModel`` or one pipeline chunk) in place, the core
    attention excluded.

    Returns:
        The number of layers compiled.
    """
    from megatron.core.tensor_parallel import layers, mappings
    from megatron.core.tensor_parallel import utils as tp_utils
    from megatron.core.transformer import mlp

    for module in (layers, mappings, tp_utils, mlp):
        if hasattr(module, "get_tensor_model_parallel_group_if_none"):
            module.get_tensor_model_parallel_group_if_none = tp_group_if_none
    count = 0
    for layer in gpt.decoder.layers:
        core = layer.self_attention.core_attention
        core.forward = torch.compiler.disable(core.forward)
        layer.compile()
        count += 1
    return count
