"""Pack Energon datasets (``energon prepare`` layout): the same rows and tokens as from JSONL, samples located by
shard and key, image samples refused into the report, ``--split``, the sidecar's identity, a clear error without
the extra."""

import io
import json
import sys
import tarfile

import pytest

pytest.importorskip("megatron.energon")

from examples.shapes_dataset import prepare  # noqa: E402
from packsft.io import file_blake2b  # noqa: E402
from packsft.packing import cli  # noqa: E402
from packsft.packing.config import PackConfig, PackError  # noqa: E402
from packsft.packing.energon import TEXT_ONLY  # noqa: E402
from packsft.packing.pipeline import run_pack  # noqa: E402
from packsft.packing.sources import SourceError, check_source, iter_source, source_identity  # noqa: E402
from packsft.sidecar import read_sidecar  # noqa: E402
from packsft.token_cache import cache_paths  # noqa: E402

IMAGE = {"messages": [{"role": "user", "content": [{"type": "image", "media_index": 0},
                                                  {"type": "text", "text": "What colour is the square?"}]},
                      {"role": "assistant", "content": "Red."}],
         "media": [{"type": "image", "member": "000005.first.jpg"}], "tools": None}
IMAGE_PART = {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": "x.png"}]},
                           {"role": "assistant", "content": "A cat."}], "media": [], "tools": None}
BAD = {"messages": [{"role": "user", "content": "x"}, {"role": "bot", "content": "y"}], "media": [], "tools": None}


def _lines(path, n):
    return [json.loads(line) for line in path.read_text().splitlines()[:n]]


def _prepare(folder, shards, split_parts):
    """Write ``{name: [(key, record)]}`` as shards into ``folder`` (a fake JPEG member for each media item) and run
    ``energon prepare`` on it (``examples.shapes_dataset.prepare``)."""
    return prepare(folder, {name: [(key, record, {m["member"]: b"\xff\xd8\xff fake jpeg"
                                                  for m in record.get("media") or []}) for key, record in samples]
                            for name, samples in shards.items()}, split_parts)


@pytest.fixture(scope="module")
def data(tmp_path_factory, shared_data):
    """A prepared dataset: train = shard 0 (chats) + shard 1 (tool calls, a bad record, two image samples), val =
    shard 2; and the train records that are text, as JSONL."""
    root = tmp_path_factory.mktemp("energon")
    chats = _lines(shared_data / "chat" / "chitchat.messages.jsonl", 5)
    tools = _lines(shared_data / "tools" / "glaive_toolcall_en_demo.messages.jsonl", 2)
    train0 = [{**r, "media": [], "tools": r.get("tools")} for r in chats[:3]]
    train1 = [tools[0], BAD, IMAGE, tools[1], IMAGE_PART]
    val = chats[3:]
    ds = _prepare(root / "ds", {"shard-000000.tar": [(f"{i:06d}", r) for i, r in enumerate(train0)],
                                "shard-000001.tar": [(f"{i + 3:06d}", r) for i, r in enumerate(train1)],
                                "shard-000002.tar": [(f"{i + 8:06d}", r) for i, r in enumerate(val)]},
                  ["train:shard-00000[01].tar", "val:shard-000002.tar"])
    jsonl = root / "train.jsonl"
    jsonl.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in train0 + [tools[0], BAD, tools[1]]))
    return ds, jsonl, val


def _pack(tmp_path, tokenizer_dir, inputs, name="o", **cfg):
    out = tmp_path / f"{name}.jsonl.packed"
    report = run_pack(PackConfig(inputs=[str(p) for p in inputs], output=str(out), tokenizer=str(
        tokenizer_dir("qwen2.5")), progress=False, histogram="", **{"max_seq_len": 2048, **cfg}))
    return report, out


