"""``data.backend: energon``: samples checked and tokenized as the packer does (errors name shard and key), rows equal
to ``PackedSFTDataset``'s, the balanced knapsack, and a tiny training run that stops and resumes in a new process
with the same next batch and losses; a changed setting or dataset file is refused by name."""

import json
import re
import shutil
import subprocess
import sys

import pytest
import torch

pytest.importorskip("megatron.energon")

from megatron.energon import SkipSample  # noqa: E402
from megatron.energon.source_info import SourceInfo  # noqa: E402
from test_energon_source import BAD, IMAGE, _prepare  # noqa: E402
from test_loop import REPO, SEQ, train, train_records, write_config  # noqa: E402

from packsft.data.collate import collate_rows  # noqa: E402
from packsft.data.dataset import PackedSFTDataset, RowError  # noqa: E402
from packsft.data.samplers import EvalShardSampler  # noqa: E402
from packsft.layout import ROW_KEYS  # noqa: E402
from packsft.packing.config import PackConfig  # noqa: E402
from packsft.packing.pipeline import run_pack  # noqa: E402
from packsft.train.config import load_config  # noqa: E402
from packsft.train.data import build_datasets  # noqa: E402
from packsft.train.energon_loader import (  # noqa: E402
    ConversationEncoder,
    EnergonSampleError,
    balanced_greedy_knapsack,
    fingerprint_changes,
)

ENERGON = {"backend": "energon", "energon": {"buffer_size": 6, "shuffle_buffer_size": 4}}


@pytest.fixture(scope="module")
def energon_data(tmp_path_factory, shared_data, tokenizer_dir):
    """One prepared dataset of 16 gsm8k conversations in two shards (train) and 4 in a third (val), the train
    records, the val records and the tokenizer."""
    root = tmp_path_factory.mktemp("energon_train")
    lines = (shared_data / "chat" / "gsm8k_test.messages.jsonl").read_text().splitlines()[:20]
    records = [{"messages": json.loads(line)["messages"], "media": [], "tools": None} for line in lines]
    ds = _prepare(root / "ds", {"shard-000000.tar": [(f"{i:06d}", r) for i, r in enumerate(records[:8])],
                                "shard-000001.tar": [(f"{i:06d}", r) for i, r in enumerate(records[8:16], 8)],
                                "shard-000002.tar": [(f"{i:06d}", r) for i, r in enumerate(records[16:], 16)]},
                  ["train:shard-00000[01].tar", "val:shard-000002.tar"])
    return {"few": ds, "records": records[:16], "val": records[16:], "root": root,
            "tokenizer": tokenizer_dir("smollm2-135m-instruct")}


def _config(tmp_path, dataset, **sections):
    sections = {**sections, "data": {**ENERGON, **sections.get("data", {})}}
    return write_config(tmp_path / "c.yaml", dataset, tmp_path / "out", **sections)


def _crude(key, record, shard="shard-000009.tar"):
    """A ``CrudeWebdataset`` sample as Energon's cooker receives it."""
    return {"__key__": key, "__restore_key__": ("Webdataset", 0), "json": json.dumps(record).encode(),
            "__sources__": (SourceInfo(dataset_path="ds", index=0, shard_name=shard, file_names=(f"{key}.json",)),)}


def test_balanced_knapsack_fits_rows_limits_conversations_and_isolates_a_long_one():
    costs = [5, 3, 8, 2, 2, 7, 12, 1]
    bins = balanced_greedy_knapsack(costs, 10, max_per_bin=2)
    assert sorted(i for b in bins for i in b) == list(range(len(costs)))
    assert [6] in bins                                                  # longer than a row: alone
    assert all(len(b) <= 2 and sum(costs[i] for i in b) <= 10 for b in bins if b != [6])
    assert len(balanced_greedy_knapsack([4, 4, 4, 4], 8, delta=2)) == 4  # spread over the extra rows


