"""Image-text Energon samples (LLaVA-1.5) packed into THD rows: rows within max_seq_len, each image's ids inside its
own conversation's segment, images in row order, never trained, counts; errors name dataset, shard and sample key;
an oversize conversation keeps only whole images; the processor is part of the loader's fingerprint."""

import io
import json

import pytest
import torch

pytest.importorskip("megatron.energon")

from megatron.energon import SkipSample  # noqa: E402
from megatron.energon.source_info import SourceInfo  # noqa: E402
from PIL import Image  # noqa: E402
from test_loop import write_config  # noqa: E402

from examples.shapes_dataset import conversations, draw_shape, llava_processor_folder, shapes_dataset  # noqa: E402
from packsft.layout import IGNORE_INDEX, ROW_KEYS  # noqa: E402
from packsft.packing.energon import iter_sample_members  # noqa: E402
from packsft.train.config import load_config  # noqa: E402
from packsft.train.energon_images import (  # noqa: E402
    IMAGE_KEYS,
    ImageTextTrainSource,
    train_source,
)
from packsft.train.energon_loader import (  # noqa: E402
    EnergonSampleError,
    EnergonTrainSource,
    EnergonValidationSet,
    fingerprint_changes,
)

SEQ = 128
SAMPLES = {key: (record, members) for key, record, members in conversations()}


@pytest.fixture(scope="module")
def llava(tmp_path_factory, tokenizer_dir):
    """The shapes dataset, the tiny LLaVA processor folder, the config and the source of both."""
    root = tmp_path_factory.mktemp("energon_images")
    ds = shapes_dataset(root / "ds")
    processor = llava_processor_folder(root / "processor", tokenizer_dir("smollm2-135m-instruct"))
    cfg = _config(root, "c.yaml", ds, processor)
    return {"root": root, "ds": ds, "processor": processor, "cfg": cfg,
            "source": train_source(cfg.data, cfg.parallel, "llava")}


def _config(root, name, ds, tokenizer):
    """The run config of ``ds`` with the processor folder ``tokenizer``: rows of 128 tokens, 2 rows per batch."""
    return load_config(write_config(root / name, {"few": ds, "tokenizer": tokenizer}, root / "out", data={
        "backend": "energon", "max_seq_len": SEQ, "energon": {"buffer_size": 8, "shuffle_buffer_size": 1}},
        loader={"micro_batch_size": 2}))


def _encoded(source, split="train"):
    """Every sample of ``split`` encoded by the source's one-pass encoder, and that encoder."""
    encoder = source.encoder(endless=False)
    samples = [encoder.encode_sample({"__key__": key, "__restore_key__": None, "__shard__": shard, **members})
               for _, shard, key, members in iter_sample_members(source.path, split)]
    return samples, encoder


def _pixels(source, key):
    """The processor's pixel_values of a sample's images, decoded here from its drawn members."""
    record, members = SAMPLES[key]
    images = [Image.open(io.BytesIO(members[m["member"]])).convert("RGB") for m in record["media"]]
    if not images:
        return torch.zeros(0, 3, 28, 28)
    return source.processor.image_processor(images, return_tensors="pt")["pixel_values"]


def test_rows_fit_and_hold_each_conversations_images_in_its_segment_in_row_order(llava):
    source = llava["source"]
    image_id = source.image.image_token_id
    samples, encoder = _encoded(source)
    assert [s["__key__"] for s in samples] == [f"{i:06d}" for i in range(7)]
    assert [s["num_image_tokens"] for s in samples] == [4, 4, 4, 8, 8, 8, 0]     # expanded before packing
    rows = encoder.select_samples_to_pack(samples)
    assert sorted(s["__key__"] for r in rows for s in r) == sorted(s["__key__"] for s in samples)
    for bin_ in rows:
        assert len(bin_) == 1 or sum(len(s["tokens"]) for s in bin_) <= SEQ      # only an oversize one alone
        row = encoder.pack_selected_samples(bin_)
        assert set(row) == set(ROW_KEYS) | set(IMAGE_KEYS) and row["tokens"].shape == (SEQ,)
        tokens, bounds, padded = row["tokens"], row["cu_seqlens"].tolist(), row["cu_seqlens_padded"].tolist()
        assert torch.equal(row["images"], torch.cat([_pixels(source, s["__key__"]) for s in bin_]))
        assert row["images"].dtype == torch.float32 and row["images"].shape[1:] == (3, 28, 28)
        for k, sample in enumerate(bin_):            # each conversation's image ids inside its own segment
            start, end = padded[k], padded[k] + bounds[k + 1] - bounds[k]
            assert int((tokens[start:end] == image_id).sum()) == sample["num_image_tokens"]
            assert tokens[start:end].tolist() == sample["tokens"]
        assert int((tokens == image_id).sum()) == row["num_image_tokens"] == 4 * len(row["images"])
        assert row["num_text_tokens"] == bounds[-1] - row["num_image_tokens"]
        assert not (row["labels"] == image_id).any()                           # image ids never trained
        assert (row["loss_mask"][row["labels"] == IGNORE_INDEX] == 0).all()


def test_loader_batches_and_the_validation_split_carry_images(llava):
    source, cfg = llava["source"], llava["cfg"]
    assert isinstance(source, ImageTextTrainSource)
    batch = next(iter(source.train_loader(cfg.loader, 0, 1)))
    image_id = source.image.image_token_id
    assert set(batch) == set(ROW_KEYS) | set(IMAGE_KEYS) and batch["tokens"].shape == (1, 2 * SEQ)
    assert batch["images"].shape[0] * 4 == batch["num_image_tokens"] == int((batch["tokens"] == image_id).sum())
    assert batch["num_text_tokens"] == int(batch["cu_seqlens"][-1]) - batch["num_image_tokens"]
    val = EnergonValidationSet(source, "val")                 # reads the image members of each sample too
    assert len(val) == 1 and torch.equal(val[0]["images"], _pixels(source, "000007"))