def test_energon_train_split_packs_the_rows_jsonl_gives(tmp_path, tokenizer_dir, data):
    ds, jsonl, _ = data
    ref_report, ref = _pack(tmp_path, tokenizer_dir, [jsonl], "ref")
    report, out = _pack(tmp_path, tokenizer_dir, [ds])
    assert out.read_bytes() == ref.read_bytes()
    assert [p.read_bytes() for p in cache_paths(out)] == [p.read_bytes() for p in cache_paths(ref)]
    assert report.packed_conversations == ref_report.packed_conversations == 5
    assert report.input_conversations == 8                     # the split's samples: shards 0 and 1
    where = [(r["input"], r["shard"], r["sample"], r["reason"]) for r in report.rejected]
    assert where == [
        (str(ds), "shard-000001.tar", "000004", ref_report.rejected[0]["reason"]),      # the JSONL parser's reason
        (str(ds), "shard-000001.tar", "000005", f"media: the sample has media (1 item(s)); {TEXT_ONLY}"),
        (str(ds), "shard-000001.tar", "000007", f"messages[0].content[0]: a non-text part ('image_url'); {TEXT_ONLY}")]
    assert "data.energon.model_family: llava" in TEXT_ONLY
    assert ref_report.rejected[0]["reason"].startswith("messages[1].role: unknown role 'bot'")
    assert f"rejected {ds}: shard-000001.tar: sample 000005: media: the sample has media" in report.summary()
    ident = read_sidecar(out)["input_identity"][str(ds)]
    assert ident["kind"] == "energon" and ident["split"] == "train" and ident["num_samples"] == 8
    assert [f["name"] for f in ident["files"]] == [".nv-meta/.info.json", ".nv-meta/split.yaml",
                                                    ".nv-meta/dataset.yaml", "shard-000000.tar", "shard-000001.tar"]
    assert ident["files"][3] == {"name": "shard-000000.tar", "size": (ds / "shard-000000.tar").stat().st_size,
                                 "blake2b": file_blake2b(ds / "shard-000000.tar")}
    with pytest.raises(PackError, match=rf"{ds}: shard-000001.tar: sample 000004: messages\[1\].role: unknown role"):
        _pack(tmp_path, tokenizer_dir, [ds], "strict", strict=True)


def test_samples_are_numbered_in_the_dataset_and_split_excludes_are_left_out(tmp_path, shared_data):
    chats = _lines(shared_data / "chat" / "chitchat.messages.jsonl", 4)
    ds = _prepare(tmp_path / "ds", {"a.tar": [("k0", chats[0]), ("k1", chats[1])],
                                    "b.tar": [("k2", chats[2]), ("k3", chats[3])]},
                  ["train:b.tar", "val:a.tar"])
    texts = [json.dumps(r, ensure_ascii=False) for r in chats]
    # train is shard b only: its samples keep their numbers in the whole dataset (a.tar's come first)
    assert list(iter_source(ds)) == [(2, len(texts[2].encode()), texts[2], None),
                                     (3, len(texts[3].encode()), texts[3], None)]
    split = ds / ".nv-meta" / "split.yaml"
    before = source_identity(ds, "val")
    split.write_text(split.read_text().replace("exclude: []", "exclude:\n- a.tar/k0"))
    assert [n for n, *_ in iter_source(ds, split="val")] == [1]
    after = source_identity(ds, "val")
    assert (before["num_samples"], after["num_samples"]) == (2, 1)
    assert before["files"][1]["name"] == ".nv-meta/split.yaml" and before["files"][1] != after["files"][1]
    shard = ds / "b.tar"
    with tarfile.open(shard) as tar:
        cut = tar.getmembers()[1].offset_data + 10
    shard.write_bytes(shard.read_bytes()[:cut])                    # cut inside its second sample
    with pytest.raises(SourceError, match=r"ds: after b.tar: sample k2: cannot be read as an Energon dataset"):
        list(iter_source(ds))


