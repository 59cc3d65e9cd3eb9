"""Every CPU-only workaround packsft needs to run Megatron-Core 0.16.1 without CUDA, in one place.

Megatron-Core assumes a CUDA device in a few spots that packed SFT reaches. On a CPU-only build
(tests, CI, laptops) :func:`apply_cpu_workarounds` patches exactly those spots; on a machine where
``torch.cuda.is_available()`` it does nothing, so GPU runs use stock Megatron code. The list (symbols of
megatron-core 0.16; ``docs/model.md`` has the measured facts):

1. ``RotaryEmbedding.get_emb`` (``models.common.embeddings.rotary_pos_embedding``) moves ``inv_freq`` to
   ``torch.cuda.current_device()``. Replaced by :func:`_get_emb_on_own_device`,
   which computes the same ``[s, 1, 1, d]`` embedding on ``inv_freq``'s own device.
2. ``get_pos_emb_on_this_cp_rank`` (``models.common.embeddings.rope_utils``; sbhd layout with context
   parallelism only) builds its chunk index with ``pin_memory=True`` and ``.cuda()``. Replaced by
   :func:`_get_pos_emb_on_this_cp_rank` where ``rotary_pos_embedding`` imported it. The packed THD path does not use it.
3. The "cuda shim": ``torch.cuda.current_device`` returns ``"cpu"`` and ``torch.cuda.synchronize``
   is a no-op. This lets code that only *names* the current device run on CPU:
   ``dist_checkpointing`` save (the filesystem-async writer's synchronize, ``state_dict_saver``'s
   current device), Megatron DDP's ``param_and_grad_buffer`` and the global memory buffer
   (``megatron.core.utils.GlobalMemoryBuffer``). It does **not** fix code with a literal ``device="cuda"``
   (stock ``DotProductAttention`` through ``transformer.utils.get_default_causal_mask``, the Megatron
   optimizer), which is why
   packsft has its own core attention and uses ``torch.optim.AdamW`` on CPU.
4. Activation recompute: ``tensor_parallel.random.CheckpointFunction`` (what ``tensor_parallel.checkpoint`` runs for
   full recompute and for selective ``core_attn`` / ``mlp``) saves every RNG before the forward with
   ``_get_all_rng_states`` and restores it for the recompute with ``_set_all_rng_states``; both read and write the
   CUDA generator through ``tensor_parallel.random._get_cuda_rng_state`` / ``_set_cuda_rng_state``. Without CUDA
   those two become :func:`_no_cuda_rng_state` (an empty uint8 tensor) and :func:`_set_no_cuda_rng_state` (a
   no-op). The CPU generator, the only one in use, is still saved and replayed by Megatron's own code
   (``torch.get_rng_state`` / ``set_rng_state``), so CPU runs take the same recompute path as GPU runs.
5. The model-parallel RNG tracker: ``CudaRNGStatesTracker.add`` reads ``torch.cuda.get_rng_state()``; without CUDA
   :func:`_add_without_cuda` records the empty state instead, so Megatron's own ``model_parallel_cuda_manual_seed``
   runs on CPU and ``get_cuda_rng_tracker().fork()`` (entered by sequence parallelism's embedding dropout and by
   the TP linears' initialisation) works; with the CPU generator left untouched inside it, as on GPU.
"""

from __future__ import annotations

import torch
from torch import Tensor

_APPLIED = False


def _get_emb_on_own_device(self, max_seq_len: int, offset: int = 0) -> Tensor:
    """``RotaryEmbedding.get_emb`` without the move to CUDA.

    Returns:
        float32 ``[max_seq_len, 1, 1, rotary_dim]``: angles ``(offset + pos) * inv_freq``, repeated
        as ``[f, f]`` (or interleaved ``[f0, f0, f1, f1, ...]`` when ``rotary_interleaved``).
    """
    freqs = self.get_freqs_non_repeated(max_seq_len, offset)  # [s, d/2]
    if not self.rotary_interleaved:
        emb = torch.cat((freqs, freqs), dim=-1)
    else:
        emb = torch.stack((freqs.view(-1, 1), freqs.view(-1, 1)), dim=-1).view(freqs.shape[0], -1)
    return emb[:, None, None, :]


