"""StatefulDataLoader builders, config validation and num_workers-independent resume (packsft/data/loader.py)."""

import json

import pytest
import torch
from torch.utils.data import default_collate

from packsft.data.loader import (
    DataLoaderConfig,
    build_eval_dataloader,
    build_train_dataloader,
    load_loader_state_dict,
    loader_state_dict,
)
from packsft.data.samplers import EpochSampler

pytestmark = pytest.mark.filterwarnings("ignore:.set_vital. is deprecated:UserWarning")


class RowDataset:
    """Row i is {"row": i, "tokens": [i, i, i]}; module level so spawned workers can unpickle it."""

    def __init__(self, num_rows, fingerprint="toy-v1"):
        self.num_rows, self.fingerprint = num_rows, fingerprint

    def __len__(self):
        return self.num_rows

    def __getitem__(self, i):
        return {"row": torch.tensor(i), "tokens": torch.full((3,), i, dtype=torch.int64)}


class ReversedSampler(EpochSampler):
    """A custom sampler with extra state: rows backwards, and a counter of epochs started."""

    def __init__(self, data_source, dp_rank=0, dp_size=1, seed=0, *, tag="x"):
        super().__init__(data_source, dp_rank, dp_size, seed)
        self.tag = tag

    def global_order(self, epoch):
        return range(self.num_rows - 1, -1, -1)

    def state_dict(self):
        return {**super().state_dict(), "tag": self.tag}

    def load_state_dict(self, state):
        super().load_state_dict(state)
        self.tag = state["tag"]


def rows(batch):
    return batch["row"].tolist()


def run(loader, k):
    it = iter(loader)
    return [rows(next(it)) for _ in range(k)]


def loader(n=10, fingerprint="toy-v1", dp_rank=0, dp_size=1, global_batch_size=None, **cfg):
    cfg = {"seed": 7, "micro_batch_size": 2, **cfg}
    return build_train_dataloader(
        RowDataset(n, fingerprint),
        DataLoaderConfig(**cfg),
        dp_rank=dp_rank,
        dp_size=dp_size,
        global_batch_size=global_batch_size,
        collate_fn=default_collate,
    )


def test_config_errors_name_field_and_value():
    with pytest.raises(ValueError,
                       match=r"loader.sampler must be one of \('random', 'sequential', 'custom'\), got 'shuffle'"):
        DataLoaderConfig(sampler="shuffle")
    with pytest.raises(ValueError, match="loader.sampler custom needs loader.sampler_class_path"):
        DataLoaderConfig(sampler="custom")
    with pytest.raises(ValueError, match="'no_such_pkg.mod.Sampler' does not resolve"):
        DataLoaderConfig(sampler="custom", sampler_class_path="no_such_pkg.mod.Sampler")
    with pytest.raises(ValueError, match=r"lacks \['__iter__', 'state_dict', 'load_state_dict'\]"):
        DataLoaderConfig(sampler="custom", sampler_class_path="fractions.Fraction")
    with pytest.raises(ValueError, match="lacks \\['state_dict'"):
        DataLoaderConfig(sampler="custom", sampler_class_path="collections.OrderedDict")
    with pytest.raises(ValueError, match="not a class"):
        DataLoaderConfig(sampler="custom", sampler_class_path="json.dumps")
    with pytest.raises(ValueError, match="only used with sampler='custom'"):
        DataLoaderConfig(sampler="random", sampler_class_path=f"{__name__}.ReversedSampler")
    with pytest.raises(ValueError, match="sampler_kwargs=.*do not fit"):
        DataLoaderConfig(sampler="custom", sampler_class_path=f"{__name__}.ReversedSampler", sampler_kwargs={"tga": 1})
    with pytest.raises(ValueError, match="micro_batch_size"):
        DataLoaderConfig(micro_batch_size=0)


def test_config_from_omegaconf_resolves_custom_sampler():
    from omegaconf import OmegaConf

    cfg = OmegaConf.merge(
        OmegaConf.structured(DataLoaderConfig),
        {"sampler": "custom", "sampler_class_path": f"{__name__}:ReversedSampler", "sampler_kwargs": {"tag": "b"}},
    )
    obj = OmegaConf.to_object(cfg)
    assert obj.sampler_class() is ReversedSampler and obj.sampler_kwargs == {"tag": "b"}


