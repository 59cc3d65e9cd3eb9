"""LLaVA-1.5 image-text records (packsft.data.multimodal): the expanded ids and pixels are LlavaProcessor's own, image
tokens are never trained, only assistant text is, and each invalid record is refused by its field."""

import copy
import re

import pytest
import torch

from examples.shapes_dataset import conversations, draw_shape, llava_processor_folder
from packsft.data.multimodal import (
    check_image_record,
    encode_image_text,
    image_seq_length,
    load_processor,
    processor_fingerprint,
)
from packsft.jsonl import ConversationError
from packsft.layout import IGNORE_INDEX
from packsft.prompt_formats import Tokenization, TokenizationSpec, tokenize_conversation
from packsft.tokenizer import load_tokenizer

SAMPLES = {key: (record, members) for key, record, members in conversations()}


@pytest.fixture(scope="module")
def llava(tmp_path_factory, tokenizer_dir):
    """The tiny LLaVA processor folder, its processor and settings, and the run's tokenization of that folder."""
    folder = llava_processor_folder(tmp_path_factory.mktemp("llava") / "processor",
                                    tokenizer_dir("smollm2-135m-instruct"))
    processor, image = load_processor(folder)
    tokenizer = load_tokenizer(folder)
    return folder, processor, image, Tokenization.of(tokenizer, TokenizationSpec(str(folder)).bind(tokenizer))


def test_processor_settings_are_llava_processors_own(llava):
    folder, processor, image, _ = llava
    assert (image.image_token, image.image_seq_length, image.height, image.width) == ("<image>", 4, 28, 28)
    assert image.image_token_id == processor.image_token_id == processor.tokenizer.convert_tokens_to_ids("<image>")
    counted = processor._get_num_multimodal_tokens(image_sizes=[[64, 64]]).num_image_tokens  # transformers' own
    assert image_seq_length(processor) == counted[0]
    fingerprint = processor_fingerprint(processor, folder)
    assert fingerprint["crop_size"] == {"height": 28, "width": 28} and fingerprint["image_seq_length"] == 4
    assert set(fingerprint["files (SHA-256)"]) >= {"processor_config.json", "tokenizer.json"}


def test_a_folder_without_a_llava_processor_is_refused_by_name(tokenizer_dir, tmp_path):
    plain = tokenizer_dir("smollm2-135m-instruct")
    with pytest.raises(ValueError, match=rf"^data.tokenizer: {re.escape(str(plain))}: the processor is a \w+, not a "
                                         "LLaVA-1.5 one"):
        load_processor(plain)
    with pytest.raises(ValueError, match=rf"^data.tokenizer: {re.escape(str(tmp_path / 'none'))}: cannot load"):
        load_processor(tmp_path / "none")


@pytest.mark.parametrize("key", sorted(SAMPLES))
def test_expanded_ids_and_pixels_equal_llava_processors_and_images_are_never_trained(llava, key):
    _, processor, image, tokenization = llava
    record, members = SAMPLES[key]
    out = encode_image_text(record, members, tokenization, processor, image)
    conv, images = check_image_record(record, members, image.image_token)
    rendered = tokenization.tokenizer.apply_chat_template(conv.messages, tokenize=False)
    reference = processor(text=rendered, images=images or None, return_tensors="pt")
    assert out["tokens"] == reference["input_ids"][0].tolist()            # the processor's own expansion
    assert out["num_image_tokens"] == 4 * len(record["media"]) == out["tokens"].count(image.image_token_id)
    assert out["pixel_values"].dtype == torch.float32
    if images:
        assert torch.equal(out["pixel_values"], reference["pixel_values"])
    else:
        assert out["pixel_values"].shape == (0, 3, 28, 28)
    trained = [t for t in out["targets"] if t != IGNORE_INDEX]
    assert all(t == tok for t, tok in zip(out["targets"], out["tokens"]) if t != IGNORE_INDEX)
    assert all(t == IGNORE_INDEX for t, tok in zip(out["targets"], out["tokens"]) if tok == image.image_token_id)
    answers = [m["content"] for m in record["messages"] if m["role"] == "assistant"]
    assert tokenization.tokenizer.decode(trained) == "".join(f"{a}<|im_end|>" for a in answers)
    text_only = {**record, "messages": conv.messages, "media": []}   # the same text as a text conversation
    tokens, targets = tokenize_conversation(text_only["messages"], tokenization)
    assert [t for t in targets if t != IGNORE_INDEX] == trained


