"""Packing algorithms on lengths only: which conversations go into which row.

Every function here takes per-conversation *costs* in tokens (see :func:`packsft.layout.conversation_cost`) and a row
capacity ``max_seq_len``, and returns rows as lists of conversation indices, each list ascending (a row's
conversations are written in input order); :func:`pack_order` returns the same rows as two flat int64 arrays,
with no Python object per conversation (what the packer uses). No text, no tokenizer: the algorithms are
deterministic functions of their inputs (ties are broken by index, never by hash order or the clock), so the same
input gives the same rows whatever the worker count or ``PYTHONHASHSEED``.

* ``next-fit`` (NeMo RL compatible): input order, one open row; the row is closed when the next
  conversation does not fit or the row is exactly full.
* ``best-fit-decreasing``: over the whole dataset (not per chunk), conversations sorted by decreasing cost
  (ties: input order), each placed into the open row with the least remaining space that still fits it,
  else into a new row. Computed one distinct cost at a time (all conversations of one cost in one pass).
* ``bfd-local-search`` (default): best-fit decreasing, then an improvement pass that empties the least-filled
  row by re-packing it, with the rows that have the most space left, into one row fewer (exact subset-sum
  fills); it repeats while the row count is above :func:`lower_bound_rows` and never ends with more rows
  than best-fit decreasing.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

import numpy as np

ALGORITHMS = ("bfd-local-search", "best-fit-decreasing", "next-fit")
DEFAULT_ALGORITHM = "bfd-local-search"
_TRIES = 8  # group sizes tried per row removed: the smallest group with enough space, then twice as many rows, ...


def next_fit(costs: Sequence[int], max_seq_len: int) -> list[list[int]]:
    """Pack in input order with one open row (NeMo RL's sequence packing).

    Args:
        costs: per-conversation cost in tokens, each in ``1..max_seq_len``.
        max_seq_len: row capacity in tokens.

    Returns:
        Rows as lists of indices into ``costs``, in input order.

    Raises:
        ValueError: when a cost is outside ``1..max_seq_len`` (handle oversize conversations before packing).
    """
    return _rows_from_order(*pack_order(costs, max_seq_len, "next-fit"))


def _next_fit_starts(c: np.ndarray, L: int) -> np.ndarray:
    """Index of each next-fit row's first conversation (int64 ``[rows]``); ``c`` is int64 ``[n]``."""
    starts: list[int] = []
    used = L
    for i, v in enumerate(c.tolist()):
        if used + v > L:
            starts.append(i)
            used = 0
        used += v
    return np.asarray(starts, dtype=np.int64)


def best_fit_decreasing(costs: Sequence[int], max_seq_len: int) -> list[list[int]]:
    """Best-fit decreasing bin packing over the whole dataset.

    Conversations are taken by decreasing cost (ties: input order); each goes into the open row with the
    least space left that still holds it (ties: the row that reached that space first), else into a new row.

    Args:
        costs: per-conversation cost in tokens, each in ``1..max_seq_len``.
        max_seq_len: row capacity in tokens.

    Returns:
        Rows as lists of indices into ``costs``; rows in order of creation, indices within a row ascending.

    Raises:
        ValueError: when a cost is outside ``1..max_seq_len``.

    Complexity: O(n log n) for the sort; the placement handles all conversations of one cost ``v`` together
    (the best-fit row for the next one is the same row while its space stays ``>= v``), so it costs one step per
    (row, distinct cost) it touches plus an O(L) scan per distinct cost.
    """
    return _rows_from_order(*pack_order(costs, max_seq_len, "best-fit-decreasing"))


def bfd_local_search(costs: Sequence[int], max_seq_len: int, max_work: int | None = None) -> list[list[int]]:
    """Best-fit decreasing, then rows emptied by re-packing them with the rows that have the most space left.

    While there are more rows than :func:`lower_bound_rows`, the pass orders the rows by space left (most
    first; ties: the later row, so the least-filled row leads and full rows come last, latest first) and
    takes the shortest prefix whose space adds up to ``max_seq_len``: the least a group needs to fit in one
    row fewer. It re-packs the group's conversations into one row fewer by minimum bin slack (each new row
    holds the largest conversation left and the subset of the others that fills it the most: an exact
    subset-sum, larger costs preferred) and keeps the result only if everything fits; otherwise it tries a
    group of twice as many rows (8 sizes at most), and stops at the first row it cannot remove. Never more
    rows than :func:`best_fit_decreasing`, which it starts from.

    Args:
        costs: per-conversation cost in tokens, each in ``1..max_seq_len``.
        max_seq_len: row capacity in tokens.
        max_work: cap on the work of the pass, in steps (one per subset-sum step, i.e. per (new row, cost
            piece), one per conversation re-packed, one per 16 rows sorted); default ``10 * n + 50_000``,
            a fraction of a second per 100K conversations. The result depends on it, never on the clock.

    Returns:
        Rows as lists of indices into ``costs``, indices within a row ascending: best-fit decreasing's rows in
        creation order, the rows of each re-packed group replaced in place and the emptied rows dropped.

    Raises:
        ValueError: when a cost is outside ``1..max_seq_len``.
    """
    return _rows_from_order(*_local_search_order(_check_costs(costs, max_seq_len), max_seq_len, max_work))


def _local_search_order(c: np.ndarray, L: int, max_work: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """:func:`bfd_local_search` as ``(order, starts)`` (see :func:`pack_order`); ``c`` is int64 ``[n]``.

    The rows are kept as a row id per conversation; only the rows of re-packed groups are ever Python lists.
    """
    n = len(c)
    assign, n_rows = _bfd_assign(c, L)
    alive = n_rows
    bound = -(-int(c.sum()) // L)
    if alive <= bound:
        return _order_from_assignment(assign, alive)
    by_row = np.argsort(assign, kind="stable")
    ends = np.cumsum(np.bincount(assign, minlength=alive))
    changed: dict[int, list[int]] = {}  # row -> its conversations after a re-pack (empty: the row was emptied)

    def members(r: int) -> list[int]:
        got = changed.get(r)
        return got if got is not None else by_row[ends[r - 1] if r else 0:ends[r]].tolist()

    work = [10 * n + 50_000 if max_work is None else max_work]
    space = L - np.bincount(assign, weights=c, minlength=alive).astype(np.int64)  # an emptied row gets -1
    later_first = -np.arange(alive)
    while alive > bound and work[0] > 0:
        by_space = np.lexsort((later_first, -space))  # most space first, ties: the later row; emptied rows last
        work[0] -= alive // 16 + 1
        size = int(np.searchsorted(np.cumsum(space[by_space]), L)) + 1  # shortest prefix with space >= L
        new, group = None, []
        for _ in range(_TRIES):
            group = by_space[:size].tolist()
            items = [i for r in group for i in members(r)]
            work[0] -= len(items)
            new = _fill_rows(items, dict(zip(items, c[items].tolist())), L, len(group) - 1, work)
            if new is not None or size >= alive or work[0] <= 0:
                break
            size = min(2 * size, alive)
        if new is None:
            break
        for r, row in zip(sorted(group), new + [[]] * (len(group) - len(new))):
            changed[r] = row
            space[r] = L - int(c[row].sum()) if row else -1
            alive -= not row
    for r, row in changed.items():
        assign[row] = r
    return _order_from_assignment(assign, n_rows)


def _fill_rows(items: list[int], cost: dict[int, int], L: int, n_rows: int, work: list[int]) -> list[list[int]] | None:
    """Pack ``items`` into at most ``n_rows`` rows of ``L`` by minimum bin slack: each row holds the largest
    conversation left and, beside it, the subset of the others that fills the row the most.

    The subset is a subset-sum over the distinct costs left (counts split into powers of two, a Python
    ``int`` as the bitset of reachable sums, stopping at the first cost that fills the row exactly), traced
    back so that larger costs are taken first; within a cost, lower indices first. ``work[0]`` is decreased by the
    steps spent. Returns the rows, or ``None`` when items are left over (or the work ran out).
    """
    by_cost: dict[int, list[int]] = {}
    for i in sorted(items, key=lambda i: (cost[i], -i)):  # each list ends with its lowest index
        by_cost.setdefault(cost[i], []).append(i)
    values = sorted(by_cost, reverse=True)
    out: list[list[int]] = []
    left = len(items)
    while left:
        if len(out) == n_rows or work[0] <= 0:
            return None
        first = values[0]
        row = [by_cost[first].pop()]  # the largest conversation left opens the row (minimum bin slack)
        cap = L - first
        full = (1 << (cap + 1)) - 1
        reach, hist, pieces = 1, [], []
        for v in values:
            k = min(len(by_cost[v]), cap // v)
            p = 1
            while k:
                m = min(p, k)
                hist.append(reach)
                pieces.append((v, m))
                reach |= (reach << (v * m)) & full
                k -= m
                p <<= 1
            if reach >> cap & 1:
                break
        work[0] -= len(pieces) + 1
        target = reach.bit_length() - 1
        for j in range(len(pieces) - 1, -1, -1):
            if not target:
                break
            if hist[j] >> target & 1:
                continue
            v, m = pieces[j]
            target -= v * m
            lst = by_cost[v]
            row += lst[-m:]
            del lst[-m:]
        left -= len(row)
        values = [v for v in values if by_cost[v]]
        out.append(row)
    return out


def _bfd_assign(c: np.ndarray, L: int) -> tuple[np.ndarray, int]:
    """Row id (in creation order) of every conversation under best-fit decreasing, and the number of rows; ``c``
    is int64 ``[n]``."""
    n = len(c)
    order = np.argsort(-c, kind="stable")  # decreasing cost, ties by index
    sc = c[order]
    if n == 0:
        return np.zeros(0, dtype=np.int64), 0
    starts = np.flatnonzero(np.r_[True, sc[1:] != sc[:-1]])
    counts = np.diff(np.r_[starts, n])
    values = sc[starts].tolist()
    counts = counts.tolist()
    buckets: list[deque[int] | None] = [None] * (L + 1)  # space left -> open rows, oldest first
    nonempty = np.zeros(L + 1, dtype=bool)  # buckets[s] is not empty (kept for the vectorised scan)
    touch_rows: list[int] = []  # one (row, how many) per placement run, in sorted order
    touch_counts: list[int] = []
    n_rows = 0

    def push(s: int, r: int) -> None:
        q = buckets[s]
        if q is None:
            q = buckets[s] = deque()
        if not q:
            nonempty[s] = True
        q.append(r)

    for v, k in zip(values, counts):
        for s in (np.flatnonzero(nonempty[v:]) + v).tolist():
            q = buckets[s]
            while q and k:
                r = q.popleft()
                j = min(k, s // v)
                touch_rows.append(r)
                touch_counts.append(j)
                k -= j
                left = s - j * v
                if left:
                    push(left, r)
            if not q:
                nonempty[s] = False
            if not k:
                break
        if k:  # new rows, each taking L // v conversations (the last one the rest)
            per = L // v
            full, rest = divmod(k, per)
            touch_rows.extend(range(n_rows, n_rows + full))
            touch_counts.extend([per] * full)
            left = L - per * v
            if left and full:
                push(left, n_rows)
                buckets[left].extend(range(n_rows + 1, n_rows + full))
            n_rows += full
            if rest:
                touch_rows.append(n_rows)
                touch_counts.append(rest)
                push(L - rest * v, n_rows)
                n_rows += 1
    assign = np.empty(n, dtype=np.int64)
    assign[order] = np.repeat(np.asarray(touch_rows, dtype=np.int64), np.asarray(touch_counts, dtype=np.int64))
    return assign, n_rows


def _order_from_assignment(assign: np.ndarray, n_rows: int) -> tuple[np.ndarray, np.ndarray]:
    """``(order, starts)`` of row ids ``assign`` (``0..n_rows-1``; a row with no conversation is dropped)."""
    order = np.argsort(assign, kind="stable")  # by row, then by index
    counts = np.bincount(assign, minlength=n_rows)
    counts = counts[counts > 0]
    return order, np.cumsum(counts) - counts


def _rows_from_order(order: np.ndarray, starts: np.ndarray) -> list[list[int]]:
    """Rows as lists of indices from :func:`pack_order`'s arrays."""
    flat = order.tolist()
    bounds = [*starts.tolist(), len(flat)]
    return [flat[a:b] for a, b in zip(bounds[:-1], bounds[1:])]


def pack_order(costs: Sequence[int] | np.ndarray, max_seq_len: int,
               algorithm: str) -> tuple[np.ndarray, np.ndarray]:
    """Pack with ``algorithm`` (one of :data:`ALGORITHMS`) into flat arrays, with no Python object per conversation.

    Args:
        costs: per-conversation cost in tokens, each in ``1..max_seq_len`` (a list or an integer array).
        max_seq_len: row capacity in tokens.
        algorithm: the algorithm's name.

    Returns:
        ``(order, starts)``, both int64: ``order`` [n] the conversation indices of all rows one after another
        (indices ascending within a row), ``starts`` [rows] each row's first position in ``order``. The rows are
        those of :func:`pack`, in the same order.

    Raises:
        KeyError: unknown algorithm (``PackConfig`` and ``--algorithm`` take only :data:`ALGORITHMS`).
        ValueError: a cost outside ``1..max_seq_len``.
    """
    return _ORDERS[algorithm](_check_costs(costs, max_seq_len), max_seq_len)


_ORDERS = {"bfd-local-search": _local_search_order,
           "best-fit-decreasing": lambda c, L: _order_from_assignment(*_bfd_assign(c, L)),
           "next-fit": lambda c, L: (np.arange(len(c), dtype=np.int64), _next_fit_starts(c, L))}
"""``(order, starts)`` of each of :data:`ALGORITHMS` from int64 costs ``c`` [n] and the row capacity ``L``."""


def pack(costs: Sequence[int], max_seq_len: int, algorithm: str) -> list[list[int]]:
    """Dispatch to the algorithm named ``algorithm`` (one of :data:`ALGORITHMS`); rows as lists of indices.

    Raises:
        KeyError, ValueError: as :func:`pack_order`.
    """
    return _rows_from_order(*pack_order(costs, max_seq_len, algorithm))


def lower_bound_rows(costs: Sequence[int], max_seq_len: int) -> int:
    """Fewest rows any packing can use: ``ceil(sum(costs) / max_seq_len)``."""
    return -(-int(np.asarray(costs, dtype=np.int64).sum()) // max_seq_len)


def _check_costs(costs: Sequence[int], max_seq_len: int) -> np.ndarray:
    """``costs`` as int64 ``[n]``; raise ``ValueError`` naming the first cost outside ``1..max_seq_len``."""
    c = np.asarray(costs, dtype=np.int64).reshape(-1)
    bad = np.flatnonzero((c <= 0) | (c > max_seq_len))
    if len(bad):
        i = int(bad[0])
        raise ValueError(f"conversation {i} costs {int(c[i])} tokens; each cost must be in 1..max_seq_len "
                         f"({max_seq_len})")
    return c
