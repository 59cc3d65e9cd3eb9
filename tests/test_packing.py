import random

import pytest

from packsft.layout import check_max_seq_len, conversation_cost
from packsft.packing.algorithms import (
    ALGORITHMS,
    best_fit_decreasing,
    lower_bound_rows,
    next_fit,
    pack,
)


def test_cost_is_cp_aligned():
    assert [conversation_cost(n, 1) for n in (1, 5, 8)] == [1, 5, 8]
    assert [conversation_cost(n, 2) for n in (1, 4, 5, 8)] == [4, 4, 8, 8]
    assert [conversation_cost(n, 4) for n in (1, 8, 9)] == [8, 8, 16]
    check_max_seq_len(4096, 4)
    with pytest.raises(ValueError, match="multiple of 2 \\* context_parallel_size \\(8\\)"):
        check_max_seq_len(4100, 4)
    with pytest.raises(ValueError):
        conversation_cost(3, 0)


def test_next_fit_hand_example_keeps_order_and_closes_full_rows():
    # 3+3 fills the row exactly (closed), 4 opens a row, 2 fits (6), next 2 does not -> new row
    assert next_fit([3, 3, 4, 2, 2], 6) == [[0, 1], [2, 3], [4]]
    assert next_fit([5, 2, 1], 6) == [[0], [1, 2]]


def test_best_fit_decreasing_hand_example():
    # sorted: 5(0), 4(2), 3(1), 2(3), 1(4): 5 -> row0 (left 1); 4 -> row1 (left 2); 3 -> row2 (left 3);
    # 2 -> best fit is row1 (left 2 -> 0); 1 -> best fit is row0 (left 1 -> 0)
    assert best_fit_decreasing([5, 3, 4, 2, 1], 6) == [[0, 4], [2, 3], [1]]


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_every_conversation_in_exactly_one_row_and_capacity_respected(algorithm):
    rng = random.Random(0)
    costs = [rng.randint(1, 900) for _ in range(3000)]
    rows = pack(costs, 2048, algorithm)
    assert sorted(i for r in rows for i in r) == list(range(len(costs)))
    assert all(sum(costs[i] for i in r) <= 2048 for r in rows)
    assert all(r == sorted(r) for r in rows)
    assert len(rows) >= lower_bound_rows(costs, 2048)


def test_best_fit_is_near_the_lower_bound_and_beats_next_fit():
    rng = random.Random(1)
    costs = [min(4096, int(rng.lognormvariate(5.5, 0.9)) + 1) for _ in range(20000)]
    bfd, nf = best_fit_decreasing(costs, 4096), next_fit(costs, 4096)
    assert len(bfd) <= lower_bound_rows(costs, 4096) + 1
    assert len(bfd) < len(nf)


def test_oversize_cost_is_rejected_and_unknown_algorithm():
    with pytest.raises(ValueError, match="conversation 1 costs 9 tokens"):
        next_fit([1, 9], 8)
    with pytest.raises(ValueError, match="unknown packing algorithm"):
        pack([1], 8, "first-fit")


def test_deterministic_under_ties():
    costs = [4] * 10 + [2] * 10
    assert best_fit_decreasing(costs, 8) == best_fit_decreasing(list(costs), 8)
    assert best_fit_decreasing(costs, 8)[0] == [0, 1]
