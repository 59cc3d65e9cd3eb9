"""packsft.layout: the row granularity of context and sequence parallelism."""

import pytest

from packsft.layout import check_max_seq_len, data_parallel_size, row_granularity


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


def test_world_size_must_be_a_multiple_of_the_model_parallel_sizes():
    assert data_parallel_size(16, 4, 2, 1) == 2
    assert data_parallel_size(8, pipeline_model_parallel_size=2) == 4
    with pytest.raises(ValueError, match=r"^WORLD_SIZE \(12\) must be a multiple of parallel.tensor_model_parallel_"
                       r"size \(4\) \* parallel.context_parallel_size \(2\) \* parallel.pipeline_model_parallel_size"):
        data_parallel_size(12, 4, 2, 1, parallel="parallel.")
