"""The resume's per-rank reads agree: a file one rank refuses stops every rank, each with one error naming it."""

from types import SimpleNamespace

import pytest
from distributed_helpers import run_distributed

from packsft.train.checkpointer import read_on_every_rank


def _agree_worker(rank, world_size, failing):
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    ctx = SimpleNamespace(rank=rank, world_size=world_size, device=torch.device("cpu"))

    def read():
        if rank in failing:
            raise ValueError(f"rng_rank{rank}.pt: refused")

    try:
        read_on_every_rank(read, ctx, "ckpt/iter_0000030")
    except ValueError as err:
        return str(err)
    return None


@pytest.mark.distributed
def test_a_file_refused_on_one_rank_stops_every_rank():
    """One rank refused its ``rng_rank0.pt``; the other went on into the training loop and died in a collective,
    and the launcher blamed it (exit 1) instead of the refused file (exit 2 on every rank)."""
    assert run_distributed(_agree_worker, 2, {0}) == [
        "rng_rank0.pt: refused",
        "checkpoint ckpt/iter_0000030: rank 0 could not read its files (its error line names the file); no rank "
        "resumes"]
    assert run_distributed(_agree_worker, 2, set()) == [None, None]