def _crude(key, record, members, shard="shard-000009.tar"):
    """A ``CrudeWebdataset`` sample as Energon's cooker gives it: members by extension."""
    return {"__key__": key, "__restore_key__": ("Webdataset", 0), "json": json.dumps(record).encode(),
            **{name.removeprefix(f"{key}."): data for name, data in members.items()},
            "__sources__": (SourceInfo(dataset_path="ds", index=0, shard_name=shard, file_names=()),)}


def test_invalid_samples_are_named_by_dataset_shard_and_key_or_skipped(llava, capfd):
    source = llava["source"]
    encoder = source.encoder()
    record, members = SAMPLES["000003"]
    ok = encoder.encode_sample(_crude("000003", record, members))
    where = f"{source.path}: shard-000009.tar: sample 000003"
    assert ok["pixel_values"].shape == (2, 3, 28, 28) and ok["where"] == where
    with pytest.raises(EnergonSampleError, match=rf"^{where}: media\[1\]\.member: '000003.second.png' is not a "
                                                 "member of the sample"):
        encoder.encode_sample(_crude("000003", record, {"000003.first.png": members["000003.first.png"]}))
    swapped = json.loads(json.dumps(record))
    swapped["messages"][0]["content"][0]["media_index"] = 1
    with pytest.raises(EnergonSampleError, match=r"sample 000003: messages\[0\]\.content\[0\]\.media_index: media\[1\] "
                                                 r"comes before media\[0\]"):
        encoder.encode_sample(_crude("000003", swapped, members))
    with pytest.raises(EnergonSampleError, match=r"sample 000003: media\[0\]\.member: '000003.first.png' is not an "
                                                 "image PIL can read"):
        encoder.encode_sample(_crude("000003", record, {**members, "000003.first.png": b"GIF8 broken"}))
    skipping = source.encoder()
    skipping.skip_invalid = True
    capfd.readouterr()
    with pytest.raises(SkipSample):
        skipping.encode_sample(_crude("000003", swapped, members))
    assert "sample 000003: messages[0].content[0].media_index: " in capfd.readouterr().err
    plain = {"messages": [{"role": "user", "content": "What is <image>?"}, {"role": "assistant", "content": "A tag."}]}
    with pytest.raises(EnergonSampleError, match=r"sample 000006: messages: the prompt format rendered 1 image tokens "
                                                 r"\('<image>'\) for 0 image\(s\)"):
        encoder.encode_sample(_crude("000006", plain, {}))
    text = EnergonTrainSource(source.data, source.parallel).encoder()           # the text encoder still refuses
    with pytest.raises(EnergonSampleError, match=r"sample 000003: media: .*text only"):
        text.encode_sample(_crude("000003", record, members))


def test_an_oversize_conversation_keeps_only_its_whole_images(llava):
    source = llava["source"]
    image_id = source.image.image_token_id
    record, members = SAMPLES["000004"]                        # multi-turn, two images
    full = source.encoder().encode_sample(_crude("000004", record, members))
    second = [p for p, t in enumerate(full["tokens"]) if t == image_id][4]
    encoder = source.encoder()
    encoder.max_seq_len = second + 2                           # the row ends inside the second image
    sample = encoder.encode_sample(_crude("000004", record, members))
    with pytest.warns(UserWarning, match=r"sample 000004: 1 of its images cut off with the row"):
        row = encoder.pack_selected_samples([sample])
    assert row["num_image_tokens"] == 4 and torch.equal(row["images"], _pixels(source, "000004")[:1])
    assert int((row["tokens"] == image_id).sum()) == 4       # the cut image's ids are padding
    assert row["num_text_tokens"] == second + 2 - 4 - 2
    encoder.oversize = "error"
    with pytest.raises(EnergonSampleError, match=r"sample 000004: \d+ tokens, more than data.max_seq_len"):
        encoder.encode_sample(_crude("000004", record, members))


def test_the_processor_is_part_of_the_loader_fingerprint_and_model_family_picks_the_source(llava, tokenizer_dir):
    source, cfg, root = llava["source"], llava["cfg"], llava["root"]
    settings = source.settings(cfg.loader, 1)
    key = "data.tokenizer (its LLaVA processor's image settings and files, SHA-256)"
    assert settings[key]["image_seq_length"] == 4 and settings[key]["image_mean"][0] == pytest.approx(0.48145466)
    bigger = llava_processor_folder(root / "processor56", tokenizer_dir("smollm2-135m-instruct"), crop=56)
    other = _config(root, "c56.yaml", llava["ds"], bigger)
    moved = train_source(other.data, other.parallel, "llava")
    assert moved.image.image_seq_length == 16
    changes = fingerprint_changes({"settings": settings, "dataset": source.identity},
                                  {"settings": moved.settings(cfg.loader, 1), "dataset": source.identity})
    assert [c.split(":")[0] for c in changes] == [key]
    was, now = (s[key]["files (SHA-256)"]["processor_config.json"] for s in (settings, moved.settings(cfg.loader, 1)))
    assert changes[0] == (f"{key}: size.shortest_edge 28 -> 56; crop_size.height 28 -> 56; crop_size.width 28 -> 56; "
                          f"image_seq_length 4 -> 16; files (SHA-256).processor_config.json {was} -> {now}")
    assert type(train_source(cfg.data, cfg.parallel, None)) is EnergonTrainSource
    assert draw_shape("circle", "red")[:4] == b"\x89PNG"
