"""Training on a weighted mixture of packed files with named validation sets (data.train / data.validation)."""

import json
import shutil
from collections import Counter

import pytest
from distributed_helpers import parallel_state_1proc  # noqa: F401 - fixture
from test_loop import packed, train_forked, train_records, write_config  # noqa: F401 - fixture

from packsft.train.config import load_config


def mixture_config(tmp_path, packed, out, weights=(3, 1), **sections):  # noqa: F811
    data = {"train_path": None, "split_validation_size": 0.0,
            "train": [{"name": "few", "path": str(packed["few"]), "weight": weights[0]},
                      {"name": "many", "path": str(packed["many"]), "weight": weights[1],
                       "split_validation_size": 0.25}],
            "validation": [{"name": "heldout", "path": str(packed["few"])}]}
    return write_config(tmp_path / f"{out}.yaml", packed, tmp_path / out, data=data, **sections)


def test_mixture_draws_by_weight_and_validates_each_set(tmp_path, packed, parallel_state_1proc):  # noqa: F811
    from packsft.train.loop import Trainer

    cfg = load_config(mixture_config(tmp_path, packed, "o", checkpoint={"resume": "none"}))
    trainer = Trainer(cfg)
    mixed = trainer.train_set
    assert mixed.names == ["few", "many"] and set(trainer.val_sets) == {"many", "heldout"}
    sampler = trainer.train_loader.batch_sampler.sampler
    order = [i for _, i in zip(range(len(mixed)), iter(sampler))]
    shares = Counter(mixed.locate(i)[0] for i in order)
    assert abs(shares[0] / len(order) - 0.75) <= 0.1, shares
    efficiency = [d.sidecar["counts"] for d in mixed.datasets]   # the summary's: both files' rows together
    assert trainer.summary()["packing_efficiency"] == pytest.approx(
        sum(c["real_tokens"] for c in efficiency) / sum(c["real_tokens"] + c["padding_tokens"] for c in efficiency))
    result = trainer.validate()
    assert {"val_loss", "val_loss/many", "val_loss/heldout", "val_trained_tokens/many"} <= result.keys()
    total = result["val_trained_tokens/many"] + result["val_trained_tokens/heldout"]
    assert result["val_trained_tokens"] == total
    weighted = (result["val_loss/many"] * result["val_trained_tokens/many"]
                + result["val_loss/heldout"] * result["val_trained_tokens/heldout"]) / total
    assert abs(result["val_loss"] - weighted) < 1e-6


def test_weights_7_3_and_07_03_are_the_same_plan(tmp_path, packed, parallel_state_1proc):  # noqa: F811
    from packsft.train.loop import Trainer

    plans = []
    for k, weights in enumerate(((7, 3), (0.7, 0.3))):
        trainer = Trainer(load_config(mixture_config(tmp_path, packed, f"w{k}", weights=weights,
                                                     checkpoint={"resume": "none"})))
        sampler = trainer.train_loader.batch_sampler
        plans.append(([i for _, i in zip(range(30), iter(sampler.sampler))], sampler.header))
    assert plans[0] == plans[1]


def test_mixture_unit_trained_tokens_gives_the_sampler_each_sources_mean(tmp_path, packed,  # noqa: F811
                                                                           parallel_state_1proc):  # noqa: F811
    from packsft.train.loop import Trainer

    path = mixture_config(tmp_path, packed, "unit", checkpoint={"resume": "none"})
    rows = Trainer(load_config(path)).train_loader.batch_sampler
    assert rows.header["sampler_kwargs"] == {"weights": [0.75, 0.25], "samples_per_epoch": None}   # as before
    trainer = Trainer(load_config(path, ["data.mixture_unit=trained_tokens"]))
    means = trainer.train_loader.batch_sampler.header["sampler_kwargs"]["trained_tokens_per_row"]
    mixed = trainer.train_set   # "many" holds a quarter of its rows out: the mean is over its training rows
    assert means == pytest.approx([sum(d[i]["num_trained_tokens"] for i in range(len(d))) / len(d)
                                   for d in mixed.datasets])
    assert trainer.train_loader.batch_sampler.sampler.counts != rows.sampler.counts


def test_config_errors_name_the_source(tmp_path, packed):  # noqa: F811
    path = mixture_config(tmp_path, packed, "dup")
    with pytest.raises(ValueError, match=r"names must be unique, \['few'\]"):
        load_config(path, ["data.train=[{name: few, path: a}, {name: few, path: b}]"])
    for validation in ("[{name: x, path: a}, {name: x, path: b}]",
                       "[{path: d1/v.jsonl.packed}, {path: d2/v.jsonl.packed}]"):  # two files of one name
        with pytest.raises(ValueError, match=r"data.validation: names must be unique"):   # one was dropped unseen
            load_config(path, [f"data.validation={validation}"])
    with pytest.raises(ValueError, match=r"data.train\[1\].weight must be > 0"):
        load_config(path, ["data.train=[{path: a}, {path: b, weight: 0}]"])
    for item in ("data.train.1.weight=2", "data.train[1].weight=2"):  # a TypeError traceback before
        with pytest.raises(ValueError, match=r"Cannot merge .*an override cannot set one item of a list"):
            load_config(path, [item])


