"""Samplers alone: order, data-parallel split, exact resume (packsft/data/samplers.py)."""

from itertools import islice

import pytest

from packsft.data.samplers import (
    EpochSampler,
    EvalShardSampler,
    GlobalBatchSampler,
    RandomSampler,
    ResumableBatchSampler,
    SamplerError,
    SequentialSampler,
)


def take(sampler, k):
    return list(islice(iter(sampler), k))


def test_same_seed_same_order_different_seed_different_order():
    a, b, c = RandomSampler(50, seed=3), RandomSampler(50, seed=3), RandomSampler(50, seed=4)
    assert take(a, 150) == take(b, 150)
    assert take(RandomSampler(50, seed=3), 50) != take(c, 50)


def test_random_epochs_are_fresh_permutations():
    order = take(RandomSampler(40, seed=0), 80)
    assert sorted(order[:40]) == list(range(40)) and sorted(order[40:]) == list(range(40))
    assert order[:40] != order[40:]
    assert order[:40] != list(range(40))


def test_sequential_yields_in_order_and_rolls_over():
    assert take(SequentialSampler(5), 12) == [0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 0, 1]


def rank_steps(make_sampler, dp_size, micro_batch_size, global_batch_size, steps, state=None):
    """Per step, per rank: the rows each rank's GlobalBatchSampler yields (one sampler per rank, in process)."""
    out = [[[] for _ in range(dp_size)] for _ in range(steps)]
    for rank in range(dp_size):
        gbs = GlobalBatchSampler(make_sampler(), dp_rank=rank, dp_size=dp_size, micro_batch_size=micro_batch_size,
                                 global_batch_size=global_batch_size)
        if state is not None:
            gbs.load_state_dict(state)
        micro = iter(gbs)
        for step in range(steps):
            for _ in range(gbs.micro_batches):
                out[step][rank] += next(micro)
    return out


@pytest.mark.parametrize("cls", [RandomSampler, SequentialSampler])
def test_dp_ranks_are_disjoint_and_equal_sized_and_no_row_is_dropped(cls):
    n, dp = 23, 4
    steps = rank_steps(lambda: cls(n, seed=9), dp, 1, dp, 6)    # 24 rows: one epoch and the next one's first
    stream = take(cls(n, seed=9), 24)
    for k, ranks in enumerate(steps):
        assert [len(r) for r in ranks] == [1] * dp
        assert [r[0] for r in ranks] == stream[k * dp:(k + 1) * dp]    # rank r: row r of each global batch
    assert sorted(stream[:n]) == list(range(n))                        # every row of the epoch, none dropped


