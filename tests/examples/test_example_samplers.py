"""The example custom sampler: curriculum (examples/samplers/)."""

from itertools import islice

import pytest
import torch
from torch.utils.data import default_collate

from examples.samplers.curriculum import CurriculumSampler, read_difficulties, split_stages
from packsft.data.loader import (
    DataLoaderConfig,
    build_train_dataloader,
    load_loader_state_dict,
    loader_state_dict,
)
from packsft.data.samplers import GlobalBatchSampler

pytestmark = pytest.mark.filterwarnings("ignore:.set_vital. is deprecated:UserWarning")


class MaskDataset:
    """Row i has ``trained[i]`` ones in its loss_mask (length 8) and carries its index as ``row``."""

    def __init__(self, trained, fingerprint="mask-v1"):
        self.trained, self.fingerprint = list(trained), fingerprint

    def __len__(self):
        return len(self.trained)

    def __getitem__(self, i):
        mask = torch.zeros(8, dtype=torch.float32)
        mask[: self.trained[i]] = 1
        return {"row": torch.tensor(i), "loss_mask": mask}


def take(sampler, k):
    return list(islice(iter(sampler), k))


def assert_resumes_exactly(make, ks, total):
    reference = take(make(), total)
    for k in ks:
        first = make()
        it = iter(first)
        assert [next(it) for _ in range(k)] == reference[:k]
        resumed = make()
        resumed.load_state_dict(first.state_dict())
        assert take(resumed, total - k) == reference[k:], f"resume after {k} samples"


# ---------------------------------------------------------------- curriculum


def test_split_stages_docstring_example():
    stages = split_stages([5, 1, 3, 2, 4, 0], [1, 1, 1])
    assert [s.tolist() for s in stages] == [[5, 1], [3, 2], [4, 0]]
    with pytest.raises(ValueError, match="get no row"):
        split_stages([1, 2], [1, 1, 1])


def test_curriculum_goes_easy_medium_hard_random_within_stage():
    n = 12
    sampler = CurriculumSampler(n, seed=3, difficulties=[n - i for i in range(n)])  # row 11 is easiest
    two_epochs = take(sampler, 2 * n)
    for epoch in range(2):
        order = two_epochs[epoch * n : (epoch + 1) * n]
        assert [set(order[0:4]), set(order[4:8]), set(order[8:12])] == [{8, 9, 10, 11}, {4, 5, 6, 7}, {0, 1, 2, 3}]
    assert two_epochs[:n] != two_epochs[n:]  # a fresh shuffle within stages
    assert two_epochs[:4] != sorted(two_epochs[:4], reverse=True) or two_epochs[n : n + 4] != two_epochs[:4]


def test_curriculum_ranks_change_stage_together():
    shares = [[i for batch in take(GlobalBatchSampler(CurriculumSampler(12, r, 2, seed=1, difficulties=list(range(12))),
                                                      dp_rank=r, dp_size=2, micro_batch_size=1, global_batch_size=2), 6)
               for i in batch] for r in range(2)]
    for share in shares:
        assert [max(share[0:2]) < 4, min(share[2:4]) >= 4 and max(share[2:4]) < 8, min(share[4:]) >= 8] == [True] * 3
    assert not set(shares[0]) & set(shares[1])


def test_curriculum_epochs_then_plain_random():
    sampler = CurriculumSampler(30, seed=0, difficulties=list(range(30)), curriculum_epochs=1)
    orders = take(sampler, 60)
    assert set(orders[:10]) == set(range(10))
    assert set(orders[30:40]) != set(range(10)) and sorted(orders[30:]) == list(range(30))


def test_curriculum_resumes_exactly():
    def make():
        return CurriculumSampler(10, seed=4, difficulties=[i % 4 for i in range(10)], stage_fractions=[0.2, 0.5, 0.3])

    assert_resumes_exactly(make, ks=[1, 2, 6, 10, 13, 27], total=35)


def test_curriculum_difficulty_from_loss_mask_and_file(tmp_path):
    ds = MaskDataset([7, 1, 5, 0, 3, 8])
    assert [s.tolist() for s in CurriculumSampler(ds, seed=0).stages] == [[3, 1], [4, 2], [0, 5]]
    path = tmp_path / "difficulty.txt"
    path.write_text("3\n\n1\n2\n")
    assert read_difficulties(path) == [3.0, 1.0, 2.0]
    path.write_text("3\nhard\n")
    with pytest.raises(ValueError, match="difficulty.txt:2: difficulty 'hard'"):
        read_difficulties(path)
    with pytest.raises(ValueError, match="got 3 difficulties for 6 rows"):
        CurriculumSampler(ds, difficulties=[1, 2, 3])


def test_curriculum_through_the_loader_resumes():
    cfg = DataLoaderConfig(
        sampler="custom",
        sampler_class_path="examples.samplers.curriculum.CurriculumSampler",
        sampler_kwargs={"num_stages": 2},
        micro_batch_size=2,
        seed=5,
    )
    ds = MaskDataset([i % 7 for i in range(14)])

    def batches(loader, k):
        it = iter(loader)
        return [next(it)["row"].tolist() for _ in range(k)]

    reference = batches(build_train_dataloader(ds, cfg, collate_fn=default_collate), 12)
    first = build_train_dataloader(ds, cfg, collate_fn=default_collate)
    assert batches(first, 5) == reference[:5]
    resumed = build_train_dataloader(ds, cfg, collate_fn=default_collate)
    load_loader_state_dict(resumed, loader_state_dict(first))
    assert batches(resumed, 7) == reference[5:]


def test_curriculum_refuses_a_resume_with_other_stages(tmp_path):
    """The difficulty file edited between save and resume: the state was accepted and the resumed epoch repeated
    rows 0-3 and skipped 8-11 (the file's path, not its scores, was in the loader header)."""
    path = tmp_path / "difficulty.txt"
    path.write_text("\n".join(map(str, range(12))) + "\n")
    cfg = DataLoaderConfig(sampler="custom", sampler_class_path="examples.samplers.curriculum.CurriculumSampler",
                           sampler_kwargs={"difficulty_file": str(path)}, micro_batch_size=1, seed=5)
    ds = MaskDataset([1] * 12)
    first = build_train_dataloader(ds, cfg, collate_fn=default_collate)
    it = iter(first)
    [next(it) for _ in range(6)]
    state = loader_state_dict(first)
    same = build_train_dataloader(ds, cfg, collate_fn=default_collate)
    load_loader_state_dict(same, state)  # unchanged scores resume
    path.write_text("\n".join(map(str, range(12, 0, -1))) + "\n")
    edited = build_train_dataloader(ds, cfg, collate_fn=default_collate)
    with pytest.raises(ValueError, match="CurriculumSampler: the stages differ from the checkpoint's"):
        load_loader_state_dict(edited, state)
