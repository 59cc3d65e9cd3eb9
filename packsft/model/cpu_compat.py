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
   optimizer), which is why packsft has its own core attention and needs 6.
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
6. Literal ``device="cuda"`` tensors of the Megatron optimizer (``megatron.core.optimizer``): the
   ``found_inf`` / ``_dummy_overflow_buf`` / ``_scale_one`` buffers of ``MixedPrecisionOptimizer``
   (``Float16OptimizerWithFloat16Params`` and ``DistributedOptimizer``), ``FP32Optimizer._scale``,
   ``ChainedOptimizer.get_loss_scale``, ``get_grad_norm_fp32`` / ``clip_grad_by_total_norm_fp32`` /
   ``count_zeros_fp32`` (``optimizer.clip_grads``), the grad scalers, and ``DistributedOptimizer``'s
   state-dict shard buffers. The modules ``optimizer.optimizer``, ``optimizer.clip_grads``,
   ``optimizer.distrib_optimizer`` and ``optimizer.grad_scaler`` get :class:`_CpuTensorTorch` as their
   ``torch`` global: the same module, except that ``torch.tensor/zeros/ones/empty/full`` called with a
   CUDA ``device`` allocate on the CPU. ``clip_grads.l2_norm_impl`` (``megatron.core.utils``'
   ``local_multi_tensor_l2_norm`` fallback, which also returns a ``"cuda"`` tensor) is replaced by
   :func:`_l2_norm_on_own_device`. The optimizer also sorts parameters by ``Tensor.type()`` names
   (``torch.cuda.FloatTensor`` / ``HalfTensor`` / ``BFloat16Tensor``; anything else is a ``TypeError``) in
   ``DistributedOptimizer.__init__`` (and its ``_build_model_and_main_param_groups``),
   ``Float16OptimizerWithFloat16Params.__init__`` and ``clip_grad_by_total_norm_fp32``; while those run,
   :func:`_cuda_type_names` makes ``Tensor.type()`` of a CPU tensor answer the CUDA name.
   Together with 3 (``param_and_grad_buffer`` allocates on ``torch.cuda.current_device()``) this runs
   Megatron's ``DistributedDataParallel`` and ``get_megatron_optimizer`` (also ``use_distributed_optimizer``,
   fp32 or bf16) on gloo.
7. Pipeline parallelism: the schedules of ``pipeline_parallel.schedules``
   (``forward_backward_pipelining_without_interleaving`` / ``_with_interleaving``, ``forward_backward_no_pipelining``)
   allocate their ``total_num_tokens`` counter with a literal ``device="cuda"``; the module gets
   :class:`_CpuTensorTorch` as its ``torch`` global, as in 6. ``pipeline_parallel.p2p_communication.P2PCommunicator``
   allocates its receive buffers on ``torch.cuda.current_device()`` with ``config.pipeline_dtype`` and
   synchronizes CUDA, both served by 3; its ``batch_isend_irecv`` runs on gloo unchanged.
   ``LanguageModule.setup_embeddings_and_output_layer`` (``models.common.language_module.language_module``) moves
   the tied word embedding of the first and last stage to CUDA (``weight.data.cuda()``) before all-reducing it over
   the embedding group; :func:`_setup_embeddings_on_own_device` runs it with ``Tensor.cuda`` returning the tensor
   itself.
8. Vision: ``CLIPViTModel.__init__`` (``models.vision.clip_vit_model``, the LLaVA encoder) moves its
   ``position_ids`` buffer to CUDA (``torch.arange(...).cuda()``); :func:`_apply_vision_shim` runs it with
   ``Tensor.cuda`` returning the tensor itself (the wrapper of 7).
9. Compiled activations: megatron's ``jit_fuser`` ``torch.compile``s ``activations.quick_gelu`` (CLIP's MLP), which
   on the CPU needs a C++ compiler (Inductor's CPU backend; none on ``PATH``: ``InvalidCxxCompiler`` at the first
   step); :func:`eager_activation` gives the function it wraps (the same math, eager) where there is no CUDA.
"""

from __future__ import annotations

import contextlib
import functools

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
    """
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
    """``CudaRNGStatesTracker.add`` without CUDA: register ``name`` with the empty (no generator) state."""
    self.states_[name] = _NO_CUDA_RNG_STATE


def _is_cuda(device) -> bool:
    return (isinstance(device, str) and device.startswith("cuda")) or (
        isinstance(device, torch.device) and device.type == "cuda")


class _CpuTensorTorch:
    """The ``torch`` module as seen by a patched Megatron module: CUDA tensor factories allocate on the CPU.

    ``tensor``, ``zeros``, ``ones``, ``empty`` and ``full`` called with ``device="cuda"`` (or ``cuda:N``) get
    ``device="cpu"``; every other attribute is ``torch``'s own.
    """

    _FACTORIES = frozenset({"tensor", "zeros", "ones", "empty", "full"})

    def __init__(self, module) -> None:
        self._module = module

    def __getattr__(self, name: str):
        value = getattr(self._module, name)
        if name not in self._FACTORIES:
            return value

        def on_cpu(*args, **kwargs):
            if _is_cuda(kwargs.get("device")):
                kwargs["device"] = "cpu"
            return value(*args, **kwargs)

        return on_cpu