def test_a_shard_changed_since_prepare_or_a_part_given_for_the_folder_is_refused_naming_the_fix(tmp_path,
                                                                                                shared_data):
    chats = _lines(shared_data / "chat" / "chitchat.messages.jsonl", 3)
    ds = _prepare(tmp_path / "ds", {"a.tar": [("k0", chats[0]), ("k1", chats[1])]}, ["train:a.tar"])
    check_source(ds)
    (ds / "shards").mkdir()
    (ds / "shards" / "x.tar").write_bytes((ds / "a.tar").read_bytes())   # shards in a subfolder, as documented
    for given in (ds / "a.tar", ds / ".nv-meta", ds / "shards", ds / "shards" / "x.tar"):
        with pytest.raises(SourceError, match=f"^--input {given}: part of the Energon dataset {ds}; give the "
                                              f"dataset's folder, --input {ds}$"):
            check_source(given)
    loose = tmp_path / "loose.tar"                                     # a shard outside any dataset
    loose.write_bytes((ds / "a.tar").read_bytes())
    with pytest.raises(SourceError, match="a tar archive, not JSONL text; to read WebDataset shards, prepare"):
        check_source(loose)
    data = json.dumps(chats[2]).encode()
    with tarfile.open(ds / "a.tar", "a") as tar:                   # a sample appended: energon would never read it
        info = tarfile.TarInfo("k2.json")
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    with pytest.raises(SourceError, match=r"a.tar: its \d+ bytes do not end where its 2 indexed samples end \(byte "
                                          rf"\d+\): samples added, or the shard replaced, since energon prepare; run "
                                          rf"energon prepare {ds} again$"):
        check_source(ds)
    (ds / ".nv-meta" / "split.yaml").unlink()
    with pytest.raises(SourceError, match=r"split.yaml cannot be read \(\w+: .*split\.yaml"):
        check_source(ds)


def test_split_is_chosen_by_name_and_unknown_or_missing_ones_are_refused(tmp_path, tokenizer_dir, data, capsys):
    ds, _, val = data
    args = ["--output", str(tmp_path / "o.jsonl.packed"), "--tokenizer", str(tokenizer_dir("qwen2.5")),
            "--max-seq-length", "2048", "--no-progress", "--histogram", ""]
    assert cli.main(["--input", str(ds), "--split", "test", *args]) == 2
    assert f"--split 'test': {ds} has splits train, val" in capsys.readouterr().err
    assert cli.main(["--input", str(ds), "--split", "val", *args]) == 0
    meta = read_sidecar(tmp_path / "o.jsonl.packed")
    assert meta["split"] == "val" and meta["input_identity"][str(ds)]["split"] == "val"
    assert meta["input_identity"][str(ds)]["num_samples"] == len(val)
    assert [f["name"] for f in meta["input_identity"][str(ds)]["files"]][-1:] == ["shard-000002.tar"]
    chats = _lines(tokenizer_dir("qwen2.5").parents[1] / "chat" / "chitchat.messages.jsonl", 1)
    no_train = _prepare(tmp_path / "nt", {"s.tar": [("k0", chats[0])]}, ["val:s.tar"])
    assert cli.main(["--input", str(no_train), *args]) == 2
    assert "is an Energon dataset without a train split (splits: val): pick one with --split NAME" \
        in capsys.readouterr().err


def test_missing_energon_extra_names_it(tmp_path, monkeypatch, data):
    ds, jsonl, _ = data
    monkeypatch.setitem(sys.modules, "megatron.energon", None)     # `import megatron.energon` now raises
    cfg = PackConfig(inputs=[str(ds)], output=str(tmp_path / "o.jsonl.packed"), tokenizer="unused", max_seq_len=256)
    with pytest.raises(SourceError, match=r"reading Energon datasets needs the packsft\[energon\] extra: pip install "
                                          r"'packsft\[energon\]' \(or pip install megatron-energon\)"):
        cfg.validate()
    PackConfig(inputs=[str(jsonl)], output=str(tmp_path / "o.jsonl.packed"), tokenizer="unused",
               max_seq_len=256).validate()                          # JSONL does not need it
