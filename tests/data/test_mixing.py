"""packsft.data.mixing: the mixture dataset, weight normalisation and the weighted mixing sampler."""

import pickle
from collections import Counter

import pytest
from test_example_samplers import MaskDataset, assert_resumes_exactly, take
from torch.utils.data import default_collate

from packsft.data.loader import DataLoaderConfig, build_train_dataloader, load_loader_state_dict, loader_state_dict
from packsft.data.mixing import (
    MixedDataset,
    WeightedMixingSampler,
    mean_trained_tokens,
    normalize_weights,
    rows_per_source,
)
from packsft.data.samplers import GlobalBatchSampler

pytestmark = pytest.mark.filterwarnings("ignore:.set_vital. is deprecated:UserWarning")


def mixed(sizes=(300, 50, 150), tag="v1"):
    return MixedDataset({f"s{i}": MaskDataset([1] * n, fingerprint=f"{tag}-{i}") for i, n in enumerate(sizes)})


def test_mixed_dataset_maps_global_index_to_source_row():
    ds = mixed((3, 2, 4))
    assert len(ds) == 9 and ds.offsets == [0, 3, 5]
    assert [ds.locate(i) for i in (0, 2, 3, 4, 5, 8)] == [(0, 0), (0, 2), (1, 0), (1, 1), (2, 0), (2, 3)]
    assert int(ds[6]["row"]) == 1
    assert pickle.loads(pickle.dumps(ds)).fingerprint == ds.fingerprint  # spawned workers unpickle it
    assert mixed((3, 2, 4), tag="v2").fingerprint != ds.fingerprint
    assert mixed((3, 2, 5)).fingerprint != ds.fingerprint
    assert ds.names == ["s0", "s1", "s2"] and ds.source_fingerprints["s1"] == "v1-1:2"
    with pytest.raises(ValueError, match="training source 's1' .* has no rows"):
        MixedDataset({"s0": MaskDataset([1]), "s1": MaskDataset([])})


def test_extreme_weights_name_the_source_that_vanishes():
    """1e300 against 3: the error blamed the weight 3 as not positive ("got [0.0, 1.0]")."""
    with pytest.raises(ValueError, match=r"weights \[1e\+300, 3\]: source 'b' has a share under 1e-12"):
        normalize_weights([1e300, 3], ["a", "b"])
    with pytest.raises(ValueError, match=r"source 'a' \(a.jsonl.packed\) has a share under 1e-12"):
        normalize_weights([1e-300, 3], ["a", "b"], ["a.jsonl.packed", "b.jsonl.packed"])
    assert normalize_weights([1e308, 1e308]) == [0.5, 0.5]   # refused: their sum overflowed
    with pytest.raises(ValueError, match=r"weights must be positive finite numbers; got \[inf, 1\] \(source 0\)"):
        normalize_weights([float("inf"), 1])
    assert normalize_weights([3, 1]) == [0.75, 0.25]


def test_samples_per_epoch_defaults_to_all_rows():
    assert WeightedMixingSampler(mixed(), weights=[1, 1, 1]).samples_per_epoch == 500


def test_rows_per_source_normalises_and_refuses_zero_rows():
    assert rows_per_source([2, 1], 10) == [7, 3]
    assert rows_per_source([0.5, 0.25, 0.25], 7) == [3, 2, 2]  # remainders .5 < .75 = .75
    with pytest.raises(ValueError, match=r"source 1 \(weight \[0.000999000999\] after normalising\) gets 0 of 100"):
        rows_per_source([1.0, 0.001], 100)
    with pytest.raises(ValueError, match=r"training source 'math' \(m.jsonl.packed\) .* gets 0 of 100"):
        rows_per_source([1.0, 0.001], 100, names=["chat", "math"], files=["c.jsonl.packed", "m.jsonl.packed"])
    with pytest.raises(ValueError, match="positive"):
        rows_per_source([1.0, 0.0], 100)
    with pytest.raises(ValueError, match="training source 's1' .* gets 0 of"):
        WeightedMixingSampler(mixed(), weights=[1.0, 1e-4, 1.0])


