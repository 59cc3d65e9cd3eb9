"""packsft.layout: the row granularity of context and sequence parallelism."""

import pytest

from packsft.layout import check_max_seq_len, row_granularity


@pytest.mark.parametrize("cp, sp, expected", [(1, 1, 1), (2, 1, 4), (1, 2, 2), (1, 8, 8), (2, 2, 4), (2, 4, 8),
                                              (4, 2, 8), (3, 4, 12)])
def test_row_granularity_is_lcm_of_2cp_and_cp_times_tp(cp, sp, expected):
    assert row_granularity(cp, sp) == expected


def test_sequence_parallel_needs_the_row_to_split_over_tp():
    check_max_seq_len(4096, 2, 4)
    with pytest.raises(ValueError, match=r"lcm\(2 \* context_parallel_size, context_parallel_size \* tensor"):
        check_max_seq_len(12, 1, 8)
    with pytest.raises(ValueError, match="2 \\* context_parallel_size"):
        check_max_seq_len(6, 2)
    with pytest.raises(ValueError, match="sequence_parallel_size"):
        check_max_seq_len(8, 1, 0)
