"""Packing algorithms on lengths only: which conversations go into which row.

Every function here takes per-conversation *costs* in tokens (see :func:`packsft.layout.conversation_cost`) and a row
capacity ``max_seq_len``, and returns rows as lists of conversation indices. No text, no tokenizer: the
algorithms are deterministic functions of their inputs (ties are broken by index, never by hash order), so
the same input gives the same rows whatever the worker count or ``PYTHONHASHSEED``.

* ``next-fit`` (NeMo RL compatible): input order, one open row; the row is closed when the next
  conversation does not fit or the row is exactly full. Same rows for the same input.
* ``best-fit-decreasing``: over the whole dataset (not per chunk), conversations sorted by decreasing cost
  (ties: input order), each placed into the open row with the least remaining space that still fits it,
  else into a new row. A Fenwick tree over remaining capacities makes each placement O(log max_seq_len).
  Within a row, conversations are written in input order.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

ALGORITHMS = ("next-fit", "best-fit-decreasing")


def next_fit(costs: Sequence[int], max_seq_len: int) -> list[list[int]]:
    """Pack in input order with one open row (NeMo RL's sequence packing).

    Args:
        costs: per-conversation cost in tokens, each ``<= max_seq_len``.
        max_seq_len: row capacity in tokens.

    Returns:
        Rows as lists of indices into ``costs``, in input order.

    Raises:
        ValueError: when a cost exceeds ``max_seq_len`` (handle oversize conversations before packing).
    """
    rows: list[list[int]] = []
    current: list[int] = []
    used = 0
    for i, c in enumerate(costs):
        _check_cost(i, c, max_seq_len)
        if current and used + c > max_seq_len:
            rows.append(current)
            current, used = [], 0
        current.append(i)
        used += c
        if used == max_seq_len:
            rows.append(current)
            current, used = [], 0
    if current:
        rows.append(current)
    return rows


class _Fenwick:
    """Counts of open rows per remaining capacity, with "smallest capacity >= x" queries."""

    def __init__(self, size: int):
        self.n = size + 1
        self.tree = [0] * (self.n + 1)
        self.log = 1 << (self.n.bit_length())

    def add(self, cap: int, delta: int) -> None:
        i = cap + 1
        while i <= self.n:
            self.tree[i] += delta
            i += i & -i

    def prefix(self, cap: int) -> int:
        i, s = cap + 1, 0
        while i > 0:
            s += self.tree[i]
            i -= i & -i
        return s

    def kth(self, k: int) -> int:
        """Smallest capacity whose prefix count reaches ``k`` (1-based)."""
        pos, step = 0, self.log
        while step:
            nxt = pos + step
            if nxt <= self.n and self.tree[nxt] < k:
                pos = nxt
                k -= self.tree[nxt]
            step >>= 1
        return pos  # index pos+1 in 1-based = capacity pos


def best_fit_decreasing(costs: Sequence[int], max_seq_len: int) -> list[list[int]]:
    """Best-fit decreasing bin packing over the whole dataset.

    Args:
        costs: per-conversation cost in tokens, each ``<= max_seq_len``.
        max_seq_len: row capacity in tokens.

    Returns:
        Rows as lists of indices into ``costs``; rows in order of creation, indices within a row ascending.

    Raises:
        ValueError: when a cost exceeds ``max_seq_len``.

    Complexity: O(n log n) for the sort plus O(n log max_seq_len) for the placements.
    """
    for i, c in enumerate(costs):
        _check_cost(i, c, max_seq_len)
    order = sorted(range(len(costs)), key=lambda i: (-costs[i], i))
    rows: list[list[int]] = []
    fen = _Fenwick(max_seq_len)
    open_by_cap: dict[int, deque[int]] = {}  # remaining capacity -> open row ids (FIFO: oldest first)
    for i in order:
        c = costs[i]
        below = fen.prefix(c - 1) if c > 0 else 0
        total = fen.prefix(max_seq_len)
        if total > below:
            cap = fen.kth(below + 1)
            row = open_by_cap[cap].popleft()
            fen.add(cap, -1)
        else:
            cap, row = max_seq_len, len(rows)
            rows.append([])
        rows[row].append(i)
        left = cap - c
        if left > 0:
            open_by_cap.setdefault(left, deque()).append(row)
            fen.add(left, 1)
    return [sorted(r) for r in rows]


def pack(costs: Sequence[int], max_seq_len: int, algorithm: str) -> list[list[int]]:
    """Dispatch to the algorithm named ``algorithm`` (one of :data:`ALGORITHMS`).

    Raises:
        ValueError: unknown algorithm, or a cost above ``max_seq_len``.
    """
    if algorithm == "next-fit":
        return next_fit(costs, max_seq_len)
    if algorithm == "best-fit-decreasing":
        return best_fit_decreasing(costs, max_seq_len)
    raise ValueError(f"unknown packing algorithm {algorithm!r} (choose one of {', '.join(ALGORITHMS)})")


def lower_bound_rows(costs: Sequence[int], max_seq_len: int) -> int:
    """Fewest rows any packing can use: ``ceil(sum(costs) / max_seq_len)``."""
    return -(-sum(costs) // max_seq_len)


def _check_cost(i: int, c: int, max_seq_len: int) -> None:
    if c <= 0 or c > max_seq_len:
        raise ValueError(f"conversation {i} costs {c} tokens; each cost must be in 1..max_seq_len ({max_seq_len})")
