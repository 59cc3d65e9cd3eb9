"""Image-text conversations for LLaVA-1.5 (Hugging Face ``LlavaProcessor``): one record and its media members ->
expanded ``(tokens, targets)`` and ``pixel_values``.

A record is the NeMo-RL SFT guide's Energon sample ``{"messages": [...], "media": [{"type": "image", "member":
"000001.first.jpg"}, ...], "tools": ...}``: a message's ``content`` may be a list of parts, ``{"type": "image",
"media_index": k}`` (user messages only) or ``{"type": "text", "text": ...}``. Each ``media`` item is referenced by
exactly one image part, in the manifest's order, so the images' order in the conversation is the manifest's.

Each message's parts are joined with ``"\\n"`` into one string, an image part written as the processor's image
token (``<image>``; llava's own chat template also puts a newline after it), so the prompt format
(:func:`packsft.prompt_formats.tokenize_conversation`) renders and trains the conversation as text; then each image
token id is expanded into :func:`image_seq_length` copies, as ``LlavaProcessor.__call__`` expands the text, and
never trained. The images go through the processor's CLIP image processor.

Nothing here imports Energon; the Energon encoder is :mod:`packsft.train.energon_images`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from packsft.conversation import RECORD_OBJECT, Conversation, Each, check_value, parse_record
from packsft.jsonl import ConversationError, json_type
from packsft.layout import IGNORE_INDEX
from packsft.prompt_formats import Tokenization, tokenize_conversation

PROCESSOR_FILES = ("processor_config.json", "preprocessor_config.json", "chat_template.json", "chat_template.jinja",
                   "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
"""A processor folder's files whose SHA-256 goes into the loader fingerprint (those present)."""


@dataclass(frozen=True)
class ImageSettings:
    """What a packed row needs from the processor: the image token (text and id), the ids each image expands to
    (``image_seq_length``) and the ``pixel_values`` size (``height`` x ``width`` pixels, the CLIP crop)."""

    image_token: str
    image_token_id: int
    image_seq_length: int
    height: int
    width: int


def _crop(processor) -> tuple[int, int] | None:
    """``(height, width)`` of the image processor's fixed center crop, or None when it does not crop."""
    images = getattr(processor, "image_processor", None)
    crop = getattr(images, "crop_size", None)
    if not getattr(images, "do_center_crop", False) or not crop:
        return None
    return int(crop["height"]), int(crop["width"])


