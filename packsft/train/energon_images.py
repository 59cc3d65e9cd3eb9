"""``data.backend: energon`` with image-text samples (LLaVA-1.5): the text path of :mod:`packsft.train.energon_loader`
with each sample's images.

A sample whose record lists media (or holds content parts) is encoded by
:func:`packsft.data.multimodal.encode_image_text` from its ``json`` member and its image members (``KEY.first.jpg``
...): its image tokens expanded to ``image_seq_length`` ids each, so the knapsack's cost is the expanded length
(CP-padded, :func:`packsft.layout.conversation_cost`) and a row never holds more than ``max_seq_len`` tokens. A
sample without media is a text conversation, as in a text dataset. Errors, ``skip_invalid_samples`` and ``oversize``
are the text encoder's (``dataset: shard: sample KEY: field: reason``).

Row = :func:`packsft.data.row.build_row`'s keys plus ``images`` (float32 ``[n_img, 3, H, W]``, the row's
conversations in row order, each one's images in manifest order), ``num_image_tokens`` and ``num_text_tokens``
(ints). An oversize conversation cut in a row of its own keeps the images whose tokens all fit; the ids of an image
cut through are padding (no image is left half).

Which encoder runs: :func:`train_source` by ``model_family`` (proposed key ``data.energon.model_family``: null =
text, ``llava``); the processor is the ``data.tokenizer`` folder's (:func:`packsft.data.multimodal.load_processor`),
and its settings and files join the loader's fingerprint (:func:`packsft.data.multimodal.processor_fingerprint`).
"""

from __future__ import annotations

import functools
import warnings
from typing import Any

import torch
from megatron.energon import stateless

from packsft.data.collate import collate_rows
from packsft.data.multimodal import (
    ImageSettings,
    encode_image_text,
    expand_image_tokens,
    has_media,
    load_processor,
    processor_fingerprint,
)
from packsft.jsonl import ConversationError, loads_line
from packsft.packing.energon import PAYLOAD
from packsft.record_formats import RecordFormatError
from packsft.train.energon_loader import ConversationEncoder, EnergonTrainSource

IMAGE_KEYS = ("images", "num_image_tokens", "num_text_tokens")
"""What an image-text row and micro-batch hold besides :data:`packsft.layout.ROW_KEYS`."""