def test_a_missing_or_refused_file_is_named_by_its_source(tmp_path, packed):  # noqa: F811
    from packsft.sidecar import SidecarError
    from packsft.train.data import build_datasets

    missing = [{"name": "few", "path": str(packed["few"])}, {"name": "gone", "path": str(tmp_path / "no.packed")}]
    cfg = load_config(mixture_config(tmp_path, packed, "missing"), [f"data.train={json.dumps(missing)}"])
    with pytest.raises(FileNotFoundError, match=r"^data.train\[1\] \('gone'\): packed file not found: "):
        build_datasets(cfg)
    cfg = load_config(mixture_config(tmp_path, packed, "cp"), ["parallel.context_parallel_size=2"])
    with pytest.raises(SidecarError, match=r"^data.train\[0\] \('few'\): .* was packed for another configuration"):
        build_datasets(cfg)


def test_one_file_read_twice_is_refused_where_held_out_rows_would_be_trained(tmp_path, packed):  # noqa: F811
    """Two sources of one file where one holds rows out: the other trained on them (nothing refused it). A
    validation file that a source trains on is a warning; the same file twice without a split is upsampling."""
    from packsft.train.data import build_datasets

    link = tmp_path / "few_again.jsonl.packed"  # the same file under another name
    link.symlink_to(packed["few"])
    shutil.copy(str(packed["few"]) + ".meta.json", str(link) + ".meta.json")
    split = [{"name": "a", "path": str(packed["few"]), "split_validation_size": 0.3},
             {"name": "b", "path": str(link)}]
    for sources in (split, split[::-1]):
        cfg = load_config(mixture_config(tmp_path, packed, "leak"), [f"data.train={json.dumps(sources)}"])
        with pytest.raises(ValueError, match="sources '.' and '.' read the same file .* the other would train on"):
            build_datasets(cfg)
    greedy = [{"name": "a", "path": str(packed["few"])},
              {"name": "b", "path": str(packed["many"]), "split_validation_size": 0.999}]
    cfg = load_config(mixture_config(tmp_path, packed, "greedy"), [f"data.train={json.dumps(greedy)}"])
    with pytest.raises(ValueError, match=rf"^data.train\[1\].split_validation_size=0.999 of the \d+ rows of "
                                         rf"{packed['many']} leaves"):   # it named data.split_validation_size
        build_datasets(cfg)
    warned = []
    twice = [{"name": "a", "path": str(packed["few"])}, {"name": "b", "path": str(link)}]
    cfg = load_config(mixture_config(tmp_path, packed, "twice"), [f"data.train={json.dumps(twice)}"])
    mixed, validation = build_datasets(cfg, warn=warned.append)  # validation: "heldout" is packed["few"] too
    assert len(mixed) == 2 * len(validation["heldout"])
    assert warned == [f"warning: data.validation 'heldout' is the file {packed['few']}, which the training source "
                      "'a' trains on: its loss is measured on trained rows (to hold rows out, give the source a "
                      "split_validation_size)"]


@pytest.mark.slow
def test_mixture_trains_logs_every_set_and_refuses_a_changed_source_by_name(tmp_path, packed):  # noqa: F811
    config = mixture_config(tmp_path, packed, "run", train={"global_batch_size": 2, "train_steps": 4},
                            validation={"val_period": 2}, checkpoint={"save_interval": 2})
    train_forked(config, "train.stop_at_step=2")
    vals = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    vals = [r for r in vals if r["kind"] == "validation"]
    assert vals and {"val_loss/many", "val_loss/heldout"} <= vals[0].keys()
    records = train_records(tmp_path / "run")
    assert sorted(records) == [1, 2]
    # each source's trained tokens, counted from the rows' sources, add up to the loss's own count
    last = records[2]
    assert last["total_trained_tokens/few"] + last["total_trained_tokens/many"] == sum(r["trained_tokens"] for r in
                                                                            records.values())
    assert last["trained_token_share/few"] + last["trained_token_share/many"] == pytest.approx(1)
    # the 'many' source changes on disk: resuming the data order is refused, naming it
    shutil.copy(packed["few"], tmp_path / "changed.jsonl.packed")
    shutil.copy(str(packed["few"]) + ".meta.json", tmp_path / "changed.jsonl.packed.meta.json")
    proc = train_forked(config, f"data.train=[{{name: few, path: {packed['few']}, weight: 3}}, "
                                f"{{name: many, path: {tmp_path / 'changed.jsonl.packed'}, weight: 1, "
                                "split_validation_size: 0.25}]", check=False)
    assert proc.returncode != 0 and "training source 'many' changed" in proc.stderr, proc.stderr[-3000:]


def test_a_held_out_split_on_the_first_source(tmp_path, packed, parallel_state_1proc):  # noqa: F811
    from packsft.train.loop import Trainer

    data = {"train_path": None, "split_validation_size": 0.0,
            "train": [{"name": "many", "path": str(packed["many"]), "weight": 1, "split_validation_size": 0.25},
                      {"name": "few", "path": str(packed["few"]), "weight": 1}]}
    cfg = load_config(write_config(tmp_path / "s.yaml", packed, tmp_path / "s", data=data,
                                   checkpoint={"resume": "none"}))
    trainer = Trainer(cfg)
    assert trainer.train_set.tokenizer is not None and set(trainer.val_sets) == {"many"}