@pytest.mark.parametrize("layout", [(1, 1), (1, 4), (2, 1), (2, 2), (4, 1), (4, 2)])  # (dp_size, micro_batch_size)
def test_global_batches_do_not_depend_on_dp_size_or_micro_batches(layout):
    dp, b = layout
    got = rank_steps(lambda: RandomSampler(21, seed=3), dp, b, 8, 7)
    stream = take(RandomSampler(21, seed=3), 56)
    for k, ranks in enumerate(got):
        assert sorted(i for r in ranks for i in r) == sorted(stream[8 * k:8 * (k + 1)])
        assert [len(r) for r in ranks] == [8 // dp] * dp
        assert all(r == stream[8 * k + rank:8 * (k + 1):dp] for rank, r in enumerate(ranks))


@pytest.mark.parametrize("layout", [(2, 1), (2, 2), (1, 1), (1, 8)])
def test_a_state_saved_at_dp4_resumes_at_dp2_and_dp1_on_the_next_rows(layout):
    make = lambda: RandomSampler(21, seed=3)   # noqa: E731
    reference = rank_steps(make, 4, 1, 8, 9)
    states = []
    for rank in range(4):
        gbs = GlobalBatchSampler(make(), dp_rank=rank, dp_size=4, micro_batch_size=1, global_batch_size=8)
        it = iter(gbs)
        for _ in range(4 * gbs.micro_batches):   # 4 steps; the 4th crosses the epoch end (21 rows)
            next(it)
        states.append(gbs.state_dict())
    assert states == [states[0]] * 4 and states[0]["global_batches"] == 4 and states[0]["micro_batch"] == 0
    dp, b = layout
    resumed = rank_steps(make, dp, b, 8, 5, state=states[0])
    assert [sorted(i for r in ranks for i in r) for ranks in resumed] == [
        sorted(i for r in ranks for i in r) for ranks in reference[4:]]


def test_a_state_inside_a_global_batch_resumes_on_the_same_layout():
    reference = rank_steps(lambda: RandomSampler(10, seed=1), 2, 1, 6, 4)
    gbs = GlobalBatchSampler(RandomSampler(10, seed=1), dp_rank=1, dp_size=2, micro_batch_size=1, global_batch_size=6)
    it = iter(gbs)
    got = [i for _ in range(5) for i in next(it)]      # one global batch and 2 of the 3 micro-batches of the next
    assert gbs.state_dict()["micro_batch"] == 2 and gbs.state_dict()["global_batches"] == 1
    again = GlobalBatchSampler(RandomSampler(10, seed=1), dp_rank=1, dp_size=2, micro_batch_size=1,
                               global_batch_size=6)
    again.load_state_dict(gbs.state_dict())
    it = iter(again)
    got += [i for _ in range(7) for i in next(it)]
    assert got == [i for ranks in reference for i in ranks[1]]


@pytest.mark.parametrize("cls", [RandomSampler, SequentialSampler])
@pytest.mark.parametrize("k", [1, 7, 10, 13, 20, 29])  # mid-epoch, epoch end, across epochs (epoch = 10)
def test_resume_continues_at_next_sample(cls, k):
    reference = take(cls(10, seed=5), 40)
    first = cls(10, seed=5)
    it = iter(first)
    assert [next(it) for _ in range(k)] == reference[:k]
    resumed = cls(10, seed=5)
    resumed.load_state_dict(first.state_dict())
    assert take(resumed, 40 - k) == reference[k:]


def test_state_at_epoch_end_gives_no_empty_epoch():
    s = RandomSampler(6, seed=1)
    it = iter(s)
    [next(it) for _ in range(6)]
    assert s.state_dict() == {"epoch": 0, "position": 6}
    resumed = RandomSampler(6, seed=1)
    resumed.load_state_dict(s.state_dict())
    nxt = take(resumed, 6)
    assert nxt == list(RandomSampler(6, seed=1).global_order(1)) and resumed.epoch == 1


def test_resume_twice_within_one_epoch():
    reference = take(RandomSampler(30, seed=2), 30)
    s1 = RandomSampler(30, seed=2)
    it = iter(s1)
    got = [next(it) for _ in range(4)]
    s2 = RandomSampler(30, seed=2)
    s2.load_state_dict(s1.state_dict())
    it = iter(s2)
    got += [next(it) for _ in range(9)]
    s3 = RandomSampler(30, seed=2)
    s3.load_state_dict(s2.state_dict())
    got += take(s3, 17)
    assert got == reference


def test_too_few_rows_and_a_sampler_without_order_are_refused():
    with pytest.raises(ValueError, match="^the dataset has 3 rows, fewer than dp_size"):
        RandomSampler(3, dp_size=4)

    class Empty:
        path = "e.jsonl.packed"

        def __len__(self):
            return 0

    with pytest.raises(ValueError, match="^the dataset e.jsonl.packed has 0 rows, fewer than dp_size=1"):
        RandomSampler(Empty())
    with pytest.raises(ValueError, match="^the eval dataset e.jsonl.packed has 0 rows, fewer than dp_size=1"):
        EvalShardSampler(Empty())
    with pytest.raises(ValueError, match="^the eval dataset has 1 row, fewer than dp_size=2: some rank would get "
                                         "none$"):
        EvalShardSampler(1, dp_size=2)
    with pytest.raises(TypeError, match="global_order"):
        EpochSampler(10)


def test_batch_sampler_groups_and_restores():
    bs = ResumableBatchSampler(SequentialSampler(5), micro_batch_size=2)
    it = iter(bs)
    assert [next(it) for _ in range(3)] == [[0, 1], [2, 3], [4, 0]]
    again = ResumableBatchSampler(SequentialSampler(5), micro_batch_size=2)
    again.load_state_dict(bs.state_dict())
    assert next(iter(again)) == [1, 2]


def test_batch_sampler_refuses_a_finite_sampler():
    with pytest.raises(RuntimeError, match="must be infinite"):
        take(ResumableBatchSampler(range(3), micro_batch_size=2), 3)


class YieldsAfterRowZero(EpochSampler):
    """A custom sampler of row 0, then ``after`` (a bad index), every epoch."""

    def __init__(self, data_source, after, **kwargs):
        super().__init__(data_source, **kwargs)
        self.after = after

    def global_order(self, epoch):
        return [0, self.after]


@pytest.mark.parametrize("after", [5, -1])
def test_an_index_outside_the_dataset_is_named_with_the_sampler(after):
    """Row 5 of 5 rows was an IndexError traceback from the dataset (in a loader worker's); -1 read the last row."""
    from packsft.data.loader import DataLoaderConfig, build_train_dataloader

    config = DataLoaderConfig(sampler="custom", sampler_class_path=f"{__name__}.YieldsAfterRowZero",
                              sampler_kwargs={"after": after})
    loader = iter(build_train_dataloader(list(range(5)), config, collate_fn=lambda rows: rows))
    assert next(loader) == [0]
    with pytest.raises(SamplerError) as err:
        next(loader)
    assert str(err.value) == (f"sampler {__name__}.YieldsAfterRowZero yielded {after!r}, not a row index of the "
                              "training data (0 to 4: 5 rows); a sampler must yield integers in "
                              "range(len(data_source))")


def test_eval_shard_sampler_splits_without_overlap():
    shards = [list(EvalShardSampler(11, dp_rank=r, dp_size=3)) for r in range(3)]
    assert shards == [[0, 3, 6], [1, 4, 7], [2, 5, 8]]
    assert EvalShardSampler(11, dp_size=3).num_skipped_rows == 2