class ImageConversationEncoder(ConversationEncoder):
    """:class:`~packsft.train.energon_loader.ConversationEncoder` with images: sample -> ``{tokens, targets,
    pixel_values, num_image_tokens}`` -> rows with ``images`` -> micro-batches with ``images``.

    Args:
        args, kwargs: the text encoder's.
        processor, image: :func:`packsft.data.multimodal.load_processor`'s processor and settings.
    """

    members_read = None   # the validation set reads the image members too

    def __init__(self, *args: Any, processor: Any, image: ImageSettings, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.processor, self.image = processor, image
        self._dropped: set[str] = set()

    def encode_record(self, sample: dict, text: str | None, problem: str | None) -> dict:
        """The text encoder's ``{tokens, targets}`` plus ``pixel_values`` (float32 ``[n_img, 3, H, W]``) and
        ``num_image_tokens``; a record with media (or content parts) through
        :func:`~packsft.data.multimodal.encode_image_text`, its members named ``KEY.EXT``.

        Raises:
            ConversationError, PromptFormatError: as the text encoder's (the field named).
        """
        record = loads_line(text, self.dataset, 0, problem)
        if not has_media(record):     # a text conversation: no image token may come of its text
            encoded = super().encode_record(sample, text, problem)
            expand_image_tokens(encoded["tokens"], encoded["targets"], self.image, 0)
            return {**encoded, "num_image_tokens": 0,
                    "pixel_values": torch.zeros(0, 3, self.image.height, self.image.width)}
        if self.convert is not None:
            try:
                record = self.convert(record)
            except RecordFormatError as e:
                raise ConversationError(self.dataset, 0, "", str(e)) from e
        key = sample["__key__"]
        members = {f"{key}.{ext}": data for ext, data in sample.items()
                   if not ext.startswith("__") and ext != PAYLOAD and isinstance(data, bytes)}
        return encode_image_text(record, members, self.tokenization, self.processor, self.image)

    @stateless
    def pack_selected_samples(self, samples: list[dict]) -> dict:
        """The text row (:meth:`ConversationEncoder.pack_selected_samples`) plus ``images`` (float32
        ``[n_img, 3, H, W]``, row order), ``num_image_tokens`` (ids of those images) and ``num_text_tokens`` (the
        other real tokens); an image cut by the row's end is dropped and its kept ids made padding (warned once)."""
        row = super().pack_selected_samples(samples)
        pad, size, image_id = self.tokenization.fmt.pad_token_id, self.image.image_seq_length, self.image.image_token_id
        starts, kept = row["cu_seqlens_padded"].tolist(), torch.diff(row["cu_seqlens"]).tolist()
        images, image_tokens, text_tokens = [], 0, 0
        for sample, start, length in zip(samples, starts, kept):   # the row's conversations (the dropped left out)
            ids = [p for p, t in enumerate(sample["tokens"][:length]) if t == image_id]
            whole = len(ids) // size
            images.append(sample["pixel_values"][:whole])
            image_tokens, text_tokens = image_tokens + whole * size, text_tokens + length - len(ids)
            if whole < len(sample["pixel_values"]):
                row["tokens"][[start + p for p in ids[whole * size:]]] = pad
                if sample["where"] not in self._dropped:
                    self._dropped.add(sample["where"])
                    warnings.warn(f"{sample['where']}: {len(sample['pixel_values']) - whole} of its images cut off "
                                  f"with the row after {length} tokens (max_seq_len)", UserWarning, stacklevel=2)
        row["images"] = torch.cat(images)
        row["num_image_tokens"], row["num_text_tokens"] = image_tokens, text_tokens
        return row

    @stateless
    def batch(self, samples: list[dict]) -> dict:
        """``collate_rows`` of the rows plus ``images`` (their images concatenated, float32 ``[sum n_img, 3, H,
        W]``), ``num_image_tokens`` and ``num_text_tokens`` (sums)."""
        batch = collate_rows(samples)
        batch["images"] = torch.cat([row["images"] for row in samples])
        for key in ("num_image_tokens", "num_text_tokens"):
            batch[key] = sum(int(row[key]) for row in samples)
        return batch


class ImageTextTrainSource(EnergonTrainSource):
    """:class:`~packsft.train.energon_loader.EnergonTrainSource` of an image-text dataset for a LLaVA-1.5 model:
    the processor of ``data.tokenizer`` (``processor``, ``image``) and :class:`ImageConversationEncoder`.

    Raises:
        ValueError: as the text source's, or ``data.tokenizer`` holds no LLaVA-1.5 processor (naming the folder).
    """

    def __init__(self, data, parallel) -> None:
        super().__init__(data, parallel)
        self.processor, self.image = load_processor(data.tokenizer)
        self.encoder_class = functools.partial(ImageConversationEncoder, processor=self.processor, image=self.image)

    def settings(self, loader, dp_size: int) -> dict[str, Any]:
        """The text source's settings plus the processor's (:func:`image_settings`)."""
        return {**super().settings(loader, dp_size), **image_settings(self.processor, self.data.tokenizer)}


def image_settings(processor, folder) -> dict[str, Any]:
    """The loader-fingerprint entry of a processor: its image settings and files' SHA-256, by config key."""
    return {"data.tokenizer (its LLaVA processor's image settings and files, SHA-256)":
            processor_fingerprint(processor, folder)}


def train_source(data, parallel, model_family: str | None) -> EnergonTrainSource:
    """The Energon training source of ``model_family`` (``data.energon.model_family``, one of
    ``config_sections.ENERGON_MODEL_FAMILIES`` or None: checked at config load): None -> text
    (``EnergonTrainSource``), ``llava`` -> :class:`ImageTextTrainSource`.

    Raises:
        ValueError: as the source's.
    """
    return EnergonTrainSource(data, parallel) if model_family is None else ImageTextTrainSource(data, parallel)