def test_invalid_samples_are_named_by_dataset_shard_and_key(tmp_path, energon_data, capfd):
    source, _ = build_datasets(load_config(_config(tmp_path, energon_data)))
    encoder = ConversationEncoder("ds", source.tokenization, SEQ)
    with pytest.raises(EnergonSampleError, match=r"^ds: shard-000009.tar: sample 000004: messages\[1\]\.role: "):
        encoder.encode_sample(_crude("000004", BAD))
    with pytest.raises(EnergonSampleError, match=r"^ds: shard-000009.tar: sample 000005: media: .*text only"):
        encoder.encode_sample(_crude("000005", IMAGE))
    crude = {**_crude("000006", {}), "json": b"{not json"}
    with pytest.raises(EnergonSampleError, match="^ds: shard-000009.tar: sample 000006: "):
        encoder.encode_sample(crude)
    misnamed = {k: v for k, v in _crude("000007", {}).items() if k != "json"} | {"messages.json": b"{}"}
    with pytest.raises(EnergonSampleError, match=r"sample 000007: the sample has no .json member .*\(its members: "
                                                 r"messages.json; a sample KEY holds KEY.json\)"):
        encoder.encode_sample(misnamed)
    bad = _prepare(tmp_path / "bad", {"shard-000000.tar": [("000000", energon_data["records"][0]), ("000001", BAD)]},
                   ["train:shard-000000.tar"])
    cfg = load_config(_config(tmp_path, {**energon_data, "few": bad}, data={"energon": {"shuffle_buffer_size": 1,
                                                                                          "num_workers": 1}}))
    loader = build_datasets(cfg)[0].train_loader(cfg.loader, 0, 1)
    with pytest.raises(RowError, match=r"^\S*bad: shard-000000.tar: sample 000001: messages\[1\]\.role"):
        next(iter(loader))                                        # from a worker: one line, as tools/train.py prints

    skip = load_config(_config(tmp_path, {**energon_data, "few": bad}, data={"energon": {
        "shuffle_buffer_size": 1, "skip_invalid_samples": True, "validation_split": "train"}}))
    capfd.readouterr()
    source, val = build_datasets(skip)                            # the validation split reads it too
    batch = next(iter(source.train_loader(skip.loader, 0, 1)))
    warned = r"warning: \S*bad: shard-000000.tar: sample 000001: messages\[1\]\.role: .*; skipped \(data.energon"
    assert len(re.findall(warned, capfd.readouterr().err)) >= 2   # printed, whatever Python's warning filters
    good = tuple(encoder.encode_sample(_crude("000000", energon_data["records"][0]))["tokens"])
    for row in (batch, val["validation"][0]):
        bounds, tokens = row["cu_seqlens"].tolist(), row["tokens"].reshape(-1).tolist()
        assert {tuple(tokens[a:b]) for a, b in zip(bounds, bounds[1:])} == {good}     # BAD left out

    none = _prepare(tmp_path / "none", {"shard-000000.tar": [("000000", BAD), ("000001", IMAGE)]},
                    ["train:shard-000000.tar"])
    dead = load_config(_config(tmp_path, {**energon_data, "few": none}, data={"energon": {
        "shuffle_buffer_size": 1, "skip_invalid_samples": True}}))
    with pytest.raises(RowError, match=r"none: shard-000000.tar: sample \d+: .*; every one of the 3 samples this "
                                       r"rank's loader reads was skipped, no valid one between them: nothing to "
                                       r"train; fix the samples$"):    # BAD, IMAGE and its image member's sample
        next(iter(build_datasets(dead)[0].train_loader(dead.loader, 0, 1)))   # not an endless silent loop
    one = _prepare(tmp_path / "one", {"shard-000000.tar": [("000000", energon_data["records"][0])]},
                   ["train:shard-000000.tar", "val:shard-000000.tar"])
    val = build_datasets(load_config(_config(tmp_path, {**energon_data, "few": one}, data={"energon": {
        "validation_split": "val"}})))[1]["validation"]
    with pytest.raises(ValueError, match=r"^data.energon.validation_split 'val' \(\S*one\) has 1 row, fewer than "
                                         r"dp_size=2: some rank would get none; give a split with at least dp_size "
                                         r"packed rows, or set data.energon.validation_split=null$"):
        EvalShardSampler(val, dp_size=2)
    with pytest.raises(ValueError, match=r"^data.energon.validation_split 'train': no valid sample to validate on"):
        build_datasets(load_config(_config(tmp_path, {**energon_data, "few": none}, data={"energon": {
            "skip_invalid_samples": True, "validation_split": "train"}})))