@pytest.mark.parametrize("dp_size", [1, 2])
def test_mixing_meets_weights_per_epoch_with_fresh_plans(dp_size):
    ds, weights, per_epoch = mixed(), [0.5, 0.3, 0.2], 1000
    samplers = [  # each rank's share of the global batches (dp_size rows each) of the one global order
        GlobalBatchSampler(WeightedMixingSampler(ds, r, dp_size, seed=11, weights=weights, samples_per_epoch=per_epoch),
                           dp_rank=r, dp_size=dp_size, micro_batch_size=1, global_batch_size=dp_size)
        for r in range(dp_size)
    ]
    shares = [[i for batch in take(s, 3 * per_epoch // dp_size) for i in batch] for s in samplers]
    epochs = []
    for e in range(3):
        lo, hi = e * per_epoch // dp_size, (e + 1) * per_epoch // dp_size
        epoch = [i for share in shares for i in share[lo:hi]]
        sources = Counter(ds.locate(i)[0] for i in epoch)
        for s, w in enumerate(weights):
            assert abs(sources[s] / len(epoch) - w) <= 0.03, (e, s, sources)
        epochs.append(epoch)
    assert Counter(epochs[0])[ds.offsets[1]] == 6  # 50 rows drawn 300 times: six whole passes
    # a fresh plan: which 200 rows of source 0 come twice is redrawn every epoch
    assert Counter(epochs[0]) != Counter(epochs[1])


def test_mixing_weights_are_normalised():
    a = WeightedMixingSampler(mixed(), seed=2, weights=[2, 1, 1])
    b = WeightedMixingSampler(mixed(), seed=2, weights=[0.5, 0.25, 0.25])
    assert a.counts == b.counts == [250, 125, 125] and take(a, 600) == take(b, 600)
    assert normalize_weights([7, 3]) == normalize_weights([0.7, 0.3]) == [0.7, 0.3]
    assert normalize_weights([1, 2]) == normalize_weights([1 / 3, 2 / 3])


def test_mixing_resumes_exactly():
    def make():
        return WeightedMixingSampler(mixed((7, 3, 5)), 1, 2, seed=8, weights=[1, 2, 1], samples_per_epoch=20)

    assert_resumes_exactly(make, ks=[1, 4, 10, 11, 23, 30], total=40)


def test_mixing_through_the_loader_resumes_and_refuses_changed_sources():
    cfg = DataLoaderConfig(
        sampler="custom",
        sampler_class_path="packsft.data.mixing:WeightedMixingSampler",
        sampler_kwargs={"weights": [3, 1], "samples_per_epoch": 16},
        micro_batch_size=4,
    )

    def batches(loader, k):
        it = iter(loader)
        return [next(it)["row"].tolist() for _ in range(k)]

    ds = mixed((10, 6))
    reference = batches(build_train_dataloader(ds, cfg, collate_fn=default_collate), 9)
    first = build_train_dataloader(ds, cfg, collate_fn=default_collate)
    batches(first, 4)  # exactly one epoch of 16 samples
    state = loader_state_dict(first)
    resumed = build_train_dataloader(ds, cfg, collate_fn=default_collate)
    load_loader_state_dict(resumed, state)
    assert batches(resumed, 5) == reference[4:]
    with pytest.raises(ValueError, match="training source 's0' changed"):
        load_loader_state_dict(build_train_dataloader(mixed((10, 6), tag="v2"), cfg, collate_fn=default_collate), state)
    other = DataLoaderConfig(**{**vars(cfg), "sampler_kwargs": {"weights": [1, 1], "samples_per_epoch": 16}})
    with pytest.raises(ValueError, match=r"sampler_kwargs.weights: checkpoint \[3, 1\], now \[1, 1\]") as err:
        load_loader_state_dict(build_train_dataloader(ds, other, collate_fn=default_collate), state)
    assert "sampler_kwargs_digest" not in str(err.value) and "samples_per_epoch" not in str(err.value)
    floats = {**state, "sampler_kwargs": {"weights": [3.0, 1.0], "samples_per_epoch": 16},
              "sampler_kwargs_digest": "another"}  # 3 == 3.0 in Python, not in JSON nor the digest: refused
    with pytest.raises(ValueError, match=r"sampler_kwargs.weights: checkpoint \[3.0, 1.0\], now \[3, 1\]"):
        load_loader_state_dict(build_train_dataloader(ds, cfg, collate_fn=default_collate), floats)
    with pytest.raises(ValueError, match="sampler_kwargs_digest: checkpoint 'another'"):  # no key differs: the digest
        load_loader_state_dict(build_train_dataloader(ds, cfg, collate_fn=default_collate),
                               {**state, "sampler_kwargs_digest": "another"})
    old = {k: v for k, v in state.items() if k != "sampler_kwargs"}  # a state of an earlier packsft: the digest
    with pytest.raises(ValueError, match="sampler_kwargs_digest: checkpoint"):
        load_loader_state_dict(build_train_dataloader(ds, other, collate_fn=default_collate), old)
    # the sources listed in another order, each weight with its source: the order named (only the weights were)
    swapped = MixedDataset({"s1": MaskDataset([1] * 6, fingerprint="v1-1"), "s0": MaskDataset([1] * 10,
                                                                                          fingerprint="v1-0")})
    turned = DataLoaderConfig(**{**vars(cfg), "sampler_kwargs": {"weights": [1, 3], "samples_per_epoch": 16}})
    with pytest.raises(ValueError, match=r"training sources are in another order: checkpoint \['s0', 's1'\], now "
                                         r"\['s1', 's0'\]"):
        load_loader_state_dict(build_train_dataloader(swapped, turned, collate_fn=default_collate), state)
    # a mixture resumed with one of its sources alone (read as one file): said so, not "'s0' is gone"
    single = build_train_dataloader(MaskDataset([1] * 10, fingerprint="v1-0"), DataLoaderConfig(micro_batch_size=4),
                                    collate_fn=default_collate)
    with pytest.raises(ValueError, match=r"training sources: checkpoint \['s0', 's1'\], now one file") as err:
        load_loader_state_dict(single, state)
    assert "is gone" not in str(err.value)


@pytest.fixture(scope="module")
def two_packed_sources(tmp_path_factory, shared_data, tokenizer_dir):
    """Chit-chat and math answers, 160 conversations each, packed for smollm2 (L 1024) by the
    packer in-process: a mixture of two real sources of different mean trained tokens per row (math packs several
    answers a row; some chats are longer than a row, kept cut in their own)."""
    from packsft.data.dataset import PackedSFTDataset
    from packsft.packing.config import PackConfig
    from packsft.packing.pipeline import run_pack
    from packsft.tokenizer import load_tokenizer

    folder, tok_dir = tmp_path_factory.mktemp("mixture_unit"), tokenizer_dir("smollm2-135m-instruct")
    tok, sources = load_tokenizer(tok_dir), {}
    for name, file in (("chat", "chitchat"), ("math", "gsm8k_test")):
        lines = (shared_data / "chat" / f"{file}.messages.jsonl").read_text(encoding="utf-8").splitlines(True)[:160]
        (src := folder / f"{name}.jsonl").write_text("".join(lines), encoding="utf-8")
        out = folder / f"{name}.jsonl.packed"
        run_pack(PackConfig(inputs=[str(src)], output=str(out), tokenizer=str(tok_dir), max_seq_len=1024,
                            prompt_format="chat-template", histogram="", progress=False))
        sources[name] = PackedSFTDataset(out, tok, "chat-template", 1024, require_sidecar=True)
    return MixedDataset(sources)


def trained_shares(ds, order):
    """Each source's share of the trained tokens of the rows ``order`` (global indices), from the loader's rows."""
    per_row = [[d[i]["num_trained_tokens"] for i in range(len(d))] for d in ds.datasets]
    totals = [0, 0]
    for i in order:
        s, row = ds.locate(int(i))
        totals[s] += per_row[s][row]
    return [t / sum(totals) for t in totals]


@pytest.mark.filterwarnings("ignore::packsft.data.dataset.PackedDataWarning")  # the cut chats, reported
def test_mixture_unit_trained_tokens_meets_the_weights_in_trained_tokens(two_packed_sources):
    ds = two_packed_sources
    means = [mean_trained_tokens(d, n) for n, d in zip(ds.names, ds.datasets)]
    for d, mean in zip(ds.datasets, means):  # the token cache's count is the loader's, row by row
        loader_counts = [d[i]["num_trained_tokens"] for i in range(len(d))]
        assert d.token_cache.trained_tokens_per_row(d.prompt_format.pad_token_id).tolist() == loader_counts
        assert mean == pytest.approx(sum(loader_counts) / len(d))
    assert means[1] > 1.3 * means[0], means
    from packsft.data.dataset import PackedSFTDataset

    chat = ds.datasets[0]
    plain = PackedSFTDataset(chat.path, chat.tokenizer, "chat-template", 1024, use_token_cache=False)
    with pytest.raises(ValueError, match=r"training source 'chat' \(.*chat.jsonl.packed\) has no token cache .*"
                                         r"use_token_cache=False"):
        mean_trained_tokens(plain, "chat")   # never re-tokenized for a mean
    by_rows = WeightedMixingSampler(ds, seed=5, weights=[1, 1])
    by_tokens = WeightedMixingSampler(ds, seed=5, weights=[1, 1], trained_tokens_per_row=means)
    for epoch in range(2):
        rows_shares = trained_shares(ds, by_rows.global_order(epoch))
        token_shares = trained_shares(ds, by_tokens.global_order(epoch))
        assert all(abs(s - 0.5) <= 0.01 for s in token_shares), token_shares
        assert all(abs(s - 0.5) > 0.01 for s in rows_shares), rows_shares
    assert by_tokens.counts[0] > by_tokens.counts[1] and sum(by_tokens.counts) == len(ds)


def test_mixture_unit_trained_tokens_resumes_exactly_in_the_middle_of_an_epoch(two_packed_sources):
    ds = two_packed_sources
    means = [mean_trained_tokens(d, n) for n, d in zip(ds.names, ds.datasets)]
    cfg = DataLoaderConfig(sampler="custom", sampler_class_path="packsft.data.mixing:WeightedMixingSampler",
                           sampler_kwargs={"weights": [0.5, 0.5], "samples_per_epoch": None,
                                           "trained_tokens_per_row": means}, micro_batch_size=2)

    def rows(rows_):
        return [r["tokens"].tolist() for r in rows_]

    def batches(loader, k):
        it = iter(loader)
        return [next(it) for _ in range(k)]

    reference = batches(build_train_dataloader(ds, cfg, global_batch_size=4, collate_fn=rows), 8)
    first = build_train_dataloader(ds, cfg, global_batch_size=4, collate_fn=rows)
    batches(first, 4)
    state = loader_state_dict(first)
    resumed = build_train_dataloader(ds, cfg, global_batch_size=4, collate_fn=rows)
    load_loader_state_dict(resumed, state)
    assert batches(resumed, 4) == reference[4:]
    ranks = []  # at DP 2 the two ranks share out the same global batches (the order does not depend on DP)
    for rank in range(2):
        resumed = build_train_dataloader(ds, cfg, dp_rank=rank, dp_size=2, global_batch_size=4, collate_fn=rows)
        load_loader_state_dict(resumed, state)
        ranks.append(batches(resumed, 2))
    for g in range(2):
        assert sorted(ranks[0][g] + ranks[1][g]) == sorted(reference[4 + 2 * g] + reference[5 + 2 * g])
    with pytest.raises(ValueError, match="sampler_kwargs.trained_tokens_per_row"):
        load_loader_state_dict(build_train_dataloader(ds, DataLoaderConfig(**{**vars(cfg), "sampler_kwargs": {
            "weights": [0.5, 0.5], "samples_per_epoch": None}}), global_batch_size=4, collate_fn=rows), state)