def test_same_seed_same_batches_and_sequential_order():
    assert run(loader(seed=1), 8) == run(loader(seed=1), 8)
    assert run(loader(seed=1), 5) != run(loader(seed=2), 5)
    assert run(loader(sampler="sequential"), 6) == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9], [0, 1]]


def test_dp_ranks_get_disjoint_rows():
    per_rank = [sum(run(loader(n=13, dp_rank=r, dp_size=3, micro_batch_size=1), 4), []) for r in range(3)]
    flat = [i for share in per_rank for i in share]
    assert len(set(flat)) == 12 and all(len(share) == 4 for share in per_rank)


@pytest.mark.parametrize("k", [2, 5, 7, 12])  # epoch = 5 batches: mid, at the end, inside epoch 1, epoch 2
@pytest.mark.parametrize("sampler", ["random", "sequential"])
def test_resume_continues_at_next_batch(k, sampler):
    reference = run(loader(sampler=sampler), 16)
    first = loader(sampler=sampler)
    it = iter(first)
    assert [rows(next(it)) for _ in range(k)] == reference[:k]
    state = json.loads(json.dumps(loader_state_dict(first)))  # plain values only
    resumed = loader(sampler=sampler)
    load_loader_state_dict(resumed, state)
    assert run(resumed, 16 - k) == reference[k:]


def test_resume_twice_within_one_epoch_and_state_before_iterating():
    reference = run(loader(n=20), 10)
    a = loader(n=20)
    it = iter(a)
    got = [rows(next(it)) for _ in range(2)]
    b = loader(n=20)
    load_loader_state_dict(b, loader_state_dict(a))
    assert loader_state_dict(b) == loader_state_dict(a)  # not iterated yet: the loaded state
    it = iter(b)
    got += [rows(next(it)) for _ in range(3)]
    c = loader(n=20)
    load_loader_state_dict(c, loader_state_dict(b))
    assert got + run(c, 5) == reference


def test_custom_sampler_state_is_in_the_checkpoint():
    cfg = {"sampler": "custom", "sampler_class_path": f"{__name__}.ReversedSampler", "sampler_kwargs": {"tag": "q"}}
    first = loader(n=6, **cfg)
    it = iter(first)
    assert [rows(next(it)) for _ in range(2)] == [[5, 4], [3, 2]]
    state = loader_state_dict(first)
    assert state["sampler"] == f"{__name__}.ReversedSampler"
    assert state["sampler_state"] == {"sampler": {"epoch": 0, "position": 4, "tag": "q"}, "global_batches": 2,
                                      "micro_batch": 0}
    resumed = loader(n=6, **cfg)
    load_loader_state_dict(resumed, state)
    assert run(resumed, 2) == [[1, 0], [5, 4]]


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"fingerprint": "toy-v2"}, "dataset_fingerprint: checkpoint 'toy-v1', now 'toy-v2'"),
        ({"n": 11}, "num_rows: checkpoint 10, now 11"),
        ({"seed": 8}, "seed: checkpoint 7, now 8"),
        ({"sampler": "sequential"}, "sampler: checkpoint"),
    ],
)
def test_non_portable_changes_are_refused(change, message):
    first = loader()
    run(first, 3)
    with pytest.raises(ValueError, match=message):
        load_loader_state_dict(loader(**change), loader_state_dict(first))


