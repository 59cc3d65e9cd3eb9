"""Rank and size helpers for ``torch.distributed`` that also work in a single process.

A process group of ``None`` means "no parallelism along that dimension" (one rank), and the global
helpers fall back to rank 0 / no barrier when ``torch.distributed`` is not initialized.
"""

from __future__ import annotations

import torch.distributed as dist


def rank_and_size(group: dist.ProcessGroup | None) -> tuple[int, int]:
    """``(rank, size)`` of this process in ``group``; ``(0, 1)`` when ``group`` is ``None``."""
    if group is None:
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def global_rank() -> int:
    """This process's rank in the default group, or 0 when ``torch.distributed`` is not initialized."""
    return dist.get_rank() if dist.is_initialized() else 0


def barrier() -> None:
    """``dist.barrier()`` over the default group; a no-op when ``torch.distributed`` is not initialized."""
    if dist.is_initialized():
        dist.barrier()