def _get_pos_emb_on_this_cp_rank(pos_emb: Tensor, seq_dim: int, cp_group) -> Tensor:
    """``rope_utils.get_pos_emb_on_this_cp_rank`` with the chunk index built on ``pos_emb``'s device.

    Cuts ``pos_emb`` along ``seq_dim`` into ``2 * cp`` chunks and keeps chunks ``r`` and
    ``2 * cp - 1 - r`` (the load-balanced causal layout).

    Raises:
        ValueError: if ``cp_group`` is None.
    """
    if cp_group is None:
        raise ValueError("cp_group must be provided to get positional embedding per CP rank")
    cp_size, cp_rank = cp_group.size(), cp_group.rank()
    cp_idx = torch.tensor([cp_rank, 2 * cp_size - cp_rank - 1], device=pos_emb.device)
    pos_emb = pos_emb.view(*pos_emb.shape[:seq_dim], 2 * cp_size, -1, *pos_emb.shape[seq_dim + 1:])
    pos_emb = pos_emb.index_select(seq_dim, cp_idx)
    return pos_emb.view(*pos_emb.shape[:seq_dim], -1, *pos_emb.shape[seq_dim + 2:])


_NO_CUDA_RNG_STATE = torch.empty(0, dtype=torch.uint8)


def _no_cuda_rng_state(device="cuda", clone: bool = False, graph_safe: bool = False) -> Tensor:
    """``tensor_parallel.random._get_cuda_rng_state`` without CUDA: an empty uint8 ``[0]`` tensor (no generator)."""
    return _NO_CUDA_RNG_STATE


def _set_no_cuda_rng_state(new_state: Tensor, device: int = -1, graph_safe: bool = False) -> None:
    """``tensor_parallel.random._set_cuda_rng_state`` without CUDA: nothing to restore (the CPU RNG is separate)."""


def _add_without_cuda(self, name: str, seed: int) -> None:
    """``CudaRNGStatesTracker.add`` without CUDA: register ``name`` with the empty (no generator) state.

    Raises:
        Exception: ``name`` is already registered, as Megatron's ``add`` does.
    """
    if name in self.states_:
        raise Exception(f"cuda rng state {name} already exists")
    self.states_[name] = _NO_CUDA_RNG_STATE


def _apply_cuda_shim() -> None:
    """Make ``torch.cuda.current_device()`` return ``"cpu"`` and ``torch.cuda.synchronize()`` a no-op."""
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.synchronize = lambda *args, **kwargs: None


def apply_cpu_workarounds() -> bool:
    """Apply the five CPU workarounds of this module once per process; no-op when CUDA is available.

    Idempotent: a second call changes nothing. Call it before building a model (``init_distributed``
    does).

    Returns:
        True if the workarounds are (now) in effect, False on a CUDA machine.
    """
    global _APPLIED
    if torch.cuda.is_available():
        return False
    if _APPLIED:
        return True
    from megatron.core.models.common.embeddings import rope_utils, rotary_pos_embedding
    from megatron.core.tensor_parallel import random as tp_random

    rotary_pos_embedding.RotaryEmbedding.get_emb = _get_emb_on_own_device
    rotary_pos_embedding.get_pos_emb_on_this_cp_rank = _get_pos_emb_on_this_cp_rank
    rope_utils.get_pos_emb_on_this_cp_rank = _get_pos_emb_on_this_cp_rank
    tp_random._get_cuda_rng_state = _no_cuda_rng_state
    tp_random._set_cuda_rng_state = _set_no_cuda_rng_state
    tp_random.CudaRNGStatesTracker.add = _add_without_cuda
    _apply_cuda_shim()
    _APPLIED = True
    return True