def layout_rows(steps, dp_size, micro_batch_size, global_batch_size, state=None, **cfg):
    """Per step: the sorted rows of all ranks' loaders (one per rank, in process), and each rank's last state."""
    per_step, states = [[] for _ in range(steps)], []
    for rank in range(dp_size):
        one = build_train_dataloader(RowDataset(10), DataLoaderConfig(seed=7, micro_batch_size=micro_batch_size, **cfg),
                                     dp_rank=rank, dp_size=dp_size, global_batch_size=global_batch_size,
                                     collate_fn=default_collate)
        if state is not None:
            load_loader_state_dict(one, state)
        it = iter(one)
        for step in range(steps):
            for _ in range(global_batch_size // (dp_size * micro_batch_size)):
                per_step[step] += rows(next(it))
        states.append(loader_state_dict(one))
    return [sorted(r) for r in per_step], states


def test_a_loader_state_saved_at_dp4_resumes_at_dp2_and_dp1_on_the_next_global_batches():
    reference, _ = layout_rows(7, 4, 1, 8)
    _, states = layout_rows(3, 4, 1, 8)           # the epoch of 10 rows ends inside step 2
    assert {json.dumps(s["sampler_state"]) for s in states} == {json.dumps(states[0]["sampler_state"])}
    for dp, b in [(2, 2), (2, 1), (1, 4)]:
        resumed, _ = layout_rows(4, dp, b, 8, state=json.loads(json.dumps(states[1])))   # any rank's state
        assert resumed == reference[3:], (dp, b)


def test_a_state_inside_a_global_batch_is_refused_on_another_layout():
    first = loader(dp_size=1, micro_batch_size=1, global_batch_size=4)
    run(first, 3)                                 # 3 of the first global batch's 4 micro-batches
    state = loader_state_dict(first)
    assert state["sampler_state"]["micro_batch"] == 3
    with pytest.raises(ValueError, match=r"dp_rank: checkpoint 0, now 1; dp_size: checkpoint 1, now 2 \(the state is "
                                         r"inside a global batch, 3 micro-batch\(es\) of it trained on this rank"):
        load_loader_state_dict(loader(dp_rank=1, dp_size=2, micro_batch_size=1, global_batch_size=4), state)
    load_loader_state_dict(loader(dp_size=1, micro_batch_size=1, global_batch_size=4), state)  # same layout: fine


def test_a_per_rank_custom_sampler_resumes_only_on_its_layout():
    from test_balance import PerRankSampler

    cfg = {"sampler": "custom", "sampler_class_path": "test_balance.PerRankSampler", "micro_batch_size": 1}
    first = loader(**cfg)
    assert isinstance(first.batch_sampler.sampler, PerRankSampler) and run(first, 2) == [[0], [1]]
    with pytest.raises(ValueError, match="dp_size: checkpoint 1, now 2"):
        load_loader_state_dict(loader(dp_size=2, **cfg), loader_state_dict(first))


def version_1(state, position):
    """``state`` as packsft wrote it before global batches: version 1, each rank's position in its share."""
    old = {k: v for k, v in state.items() if k not in ("order", "global_batch_size", "balance")}
    return {**old, "version": 1, "sampler_state": {"sampler": {"epoch": 0, "position": position}}}


def test_a_version_1_state_resumes_at_its_dp_size_and_is_refused_at_another():
    reference, _ = layout_rows(4, 2, 1, 4)        # 10 rows: steps 0-1 in epoch 0, step 2 crosses into epoch 1
    _, states = layout_rows(1, 2, 1, 4)
    old = version_1(states[0], 2)                 # each rank had 2 rows of its share: step 0 done
    resumed, _ = layout_rows(1, 2, 1, 4, state=old)
    assert resumed == reference[1:2]
    with pytest.raises(ValueError, match="loader state version 1: each rank's own position.*only at its dp_size 2, "
                                         "now 1"):
        load_loader_state_dict(loader(micro_batch_size=1, global_batch_size=4), old)
    ended = version_1(states[0], 5)               # the share of epoch 0 (5 rows each) used up: epoch 1 next
    one = build_train_dataloader(RowDataset(10), DataLoaderConfig(seed=7, micro_batch_size=1), dp_size=2,
                                 global_batch_size=4, collate_fn=default_collate)
    load_loader_state_dict(one, ended)
    assert loader_state_dict(one)["sampler_state"]["sampler"] == {"epoch": 1, "position": 0}


def test_eval_loader_covers_each_rank_share_once():
    cfg = DataLoaderConfig(micro_batch_size=2)
    shares = [
        [
            i
            for b in build_eval_dataloader(RowDataset(9), cfg, dp_rank=r, dp_size=2, collate_fn=default_collate)
            for i in rows(b)
        ]
        for r in range(2)
    ]
    assert shares == [[0, 2, 4, 6], [1, 3, 5, 7]]


@pytest.mark.slow
def test_num_workers_two_matches_zero_and_state_moves_between_them():
    reference = run(loader(n=12, num_workers=0), 14)  # epoch = 6 batches
    two = loader(n=12, num_workers=2, persistent_workers=True)
    it = iter(two)
    got = [rows(next(it)) for _ in range(6)]  # ends exactly at the epoch end, with prefetch in flight
    assert got == reference[:6]
    state = loader_state_dict(two)
    assert state["sampler_state"]["sampler"] == {"epoch": 0, "position": 12}
    zero = loader(n=12, num_workers=0)
    load_loader_state_dict(zero, state)
    it = iter(zero)
    got += [rows(next(it)) for _ in range(3)]
    back = loader(n=12, num_workers=2)
    load_loader_state_dict(back, loader_state_dict(zero))
    got += run(back, 5)
    assert got == reference