def test_skipping_with_loader_workers_stops_only_a_worker_whose_every_sample_is_skipped(tmp_path, energon_data):
    """data.energon.num_workers=2 over 4 samples, one broken: each worker reads 2, one of them valid, and trains
    (the shuffle buffer holds each sample many times: a sample skipped twice in a row is no reason to stop); with 2
    broken samples in one worker's half that worker stops, saying so."""
    good = energon_data["records"]
    for name, samples, stops in (("one", [good[0], BAD, good[1], good[2]], False),
                                 ("two", [BAD, BAD, good[1], good[2]], True)):
        ds = _prepare(tmp_path / name, {"shard-000000.tar": [(f"{i:06d}", r) for i, r in enumerate(samples)]},
                      ["train:shard-000000.tar"])
        cfg = load_config(_config(tmp_path, {**energon_data, "few": ds}, data={"energon": {
            "num_workers": 2, "buffer_size": 2, "skip_invalid_samples": True}}))
        batches = iter(build_datasets(cfg)[0].train_loader(cfg.loader, 0, 1))
        if stops:
            with pytest.raises(RowError, match=rf"^\S*{name}: shard-000000.tar: sample 00000[01]: .*; every one of "
                                               r"the 2 samples this loader worker reads was skipped, no valid one "
                                               r"between them: nothing to train; fix the samples or lower "
                                               r"data.energon.num_workers$"):
                for _ in range(40):
                    next(batches)
        else:
            for _ in range(40):                               # never stops
                next(batches)


def test_a_conversation_longer_than_a_row_is_cut_dropped_or_an_error_as_data_energon_oversize_says(
        tmp_path, energon_data, capfd):
    source, _ = build_datasets(load_config(_config(tmp_path, energon_data)))
    record = energon_data["records"][0]
    whole = ConversationEncoder("ds", source.tokenization, SEQ).encode_sample(_crude("000001", record))["tokens"]
    short = len(whole) - 2
    cut = ConversationEncoder("ds", source.tokenization, short)               # own-row: kept whole, cut in its row
    assert cut.encode_sample(_crude("000001", record))["tokens"] == whole
    with pytest.raises(SkipSample):
        ConversationEncoder("ds", source.tokenization, short, oversize="drop").encode_sample(_crude("000001", record))
    said = f"{len(whole)} tokens, more than data.max_seq_len ({short})"
    assert f"warning: ds: shard-000009.tar: sample 000001: {said}; skipped (data.energon.oversize: drop)" \
        in capfd.readouterr().err
    with pytest.raises(EnergonSampleError, match=rf"^ds: shard-000009.tar: sample 000001: {re.escape(said)} "
                                                 r"\(data.energon.oversize: error; "):
        ConversationEncoder("ds", source.tokenization, short, oversize="error").encode_sample(_crude("000001", record))


def test_a_row_of_the_encoder_equals_the_packed_datasets_row(tmp_path, energon_data):
    records = energon_data["records"][:5]
    src = tmp_path / "five.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in records))
    run_pack(PackConfig(inputs=[str(src)], output=str(tmp_path / "five.jsonl.packed"), max_seq_len=4096,
                        tokenizer=str(energon_data["tokenizer"]), histogram="", progress=False))
    packed = PackedSFTDataset(tmp_path / "five.jsonl.packed", energon_data["tokenizer"], "chat-template", 4096)
    assert len(packed) == 1
    cfg = load_config(_config(tmp_path, energon_data, data={"max_seq_len": 4096},
                              model={"max_position_embeddings": 4096}))
    source, _ = build_datasets(cfg)
    encoder = ConversationEncoder("ds", source.tokenization, 4096)
    samples = {tuple(s["tokens"]): s for s in (encoder.encode_sample(_crude(f"{i:06d}", r))
                                               for i, r in enumerate(records))}
    in_row = [samples[tuple(tokens)] for tokens, _ in packed.tokenize_row(0)]      # the packed row's order
    ours = encoder.batch([encoder.pack_selected_samples(in_row)])
    theirs = collate_rows([packed[0]])
    assert ours.keys() == theirs.keys() and set(ROW_KEYS) <= set(ours)
    for key, value in theirs.items():
        same = torch.equal(ours[key], value) and ours[key].dtype == value.dtype if torch.is_tensor(value) else \
            ours[key] == value
        assert same, key


