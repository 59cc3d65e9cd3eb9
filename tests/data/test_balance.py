"""loader.balance: attention (packsft/data/balance.py): lengths, the plan, and the loader that uses it."""

import numpy as np
import pytest
import torch

import packsft.data.balance as balance
from packsft.data.loader import DataLoaderConfig, build_train_dataloader, load_loader_state_dict, loader_state_dict
from packsft.data.mixing import MixedDataset
from packsft.data.row import build_row_flat

pytestmark = pytest.mark.filterwarnings("ignore:.set_vital. is deprecated:UserWarning")


class SegmentRows:
    """Row ``i`` is ``{"row": i, "cu_seqlens": ...}`` of conversations of ``lengths[i]`` tokens."""

    def __init__(self, lengths, fingerprint="seg-v1"):
        self.lengths, self.fingerprint = [list(x) for x in lengths], fingerprint

    def __len__(self):
        return len(self.lengths)

    def __getitem__(self, i):
        cu = np.concatenate([[0], np.cumsum(self.lengths[i])]).astype(np.int32)
        return {"row": torch.tensor(i), "cu_seqlens": torch.from_numpy(cu)}


def skewed(n=32, seed=0):
    """Rows of one long conversation (a quarter of them, at random places) among rows of many short ones, as
    packing at 8K gives."""
    long = set(np.random.default_rng(seed).permutation(n)[:n // 4].tolist())
    return [[8000] if i in long else [200] * 40 for i in range(n)]


@pytest.mark.parametrize("cp", [1, 2])
def test_real_segment_lengths_are_the_built_rows_cu_seqlens(cp):
    for lengths in ([5, 3, 9], [7], [4, 30], [3, 3, 3, 3, 3, 3]):   # fits, one too long, cut, dropped at L = 16
        stored = np.minimum(lengths, 16)
        tokens = np.ones(int(stored.sum()), dtype=np.int32)
        row, _ = build_row_flat(tokens, tokens, np.asarray(lengths), 0, 16, cp)
        assert balance.real_segment_lengths(lengths, 16, cp).tolist() == np.diff(row["cu_seqlens"].numpy()).tolist()


def test_lengths_come_from_the_token_cache_or_the_row_and_through_a_mixture():
    class Cache:
        def row(self, r):
            return None, None, np.asarray([[10, 30], [6, 2]][r])

    class Cached:          # a PackedSFTDataset's attributes the reader uses
        token_cache, max_seq_len, context_parallel_size = Cache(), 32, 1

        def __len__(self):
            return 2

    assert balance.segment_lengths_reader(Cached())(0).tolist() == [10, 22]
    mixture = MixedDataset({"a": SegmentRows([[3, 4]]), "b": Cached()})
    read = balance.segment_lengths_reader(mixture)
    assert [read(i).tolist() for i in range(3)] == [[3, 4], [10, 22], [6, 2]]
    assert balance.attention_cost(read(0)) == 25


def test_partition_covers_each_position_once_with_equal_counts_and_is_deterministic():
    costs = [int(x) for x in np.random.default_rng(1).integers(1, 10**9, 24)]
    bins = balance.partition(range(24), costs, 4)
    assert sorted(p for b in bins for p in b) == list(range(24)) and [len(b) for b in bins] == [6] * 4
    assert bins == balance.partition(list(range(24)), list(costs), 4)


def test_balance_lowers_max_over_mean_on_a_skewed_batch():
    rows = SegmentRows(skewed())
    plan = balance.AttentionBalance(rows)(list(range(32)), 4, 2)
    assert sorted(i for rank in plan for micro in rank for i in micro) == list(range(32))
    assert all(len(rank) == 4 and all(len(m) == 2 for m in rank) for rank in plan)
    cost = [balance.attention_cost(x) for x in rows.lengths]

    def max_over_mean(ranks):
        loads = [sum(cost[i] for i in r) for r in ranks]
        return max(loads) / np.mean(loads)

    balanced = max_over_mean([[i for m in rank for i in m] for rank in plan])
    strided = max_over_mean([list(range(r, 32, 4)) for r in range(4)])
    assert balanced == 1.0 and strided > 1.3


def balanced_loader(rank, dp_size, micro_batch_size, rows, balance="attention"):
    return build_train_dataloader(rows, DataLoaderConfig(seed=5, micro_batch_size=micro_batch_size, balance=balance),
                                  dp_rank=rank, dp_size=dp_size, global_batch_size=16,
                                  collate_fn=lambda got: [int(r["row"]) for r in got])


def steps_of(dp_size, micro_batch_size, rows, steps, state=None):
    """Per step, per rank: the rows of each rank's balanced loader (built in process)."""
    out = [[[] for _ in range(dp_size)] for _ in range(steps)]
    for rank in range(dp_size):
        one = balanced_loader(rank, dp_size, micro_batch_size, rows)
        if state is not None:
            load_loader_state_dict(one, state)
        it = iter(one)
        for step in range(steps):
            for _ in range(16 // (dp_size * micro_batch_size)):
                out[step][rank] += next(it)
    return out


def test_the_balanced_loader_trains_the_same_global_batches_at_any_dp_size_and_resumes():
    rows = SegmentRows(skewed(40, seed=3))
    plain = steps_of(1, 1, rows, 5)     # balance at dp 1 only orders the rows
    for dp, b in [(2, 1), (4, 2), (4, 1)]:
        got = steps_of(dp, b, rows, 5)
        assert [sorted(i for r in ranks for i in r) for ranks in got] == [sorted(r[0]) for r in plain]
        assert got == steps_of(dp, b, rows, 5)        # deterministic
    first = balanced_loader(0, 4, 1, rows)
    it = iter(first)
    for _ in range(2 * 4):                            # 2 steps of 4 micro-batches
        next(it)
    resumed = steps_of(2, 2, rows, 3, state=loader_state_dict(first))
    assert [sorted(i for r in ranks for i in r) for ranks in resumed] == [sorted(r[0]) for r in plain[2:]]


class PerRankSampler:
    """A custom sampler of the per-rank contract: this rank's rows, forever."""

    def __init__(self, data_source, dp_rank=0, dp_size=1, seed=0):
        self.rows = list(range(dp_rank, len(data_source), dp_size))

    def __iter__(self):
        while True:
            yield from self.rows

    def state_dict(self):
        return {}

    def load_state_dict(self, state):
        pass


def test_balance_needs_a_global_order_sampler():
    with pytest.raises(ValueError, match="loader.balance='attention' assigns the rows of each global batch to ranks"):
        DataLoaderConfig(sampler="custom", sampler_class_path=f"{__name__}.PerRankSampler", balance="attention")
    with pytest.raises(ValueError, match=r"loader.balance must be one of \('none', 'attention'\), got 'flops'"):
        DataLoaderConfig(balance="flops")
