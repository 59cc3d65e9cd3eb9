"""Samplers alone: order, data-parallel split, exact resume (packsft/data/samplers.py)."""

from itertools import islice

import pytest

from packsft.data.samplers import (
    EpochSampler,
    EvalShardSampler,
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


@pytest.mark.parametrize("cls", [RandomSampler, SequentialSampler])
def test_dp_ranks_are_disjoint_and_equal_sized(cls):
    n, dp = 23, 4
    shares = [take(cls(n, dp_rank=r, dp_size=dp, seed=9), n // dp) for r in range(dp)]
    seen = [i for s in shares for i in s]
    assert len(seen) == len(set(seen)) == 20
    # every rank strides the same global order
    glob = list(cls(n, seed=9).global_order(0))[:20]
    assert all(shares[r] == glob[r::dp] for r in range(dp))


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