def image_seq_length(processor) -> int:
    """Image-token ids one image expands to, as ``LlavaProcessor`` computes it: ``(H // patch_size) * (W //
    patch_size) + num_additional_image_tokens``, less one with ``vision_feature_select_strategy == "default"``
    (the CLS feature dropped); ``H x W`` is the CLIP image processor's crop (LLaVA-1.5: 336 / 14 -> 576)."""
    height, width = _crop(processor)
    count = (height // processor.patch_size) * (width // processor.patch_size) + processor.num_additional_image_tokens
    return count - 1 if processor.vision_feature_select_strategy == "default" else count


def load_processor(folder: str | Path, field: str = "data.tokenizer") -> tuple[Any, ImageSettings]:
    """The LLaVA-1.5 processor of a local folder (``AutoProcessor.from_pretrained``, no download, no remote code)
    and its :class:`ImageSettings`. The run's ``data.tokenizer`` is this folder (a llava model folder holds the
    tokenizer and the processor's configs); ``field``: the setting or option that names it, for the errors.

    Raises:
        ValueError: ``"{field}: {folder}: ..."``: it does not load, it is not a ``LlavaProcessor`` with
            ``patch_size`` and a CLIP image processor that crops to a fixed size, or its image token is not one
            token of its tokenizer.
    """
    from transformers import AutoProcessor, LlavaProcessor

    try:
        processor = AutoProcessor.from_pretrained(str(folder), local_files_only=True, trust_remote_code=False)
    except Exception as e:  # noqa: BLE001 - OSError, ValueError, json errors: one line naming the folder
        raise ValueError(f"{field}: {folder}: cannot load a processor (AutoProcessor): {type(e).__name__}: "
                         f"{' '.join(str(e).split())}") from e
    if not isinstance(processor, LlavaProcessor) or not processor.patch_size or _crop(processor) is None:
        raise ValueError(f"{field}: {folder}: the processor is a {type(processor).__name__}, not a LLaVA-1.5 "
                         "one (a LlavaProcessor with patch_size and a CLIP image processor that center-crops to a "
                         "fixed size: processor_config.json or preprocessor_config.json)")
    ids = processor.tokenizer.encode(processor.image_token, add_special_tokens=False)
    if len(ids) != 1:
        raise ValueError(f"{field}: {folder}: the image token {processor.image_token!r} is {len(ids)} tokens "
                         "of the tokenizer, not one: add it as a special token")
    height, width = _crop(processor)
    return processor, ImageSettings(processor.image_token, ids[0], image_seq_length(processor), height, width)


def processor_fingerprint(processor, folder: str | Path) -> dict[str, Any]:
    """The processor settings the packed rows depend on (image size, mean and std, resampling, image token, the ids
    per image) and the SHA-256 (first 16 hex) of each of the folder's :data:`PROCESSOR_FILES`: plain values for the
    Energon loader's fingerprint."""
    images = processor.image_processor
    settings = {key: getattr(images, key, None) for key in (
        "size", "crop_size", "do_resize", "do_center_crop", "do_rescale", "rescale_factor", "do_normalize",
        "image_mean", "image_std", "resample", "do_convert_rgb")}
    settings = {key: _plain(value) for key, value in settings.items()}
    files = {p.name: hashlib.sha256(p.read_bytes()).hexdigest()[:16]
             for p in (Path(folder) / name for name in PROCESSOR_FILES) if p.is_file()}
    # not the image processor's class: transformers picks CLIPImageProcessor or its PIL twin by whether torchvision
    # is installed, with the same pixels; a resume on a machine without it must not be refused
    return {**settings, "image_token": processor.image_token,
            "patch_size": processor.patch_size,
            "vision_feature_select_strategy": processor.vision_feature_select_strategy,
            "num_additional_image_tokens": processor.num_additional_image_tokens,
            "image_seq_length": image_seq_length(processor), "files (SHA-256)": files}


def _plain(value: Any) -> Any:
    """``value`` as plain JSON-like values (``torch.load(weights_only=True)`` reads them): a ``SizeDict`` (a
    dataclass) or mapping as a dict of its set entries, a tuple as a list, an enum (``PILImageResampling``) as int."""
    if dataclasses.is_dataclass(value):
        value = dataclasses.asdict(value)
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items() if v is not None}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return int(value) if hasattr(value, "__index__") and not isinstance(value, bool) else value


def has_media(record: Any) -> bool:
    """True for a record that lists media or holds a list of content parts (read by :func:`encode_image_text`)."""
    if not isinstance(record, dict):
        return False
    messages = record.get("messages")
    return bool(record.get("media")) or any(isinstance(m, dict) and isinstance(m.get("content"), list)
                                            for m in (messages if isinstance(messages, list) else []))


def _fail(field: str, reason: str) -> ConversationError:
    """A record error of ``field`` (the caller names the dataset, shard and sample)."""
    return ConversationError("", 0, field, reason)


def _kind(value: Any) -> str:
    """How a refused media item or part is named: its ``type`` (an object's) or its JSON type."""
    return repr(value.get("type")) if isinstance(value, dict) else json_type(value)


def _media_rules(members: dict[str, bytes]) -> tuple:
    """What the ``media`` manifest must be: a list of ``{"type": "image", "member": NAME}``, NAME one of
    ``members``."""
    there = ", ".join(sorted(members)) or "none"
    return (
        ("", lambda v: isinstance(v, list), lambda v: f"must be a list of media items, got {json_type(v)}"),
        Each((
            ("", lambda m: isinstance(m, dict) and m.get("type") == "image",
             lambda m: f"must be an object of type 'image' with a member, got {_kind(m)} (packsft reads images only)"),
            (".member", lambda m: isinstance(m.get("member"), str) and m["member"] in members,
             lambda m: f"{m.get('member')!r} is not a member of the sample (its members: {there})"),
        )),
    )