def _set(path, value):
    """A change of a record: ``path`` (keys and indices) set to ``value`` (``...``: deleted)."""
    def change(record, members):
        *above, last = path
        target = record
        for step in above:
            target = target[step]
        if value is ...:
            del target[last]
        else:
            target[last] = value
    return change


def _members(change):
    return lambda record, members: change(members)


BAD = [
    ("000000", _set(("messages", 0, "content", 0, "media_index"), 1), r"messages\[0\]\.content\[0\]\.media_index: "
     r"must be the index of a media item \(0 to 0\), got 1"),
    ("000000", _set(("messages", 0, "content", 0, "media_index"), "0"), r"messages\[0\]\.content\[0\]\.media_index"),
    ("000003", _set(("messages", 0, "content", 0, "media_index"), 1),
     r"messages\[0\]\.content\[0\]\.media_index: media\[1\] comes before media\[0\]"),
    ("000003", _set(("messages", 0, "content", 1, "media_index"), 0),
     r"messages\[0\]\.content\[1\]\.media_index: media\[0\] is used a second time"),
    ("000003", _set(("messages", 0, "content", 1), {"type": "text", "text": "and"}), r"^media\[1\]: is never "),
    ("000000", _set(("media", 0, "member"), "000000.other.png"), r"^media\[0\]\.member: '000000.other.png' is not a "
                                                                 r"member of the sample \(its members: 000000.first"),
    ("000000", _members(lambda m: m.update({"000000.first.png": b"not an image"})),   # no object's repr
     r"^media\[0\]\.member: '000000.first.png' is not an image PIL can read \(UnidentifiedImageError: cannot "
     r"identify image file\)$"),
    ("000000", _set(("media",), ...), r"^messages\[0\]\.content\[0\]\.media_index: the record lists no media "
                                      r"items \(its media is missing or empty\), so no image part can refer to one"),
    ("000000", _set(("media", 0, "type"), "video"), r"^media\[0\]: must be an object of type 'image'"),
    ("000000", _set(("media",), {"x": 1}), r"^media: must be a list"),
    ("000000", _set(("messages", 1, "content"), [{"type": "image", "media_index": 0}]),
     r"^messages\[1\]\.content\[0\]: an image part in a 'assistant' message"),
    ("000000", _set(("messages", 0, "content", 1), {"type": "audio"}), r"^messages\[0\]\.content\[1\]: must be a part "
                                                                       r"of type 'text' or 'image', got 'audio'"),
    ("000000", _set(("messages", 0, "content", 1, "text"), 5), r"^messages\[0\]\.content\[1\]\.text: must be a string"),
    ("000000", _set(("messages", 0, "content", 1, "text"), "see <image>"),
     r"^messages\[0\]\.content\[1\]\.text: holds the image token '<image>'"),
    ("000006", _set(("messages", 1, "content"), "<image>"), r"^messages\[1\]\.content: holds the image token"),
    ("000000", _set(("messages", 0, "content"), []), r"^messages\[0\]\.content: an empty list"),
    ("000000", _set(("messages", 1, "role"), "bot"), r"^messages\[1\]\.role: unknown role 'bot'"),
]


@pytest.mark.parametrize("key,change,error", BAD, ids=[f"{i}-{k}" for i, (k, _, _) in enumerate(BAD)])
def test_an_invalid_record_is_refused_by_its_field(llava, key, change, error):
    _, processor, image, tokenization = llava
    record, members = copy.deepcopy(SAMPLES[key])
    change(record, members)
    with pytest.raises(ConversationError) as caught:
        encode_image_text(record, members, tokenization, processor, image)
    assert re.search(error, f"{caught.value.field}: {caught.value.reason}"), (caught.value.field, caught.value.reason)


def test_check_image_record_keeps_manifest_order_and_decodes_rgb(llava):
    record, members = SAMPLES["000005"]
    conv, images = check_image_record(record, members, "<image>")
    assert conv.messages[1]["content"] == "Compare\n<image>\nwith\n<image>"
    assert [im.getpixel((32, 40)) for im in images] == [(255, 255, 0), (128, 0, 128)]   # yellow, purple
    assert len(draw_shape("square", "red")) > 100