def test_data_parallel_ranks_read_disjoint_halves_of_the_split(tmp_path, energon_data):
    """Energon's ``WorkerConfig(rank=dp_rank, world_size=dp_size)``: the two ranks of DP 2 see 8 conversations each,
    none twice, all 16 together (read from the rows by ``cu_seqlens``)."""
    cfg = load_config(_config(tmp_path, energon_data, data={"max_seq_len": 4096},
                              model={"max_position_embeddings": 4096}))
    source, _ = build_datasets(cfg)
    seen = []
    for rank in (0, 1):
        loader, convs = iter(source.train_loader(cfg.loader, rank, 2)), set()
        for _ in range(12):                       # several passes over this rank's 8 samples
            batch = next(loader)
            bounds = batch["cu_seqlens"].tolist()
            tokens = batch["tokens"][0].tolist()
            convs |= {tuple(tokens[a:b]) for a, b in zip(bounds, bounds[1:])}
        seen.append(convs)
    assert len(seen[0]) == len(seen[1]) == 8 and not seen[0] & seen[1]
    expected = {tuple(s["tokens"]) for s in (ConversationEncoder("ds", source.tokenization, 4096).encode_sample(
        _crude(f"{i:06d}", r)) for i, r in enumerate(energon_data["records"]))}
    assert seen[0] | seen[1] == expected


def test_the_validation_split_is_packed_once_into_rows_of_its_samples(tmp_path, energon_data):
    cfg = load_config(_config(tmp_path, energon_data, data={"energon": {**ENERGON["energon"],
                                                                        "validation_split": "val"}}))
    source, val = build_datasets(cfg)
    rows = val["validation"]
    encode = ConversationEncoder("ds", source.tokenization, SEQ).encode_sample
    expected = {tuple(encode(_crude(f"{i:06d}", r))["tokens"])[:SEQ] for i, r in enumerate(energon_data["val"])}
    got = []
    for i in range(len(rows)):
        row = rows[i]
        assert set(ROW_KEYS) <= set(row) and row["tokens"].shape == (SEQ,)
        bounds = row["cu_seqlens"].tolist()
        got += [tuple(row["tokens"][a:b].tolist()) for a, b in zip(bounds, bounds[1:])]
    assert sorted(got) == sorted(expected)                        # each val sample once, none of train
    with pytest.raises(ValueError, match=r"^data.train_path: data.energon.validation_split='dev': \S+ has splits "):
        build_datasets(load_config(_config(tmp_path, energon_data, data={"energon": {"validation_split": "dev"}})))