def _as_text(image_token: str) -> str:
    return f"holds the image token {image_token!r} as text; images are image parts"


def _message_rules(image_token: str) -> tuple:
    """What a message's ``content`` must be besides :func:`packsft.conversation.validate_messages`' rules: no
    image token in a string, no empty list of parts (a message that is no object: ``parse_record`` names it)."""
    return (
        (".content", lambda m: not isinstance(m, dict) or not isinstance(m.get("content"), str)
         or image_token not in m["content"], _as_text(image_token)),
        (".content", lambda m: not isinstance(m, dict) or m.get("content") != [], "an empty list of content parts"),
    )


def _part_rules(role: Any, media_count: int, image_token: str) -> tuple:
    """What each content part of a ``role`` message must be: ``{"type": "text", "text": str}`` without
    ``image_token``, or (user messages only) ``{"type": "image", "media_index": k}``, ``0 <= k < media_count``."""
    def image(p: dict) -> bool:
        return p["type"] == "image"

    def index_ok(k: Any) -> bool:
        return isinstance(k, int) and not isinstance(k, bool) and 0 <= k < media_count

    return (Each((
        ("", lambda p: isinstance(p, dict) and p.get("type") in ("text", "image"),
         lambda p: f"must be a part of type 'text' or 'image', got {_kind(p)}"),
        (".text", lambda p: image(p) or isinstance(p.get("text"), str),
         lambda p: f"must be a string, got {json_type(p.get('text'))}"),
        (".text", lambda p: image(p) or image_token not in p["text"], _as_text(image_token)),
        ("", lambda p: not image(p) or role == "user",
         f"an image part in a {role!r} message; images go in user messages"),
        (".media_index", lambda p: not image(p) or index_ok(p.get("media_index")),
         lambda p: f"must be the index of a media item (0 to {media_count - 1}), got {p.get('media_index')!r}"
         if media_count else "the record lists no media items (its media is missing or empty), so no image part can "
                             "refer to one"),
    )),)


def _joined(record: dict, media_count: int, image_token: str) -> dict:
    """The record with each list ``content`` joined into one string (an image part as ``image_token``), checked
    (:func:`_message_rules`, :func:`_part_rules`), each media item referenced once, in the manifest's order."""
    messages = record.get("messages")
    if not isinstance(messages, list):
        return record                  # parse_record names it
    used, joined = 0, []
    for i, message in enumerate(messages):
        check_value(message, _message_rules(image_token), "", 0, f"messages[{i}]")
        content = message.get("content") if isinstance(message, dict) else None
        if not isinstance(content, list):
            joined.append(message)
            continue
        check_value(content, _part_rules(message.get("role"), media_count, image_token), "", 0,
                    f"messages[{i}].content")
        for j, part in enumerate(content):
            if part["type"] == "image" and part["media_index"] != used:
                why = "is used a second time" if part["media_index"] < used else f"comes before media[{used}]"
                raise _fail(f"messages[{i}].content[{j}].media_index", f"media[{part['media_index']}] {why}: each "
                                                                        "media item is referenced exactly once, in "
                                                                        "the manifest's order")
            used += part["type"] == "image"
        joined.append({**message, "content": "\n".join(image_token if p["type"] == "image" else p["text"]
                                                       for p in content)})
    if used < media_count:
        raise _fail(f"media[{used}]", "is never referenced: each media item is referenced exactly once (an image "
                                      "part's media_index)")
    return {**record, "messages": joined}


def _images(names: list[str], members: dict[str, bytes]) -> list:
    """Each named member decoded by PIL as an RGB image (``media[k].member`` named when it is not an image)."""
    from PIL import Image

    images = []
    for k, name in enumerate(names):
        try:
            with Image.open(io.BytesIO(members[name])) as image:
                images.append(image.convert("RGB"))
        except Exception as e:  # noqa: BLE001 - PIL raises UnidentifiedImageError, OSError, ValueError, ...
            said = " ".join(re.sub(r"<[^<>]* at 0x[0-9a-fA-F]+>", "", str(e)).split())  # no object's repr
            raise _fail(f"media[{k}].member", f"{name!r} is not an image PIL can read ({type(e).__name__}"
                                              f"{': ' + said if said else ''})") from e
    return images


