"""Process-group and Megatron ``parallel_state`` setup for one training process.

Works under ``torchrun`` (reads ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``,
``MASTER_PORT``) and as a plain single process (no env vars: a world of 1 on an in-memory store, no
port). Backend: NCCL when CUDA is available, else gloo (every parallel mode runs on CPU in CI).
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from packsft.layout import data_parallel_size
from packsft.model.cpu_compat import apply_cpu_workarounds


@dataclass(frozen=True)
class DistributedContext:
    """What a training process needs to know about its place in the job.

    Attributes:
        rank / world_size / local_rank: global rank, number of processes, rank on this node.
        device: ``cuda:<local_rank>`` or ``cpu``.
        tensor_model_parallel_size / context_parallel_size / data_parallel_size /
            pipeline_model_parallel_size: the parallel degrees (``world_size = tp * cp * pp * dp``).
        virtual_pipeline_model_parallel_size: model chunks per pipeline rank (None: not interleaved).
        cp_rank: this process's index in its context-parallel group (for ``slice_batch_for_cp``).
        dp_rank: index in the data-parallel group (which rows of the global batch it reads; the same on
            every pipeline stage of a model replica).
        pp_rank: this process's pipeline stage.
        tp_group / cp_group / dp_group / dp_cp_group / pp_group: process groups; ``dp_cp_group`` is the
            group gradients and the trained-token count are reduced over.
    """

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    tensor_model_parallel_size: int
    context_parallel_size: int
    data_parallel_size: int
    cp_rank: int
    dp_rank: int
    tp_group: dist.ProcessGroup
    cp_group: dist.ProcessGroup
    dp_group: dist.ProcessGroup
    dp_cp_group: dist.ProcessGroup
    pipeline_model_parallel_size: int = 1
    virtual_pipeline_model_parallel_size: int | None = None
    pp_rank: int = 0
    pp_group: dist.ProcessGroup | None = None

    @property
    def is_first_stage(self) -> bool:
        """True on the first pipeline stage (always without pipeline parallelism)."""
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        """True on the last pipeline stage (always without pipeline parallelism)."""
        return self.pp_rank == self.pipeline_model_parallel_size - 1


def _init_process_group(backend: str) -> None:
    if dist.is_initialized():
        return
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        dist.init_process_group(backend=backend, rank=int(os.environ["RANK"]),
                                world_size=int(os.environ["WORLD_SIZE"]))   # env:// MASTER_ADDR/PORT
    else:
        dist.init_process_group(backend=backend, store=dist.HashStore(), rank=0, world_size=1)


def init_distributed(tensor_model_parallel_size: int = 1, context_parallel_size: int = 1,
                     backend: str | None = None, seed: int = 1234, pipeline_model_parallel_size: int = 1,
                     virtual_pipeline_model_parallel_size: int | None = None) -> DistributedContext:
    """Initialise torch.distributed and Megatron ``parallel_state``; seed the RNGs.

    Args:
        tensor_model_parallel_size: TP degree.
        context_parallel_size: CP degree.
        pipeline_model_parallel_size, virtual_pipeline_model_parallel_size: PP degree and model chunks per
            pipeline rank (None: not interleaved), Megatron's names.
        backend: ``"nccl"`` or ``"gloo"``; default NCCL with CUDA, else gloo.
        seed: seeds ``random`` and ``torch.manual_seed`` with ``seed + 100 * pipeline rank``, as Megatron-LM's
            ``_set_random_seed`` does (the same on every TP, CP and DP rank of a stage, so ``use_cpu_initialization``
            builds identical full weights before TP slicing; another for each stage, so two stages' layers do
            not start identical), and Megatron's ``model_parallel_cuda_manual_seed`` with it (its RNG tracker;
            CPU-shimmed without CUDA).

    Returns:
        :class:`DistributedContext`.

    Raises:
        ValueError: if ``WORLD_SIZE`` is not a multiple of ``tp * cp * pp``, ``parallel_state`` is already
            initialised with other sizes, or ``backend`` is ``nccl`` without CUDA or NCCL.
    """
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl" and not (torch.cuda.is_available() and dist.is_nccl_available()):
        raise ValueError("parallel.backend=nccl needs CUDA GPUs and a torch built with NCCL; this process has "
                         f"{'no CUDA device' if not torch.cuda.is_available() else 'no NCCL'}: use gloo (or null)")
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
    _init_process_group(backend)
    want = (tensor_model_parallel_size, context_parallel_size, pipeline_model_parallel_size,
            virtual_pipeline_model_parallel_size)
    if parallel_state.model_parallel_is_initialized():
        have = (parallel_state.get_tensor_model_parallel_world_size(),
                parallel_state.get_context_parallel_world_size(),
                parallel_state.get_pipeline_model_parallel_world_size(),
                parallel_state.get_virtual_pipeline_model_parallel_world_size())
        if have != want:
            raise ValueError(f"parallel_state is already initialised with (tp, cp, pp, vp) = {have}, "
                             f"not {want}; call destroy_distributed() first")
    world_size = dist.get_world_size()
    data_parallel_size(world_size, tensor_model_parallel_size, context_parallel_size,
                       pipeline_model_parallel_size)
    apply_cpu_workarounds()
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=tensor_model_parallel_size, context_parallel_size=context_parallel_size,
            pipeline_model_parallel_size=pipeline_model_parallel_size,
            virtual_pipeline_model_parallel_size=virtual_pipeline_model_parallel_size)
    seed += 100 * parallel_state.get_pipeline_model_parallel_rank()
    random.seed(seed)
    torch.manual_seed(seed)
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    model_parallel_cuda_manual_seed(seed)   # on CPU through packsft.model.cpu_compat (no CUDA generator)
    return DistributedContext(
        rank=dist.get_rank(), world_size=world_size, local_rank=local_rank,
        device=torch.device(f"cuda:{local_rank}" if torch.cuda.is_available() else "cpu"),
        tensor_model_parallel_size=parallel_state.get_tensor_model_parallel_world_size(),
        context_parallel_size=parallel_state.get_context_parallel_world_size(),
        data_parallel_size=parallel_state.get_data_parallel_world_size(),
        cp_rank=parallel_state.get_context_parallel_rank(),
        dp_rank=parallel_state.get_data_parallel_rank(),
        tp_group=parallel_state.get_tensor_model_parallel_group(),
        cp_group=parallel_state.get_context_parallel_group(),
        dp_group=parallel_state.get_data_parallel_group(),
        dp_cp_group=parallel_state.get_data_parallel_group(with_context_parallel=True),
        pipeline_model_parallel_size=parallel_state.get_pipeline_model_parallel_world_size(),
        virtual_pipeline_model_parallel_size=parallel_state.get_virtual_pipeline_model_parallel_world_size(),
        pp_rank=parallel_state.get_pipeline_model_parallel_rank(),
        pp_group=parallel_state.get_pipeline_model_parallel_group(),
    )


def destroy_distributed() -> None:
    """Tear down Megatron ``parallel_state`` and the default process group (safe to call twice)."""
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
