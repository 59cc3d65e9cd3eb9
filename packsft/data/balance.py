"""``loader.balance: attention``: the rows of each global batch assigned to data-parallel ranks and micro-batches
so that every rank's attention work is about the same.

Cost of a row: ``sum(s_i ** 2)`` over its segments, ``s_i`` the real length of conversation ``i`` in the row (its
``cu_seqlens`` differences): causal attention costs ``s_i ** 2 / 2`` multiply-adds per head dimension, per
layer. Every packed row is ``max_seq_len`` tokens, so a rank's linear cost (projections, MLP, loss) is the same
whatever rows it gets; balancing ``sum(s_i ** 2)`` balances ``linear + attention`` for any weight of the two.

Plan (:class:`AttentionBalance`): the longest-processing-time rule with equal counts, twice: the global batch's
rows, by cost (descending, ties by position), each to the rank with the least cost so far among those with
fewer than ``global_batch_size / dp_size`` rows (ties: lowest rank); then each rank's rows likewise into its
micro-batches of ``micro_batch_size`` rows, ordered by their first row's position in the global batch. A pure
function of the global batch (integers, no floating point): every rank computes the same plan, and a resumed run
the same plan again.

Where the lengths come from (:func:`segment_lengths_reader`): the packer's token cache (its per-conversation
lengths, laid out as :func:`packsft.data.row.build_row_flat` lays them), else the row's own ``cu_seqlens`` (the
row is built: tokenized when there is no cache; each row's cost is computed once per process).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from packsft.layout import conversation_cost

BALANCE_MODES = ("none", "attention")


def real_segment_lengths(lengths: Sequence[int], max_seq_len: int, context_parallel_size: int = 1) -> np.ndarray:
    """The ``cu_seqlens`` differences of the row built from conversations of ``lengths`` tokens: int64 ``[kept]``.

    Conversations are laid out at their CP-padded costs; those starting at or after ``max_seq_len`` are dropped and
    the last kept one is cut at ``max_seq_len`` (:func:`packsft.data.row.build_row_flat`).
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    costs = conversation_cost(lengths, context_parallel_size)
    starts = np.cumsum(costs) - costs
    kept = starts < max_seq_len
    return np.minimum(lengths[kept], max_seq_len - starts[kept])


def segment_lengths_reader(dataset: Any) -> Callable[[int], np.ndarray]:
    """A function of a row index giving that row's real segment lengths (int64), for ``dataset``.

    ``MixedDataset`` (``locate``/``datasets``): each source's reader. A dataset with a ``token_cache``
    (``PackedSFTDataset``): from the cache's lengths, without building the row. Otherwise: the row's
    ``cu_seqlens`` (``dataset[i]``).
    """
    if hasattr(dataset, "locate") and hasattr(dataset, "datasets"):
        readers = [segment_lengths_reader(d) for d in dataset.datasets]

        def mixed(index: int) -> np.ndarray:
            source, row = dataset.locate(index)
            return readers[source](row)
        return mixed
    cache = getattr(dataset, "token_cache", None)
    if cache is not None:
        L, cp = dataset.max_seq_len, dataset.context_parallel_size
        return lambda index: real_segment_lengths(cache.row(index)[2], L, cp)
    return lambda index: np.diff(np.asarray(dataset[index]["cu_seqlens"], dtype=np.int64))


def attention_cost(segment_lengths: Sequence[int]) -> int:
    """``sum(s ** 2)`` of a row's real segment lengths (Python int: no overflow)."""
    return sum(int(s) * int(s) for s in segment_lengths)


def partition(positions: Sequence[int], costs: Sequence[int], bins: int) -> list[list[int]]:
    """Split ``positions`` (``len`` a multiple of ``bins``) into ``bins`` lists of equal length with balanced
    ``costs[p]`` sums: the longest-processing-time rule with equal counts; each list sorted, the lists in the
    order of their first position. Deterministic."""
    capacity = len(positions) // bins
    heap = [(0, k) for k in range(bins)]
    out: list[list[int]] = [[] for _ in range(bins)]
    for p in sorted(positions, key=lambda p: (-costs[p], p)):
        load, k = heapq.heappop(heap)
        out[k].append(p)
        if len(out[k]) < capacity:
            heapq.heappush(heap, (load + costs[p], k))
    return sorted((sorted(b) for b in out), key=lambda b: b[0])


class AttentionBalance:
    """The ``loader.balance: attention`` plan (see the module docstring); a :data:`packsft.data.samplers.Plan`.

    Args:
        dataset: the training dataset (see :func:`segment_lengths_reader`).

    Each row's cost is computed once per process and kept (one int per row seen).
    """

    def __init__(self, dataset: Any) -> None:
        self.segment_lengths = segment_lengths_reader(dataset)
        self._costs: dict[int, int] = {}

    def row_cost(self, index: int) -> int:
        """:func:`attention_cost` of row ``index``."""
        cost = self._costs.get(index)
        if cost is None:
            cost = self._costs[index] = attention_cost(self.segment_lengths(index))
        return cost

    def __call__(self, batch: list[int], dp_size: int, micro_batch_size: int) -> list[list[list[int]]]:
        """For each rank, its micro-batches of ``batch`` (row indices): every row of ``batch`` exactly once."""
        costs = [self.row_cost(i) for i in batch]
        ranks = partition(range(len(batch)), costs, dp_size)
        per_rank = len(batch) // dp_size
        return [[[batch[p] for p in micro] for micro in partition(mine, costs, per_rank // micro_batch_size)]
                for mine in ranks]