def check_image_record(record: Any, members: dict[str, bytes], image_token: str) -> tuple[Conversation, list]:
    """Validate one image-text record and its members: the media manifest, the content parts, the messages
    (:func:`packsft.conversation.parse_record` on the joined text) and the images.

    Returns:
        ``(conv, images)``: the conversation with each content joined into a string (image parts as
        ``image_token``), and the PIL RGB images in manifest order.

    Raises:
        ConversationError: ``path`` empty, ``field`` naming the first invalid field (``media[0].member``,
            ``messages[1].content[0].media_index``, ``messages[2].role`` ...).
    """
    check_value(record, (RECORD_OBJECT,), "", 0, "")
    media = record.get("media") or []
    check_value(media, _media_rules(members), "", 0, "media")
    names = [item["member"] for item in media]
    conv = parse_record(_joined(record, len(names), image_token))
    return conv, _images(names, members)


def expand_image_tokens(tokens: list[int], targets: list[int], image: ImageSettings, num_images: int
                        ) -> tuple[list[int], list[int]]:
    """Each ``image.image_token_id`` of ``tokens`` repeated ``image.image_seq_length`` times, its targets
    ``IGNORE_INDEX`` (never trained).

    Raises:
        ConversationError: the prompt format rendered another number of image tokens than ``num_images``.
    """
    found = tokens.count(image.image_token_id)
    if found != num_images:
        raise _fail("messages", f"the prompt format rendered {found} image tokens ({image.image_token!r}) for "
                                f"{num_images} image(s)")
    out_tokens, out_targets = [], []
    for token, target in zip(tokens, targets):
        if token == image.image_token_id:
            out_tokens += [token] * image.image_seq_length
            out_targets += [IGNORE_INDEX] * image.image_seq_length
        else:
            out_tokens.append(token)
            out_targets.append(target)
    return out_tokens, out_targets


def encode_image_text(record: Any, members: dict[str, bytes], tokenization: Tokenization, processor,
                      image: ImageSettings | None = None) -> dict[str, Any]:
    """One image-text record as a packed row's conversation.

    Args:
        record: the decoded JSON record (see the module docstring); a record without media is a text conversation.
        members: the sample's members by name (``000001.first.jpg``), the ones ``media`` names among them.
        tokenization: the run's tokenizer (the processor's folder) and bound prompt format.
        processor: :func:`load_processor`'s; ``image``: its :class:`ImageSettings` (None: computed here).

    Returns:
        ``tokens``, ``targets``: equally long int lists, each image token expanded to ``image_seq_length`` ids whose
        targets are ``IGNORE_INDEX``; only assistant text trained, as for text. ``pixel_values``: float32 tensor
        ``[n_images, 3, H, W]`` (``[0, 3, H, W]`` without images), manifest order. ``num_image_tokens``: int,
        ``n_images * image_seq_length``.

    Raises:
        ConversationError: an invalid record or member (:func:`check_image_record`), or image tokens the prompt
            format did not render once per image.
        PromptFormatError: the prompt format cannot tokenize the conversation.
    """
    import torch

    if image is None:
        image = ImageSettings(processor.image_token, processor.image_token_id, image_seq_length(processor),
                              *_crop(processor))
    conv, images = check_image_record(record, members, image.image_token)
    tokens, targets = tokenize_conversation(conv.messages, tokenization, conv.tools, conv.chat_template_kwargs)
    tokens, targets = expand_image_tokens(tokens, targets, image, len(images))
    if images:
        pixels = processor.image_processor(images, return_tensors="pt")["pixel_values"].to(torch.float32)
    else:
        pixels = torch.zeros(0, 3, image.height, image.width, dtype=torch.float32)
    return {"tokens": tokens, "targets": targets, "pixel_values": pixels,
            "num_image_tokens": len(images) * image.image_seq_length}