def _l2_norm_on_own_device(chunk_size, noop_flag, tensor_lists, per_tensor, *args):
    """``local_multi_tensor_l2_norm`` returning its result on the tensors' device.

    Returns:
        ``(fp32 [1] tensor: the L2 norm over every tensor of ``tensor_lists``, None)``.
    """
    tensors = [t for tensor_list in tensor_lists for t in tensor_list]
    device = tensors[0].device if tensors else torch.device("cpu")
    if not tensors:
        return torch.zeros(1, dtype=torch.float, device=device), None
    norms = torch.stack([torch.linalg.vector_norm(t.float()) for t in tensors])
    return torch.linalg.vector_norm(norms).reshape(1), None


@contextlib.contextmanager
def _cuda_type_names():
    """While active, ``Tensor.type()`` without arguments names a CPU tensor as CUDA (``torch.cuda.FloatTensor``)."""
    original = torch.Tensor.type

    def cuda_type(self, *args, **kwargs):
        name = original(self, *args, **kwargs)
        if args or kwargs or not isinstance(name, str) or not name.startswith("torch.") or self.is_cuda:
            return name
        return "torch.cuda." + name[len("torch."):]

    torch.Tensor.type = cuda_type
    try:
        yield
    finally:
        torch.Tensor.type = original


def _with_cuda_type_names(fn):
    """``fn`` run under :func:`_cuda_type_names`."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with _cuda_type_names():
            return fn(*args, **kwargs)

    return wrapper


def _apply_optimizer_shim() -> None:
    """Give the Megatron optimizer modules :class:`_CpuTensorTorch` and a CPU ``l2_norm_impl`` (item 4)."""
    from megatron.core.optimizer import clip_grads, distrib_optimizer, grad_scaler
    from megatron.core.optimizer import optimizer as optimizer_module

    for module in (optimizer_module, clip_grads, distrib_optimizer, grad_scaler):
        module.torch = _CpuTensorTorch(torch)
    if clip_grads.l2_norm_impl.__name__ == "local_multi_tensor_l2_norm":
        clip_grads.l2_norm_impl = _l2_norm_on_own_device
    for cls in (distrib_optimizer.DistributedOptimizer, optimizer_module.Float16OptimizerWithFloat16Params):
        cls.__init__ = _with_cuda_type_names(cls.__init__)
    clipped = _with_cuda_type_names(clip_grads.clip_grad_by_total_norm_fp32)
    clip_grads.clip_grad_by_total_norm_fp32 = optimizer_module.clip_grad_by_total_norm_fp32 = clipped


@contextlib.contextmanager
def _cuda_is_identity():
    """While active, ``Tensor.cuda()`` returns the tensor itself (there is no CUDA device to move to)."""
    original = torch.Tensor.cuda
    torch.Tensor.cuda = lambda self, *args, **kwargs: self
    try:
        yield
    finally:
        torch.Tensor.cuda = original


def _setup_embeddings_on_own_device(original):
    """``LanguageModule.setup_embeddings_and_output_layer`` run under :func:`_cuda_is_identity` (item 7)."""
    @functools.wraps(original)
    def wrapper(self, *args, **kwargs):
        with _cuda_is_identity():
            return original(self, *args, **kwargs)

    return wrapper


def _apply_pipeline_shim() -> None:
    """CPU allocation for the pipeline schedules' token counter and the tied-embedding setup (item 7)."""
    from megatron.core.models.common.language_module import language_module
    from megatron.core.pipeline_parallel import schedules

    schedules.torch = _CpuTensorTorch(torch)
    cls = language_module.LanguageModule
    cls.setup_embeddings_and_output_layer = _setup_embeddings_on_own_device(cls.setup_embeddings_and_output_layer)


def _apply_vision_shim() -> None:
    """Build ``CLIPViTModel``'s ``position_ids`` on the CPU (item 8)."""
    from megatron.core.models.vision import clip_vit_model

    cls = clip_vit_model.CLIPViTModel
    cls.__init__ = _setup_embeddings_on_own_device(cls.__init__)


def eager_activation(fn):
    """``fn`` (an activation), or without CUDA the eager function a ``torch.compile`` wrapper holds (item 9)."""
    return fn if torch.cuda.is_available() else getattr(fn, "_torchdynamo_orig_callable", fn)


def _apply_cuda_shim() -> None:
    """Make ``torch.cuda.current_device()`` return ``"cpu"`` and ``torch.cuda.synchronize()`` a no-op."""
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.synchronize = lambda *args, **kwargs: None


def apply_cpu_workarounds() -> bool:
    """Apply CPU workarounds 1-8 of this module once per process (9 is :func:`eager_activation`, called where the
    activation is chosen); no-op when CUDA is available.

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
    _apply_optimizer_shim()
    _apply_pipeline_shim()
    _apply_vision_shim()
    _APPLIED = True
    return True