def test_an_adapter_converts_each_sample_and_its_source_is_in_the_fingerprint(tmp_path, energon_data, monkeypatch):
    """``data.energon.adapter``: the packer's ``--adapter`` for the trainer; an edit of its file changes the
    fingerprint (a resume would be refused), a wrong path or a record format beside it is refused at start."""
    (tmp_path / "qa_adapter.py").write_text(
        "def to_messages(r):\n"
        "    return {'messages': [{'role': 'user', 'content': r['q']}, {'role': 'assistant', 'content': r['a']}]}\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    pairs = [(f"What is {i} + {i}?", f"{2 * i}.") for i in range(4)]
    samples = [(f"{i:06d}", {"q": q, "a": a}) for i, (q, a) in enumerate(pairs)]
    qa = _prepare(tmp_path / "qa", {"shard-000000.tar": samples}, ["train:shard-000000.tar"])
    adapter = {"energon": {**ENERGON["energon"], "adapter": "qa_adapter:to_messages"}}
    cfg = load_config(_config(tmp_path, {**energon_data, "few": qa}, data=adapter))
    source, _ = build_datasets(cfg)
    loader = source.train_loader(cfg.loader, 0, 1)
    batch = next(iter(loader))
    bounds, tokens = batch["cu_seqlens"].tolist(), batch["tokens"][0].tolist()
    encode = ConversationEncoder("ds", source.tokenization, SEQ).encode_sample
    expected = {tuple(encode(_crude("0", {"messages": [{"role": "user", "content": q},
                                                       {"role": "assistant", "content": a}]}))["tokens"])
                for q, a in pairs}
    assert {tuple(tokens[a:b]) for a, b in zip(bounds, bounds[1:])} <= expected and len(bounds) > 1

    key = "data.energon.adapter (SHA-256 of its source)"
    before = loader.fingerprint
    (tmp_path / "qa_adapter.py").write_text((tmp_path / "qa_adapter.py").read_text() + "# edited\n")
    after = build_datasets(cfg)[0].train_loader(cfg.loader, 0, 1).fingerprint
    assert before["settings"][key] != after["settings"][key]
    assert fingerprint_changes(before, after) == [f"{key}: checkpoint {before['settings'][key]!r}, "
                                                  f"now {after['settings'][key]!r}"]
    with pytest.raises(ValueError, match=r"^data.energon.adapter='qa_adapter:nope' does not resolve"):
        build_datasets(load_config(_config(tmp_path, energon_data, data={"energon": {
            "adapter": "qa_adapter:nope"}})))
    with pytest.raises(ValueError, match=r"data.energon.adapter needs data.energon.record_format"):
        load_config(_config(tmp_path, energon_data, data={"energon": {"adapter": "qa_adapter:to_messages",
                                                                      "record_format": "sharegpt"}}))


def _next_batch_after_restore(config, state_file, out, keys=("tokens",)):
    """In a new process: the Energon loader of ``config`` restored from ``state_file``; its next batch's ``keys``."""
    code = ("import sys, torch; from packsft.train.config import load_config; "
            "from packsft.train.data import build_datasets; cfg = load_config(sys.argv[1]); "
            "loader = build_datasets(cfg)[0].train_loader(cfg.loader, 0, 1); "
            "loader.load_state_dict(torch.load(sys.argv[2], weights_only=True)); b = next(iter(loader)); "
            "torch.save({k: b[k] for k in sys.argv[4:]}, sys.argv[3])")
    proc = subprocess.run([sys.executable, "-c", code, str(config), str(state_file), str(out), *keys],
                          capture_output=True, text=True, timeout=120, cwd=REPO,
                          env={"OMP_NUM_THREADS": "1", "PATH": ""})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return torch.load(out)


def test_training_stops_and_resumes_in_a_new_process_with_the_same_batches(tmp_path, energon_data):
    steps = {"train": {"global_batch_size": 2, "train_steps": 4}, "checkpoint": {"save_interval": 2},
             "scheduler": {"warmup_steps": 1}, "validation": {"val_period": 2},
             "data": {"energon": {**ENERGON["energon"], "validation_split": "val"}}}
    (tmp_path / "full").mkdir()
    full = _config(tmp_path / "full", energon_data, **steps)
    train(full)
    summary = [json.loads(r) for r in (tmp_path / "full" / "out" / "metrics.jsonl").read_text().splitlines()
               if '"summary"' in r][0]
    assert summary["train_samples"] == 16 and "train_rows" not in summary   # rows are packed as samples are read
    saved = tmp_path / "full" / "out" / "checkpoints" / "iter_0000002"
    state = torch.load(saved / "dataloader_dp0.pt", weights_only=True)
    assert state["backend"] == "energon" and state["fingerprint"]["dataset"]["kind"] == "energon"

    cfg = load_config(full)
    fresh = iter(build_datasets(cfg)[0].train_loader(cfg.loader, 0, 1))
    batches = [next(fresh) for _ in range(5)]
    expected = batches[4]["tokens"]                                     # after 2 steps of 2 micro-batches
    first = batches[0]
    assert set(first) == set(ROW_KEYS) and first["tokens"].shape == first["loss_mask"].shape == (1, SEQ)
    assert first["tokens"].dtype == torch.int64 and first["loss_mask"].dtype == torch.float32
    assert first["cu_seqlens"].dtype == first["cu_seqlens_padded"].dtype == torch.int32
    got = _next_batch_after_restore(full, saved / "dataloader_dp0.pt", tmp_path / "next.pt")["tokens"]
    assert torch.equal(got, expected)

    (tmp_path / "resumed").mkdir()
    resumed = _config(tmp_path / "resumed", energon_data, **{**steps, "checkpoint": {"resume": str(saved)}})
    train(resumed)
    a, b = train_records(tmp_path / "full" / "out"), train_records(tmp_path / "resumed" / "out")
    assert sorted(b) == [3, 4]
    for step in (3, 4):
        assert a[step]["loss"] == b[step]["loss"] and a[step]["trained_tokens"] == b[step]["trained_tokens"], step
    val = [[json.loads(r) for r in (tmp_path / run / "out" / "metrics.jsonl").read_text().splitlines()
            if '"val_loss"' in r] for run in ("full", "resumed")]
    assert [r["step"] for r in val[0]] == [2, 4] and val[0][1]["val_loss"] == val[1][0]["val_loss"]
    assert val[0][1]["val_trained_tokens/validation"] > 0

    changed = load_config(full, ["data.energon.buffer_size=7"])
    loader = build_datasets(changed)[0].train_loader(changed.loader, 0, 1)
    with pytest.raises(ValueError, match=r"data.energon.buffer_size: checkpoint 6, now 7"):
        loader.load_state_dict(state)
    with pytest.raises(ValueError, match=r"data-parallel size: checkpoint 1, now 2"):
        build_datasets(cfg)[0].train_loader(cfg.loader, 0, 2).load_state_dict(state)
    shards = [f for f in state["fingerprint"]["dataset"]["files"] if f["name"].endswith(".tar")]
    assert shards and all(set(f) == {"name", "size", "index_blake2b"} for f in shards)  # shards are not read
    moved = json.loads(json.dumps(state["fingerprint"]))
    moved["dataset"]["files"][-1]["index_blake2b"] = "0" * 40
    assert fingerprint_changes(moved, loader.fingerprint)[-1] == ("the dataset file shard-000001.tar changed (size, "
                                                                  "BLAKE2b or sample index)")


def test_config_refuses_what_the_energon_backend_does_not_read(tmp_path, energon_data):
    config = _config(tmp_path, energon_data)
    with pytest.raises(ValueError, match="data.validation_path is not read with data.backend: energon"):
        load_config(config, ["data.validation_path=x.jsonl.packed"])
    with pytest.raises(ValueError, match="loader.num_workers is not read with data.backend: energon"):
        load_config(config, ["loader.num_workers=2"])
    with pytest.raises(ValueError, match=r"data.energon is read only with data.backend: energon \(data.backend is "
                                         r"packed; data.energon=null drops it\)"):
        load_config(config, ["data.backend=packed"])
    packed = load_config(config, ["data.backend=packed", "data.energon=null"])      # the file's block dropped
    assert packed.data.backend == "packed" and packed.data.energon is None
    assert load_config(config, ["data.energon=null"]).data.energon == type(load_config(config).data.energon)()
    with pytest.raises(ValueError, match=r"data.energon.buffer_size must be"):
        load_config(config, ["data.energon.buffer_size=0"])
    with pytest.raises(ValueError, match=r"^data.train_path: data.split='dev': \S+ has splits train, val$"):
        build_datasets(load_config(config, ["data.split=dev"]))
    typed = tmp_path / "typed"
    shutil.copytree(energon_data["few"], typed)
    (typed / ".nv-meta" / "dataset.yaml").write_text("__module__: megatron.energon\n__class__: TextWebdataset\n")
    (typed / ".nv-meta" / "dataset.yaml").write_text("sample_type:\n  __module__: megatron.energon\n"
                                                      "  __class__: TextSample\n")           # energon 7's layout
    with pytest.raises(ValueError, match=f"^data.train_path: {typed} was prepared with the sample type TextSample; "
                                         rf".* energon prepare {typed} --sample-type CrudeWebdataset "
                                         "--force-overwrite$"):
        build_datasets(load_config(config, [f"data.train_path={typed}"]))
    shard = next(energon_data["few"].glob("*.tar"))
    (tmp_path / "rows.jsonl.packed").write_text("{}\n")
    for given, why in ((shard, f"part of the Energon dataset {energon_data['few']}; give the dataset's folder"),
                       (energon_data["few"] / ".nv-meta", "part of the Energon dataset"),
                       (tmp_path / "missing", "no such file or folder"),
                       (tmp_path / "rows.jsonl.packed", "not an Energon dataset .* with data.backend: packed")):
        with pytest.raises(ValueError, match=f"^data.train_path: {given}: {why}"):
            build_datasets(load_config(config, [f"data.train_path={given}"]))


def test_without_the_extra_the_error_names_it(tmp_path, energon_data, monkeypatch):
    monkeypatch.setitem(sys.modules, "megatron.energon", None)              # import megatron.energon fails
    with pytest.raises(ImportError, match=r"needs the packsft\[energon\] extra"):
        build_datasets(load_config(_config(tmp_path, energon_data)))


def test_a_loader_state_of_the_other_backend_is_refused_by_name():
    from types import SimpleNamespace

    from packsft.train.data import load_train_loader_state

    for loader, state, saved, now in ((SimpleNamespace(backend="energon"), {"version": 2}, "packed", "energon"),
                                      (SimpleNamespace(), {"backend": "energon", "state": {}}, "energon", "packed")):
        with pytest.raises(ValueError, match=f"the checkpoint was trained with data.backend {saved}, now {now}; "
                                             "resume with checkpoint.restore_data_order=false"):
            load_train_loader_state(loader, state)
