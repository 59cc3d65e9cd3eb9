"""The packing report of an Energon split as ``data.backend: energon`` packs it: rows, fill, text and image tokens.

The trainer packs an Energon dataset as it reads it (:class:`~packsft.train.energon_loader.ConversationEncoder`:
Energon's packing buffer of ``data.energon.buffer_size`` samples, :func:`balanced_greedy_knapsack` over the
conversations' costs). :func:`energon_report` runs the same encoder over one split once, in the shards' order (the
trainer reads it shuffled, ``data.energon.shuffle_buffer_size``, so its buffers hold other samples: the counts of
samples, conversations, images and tokens are the same, the rows and fill are the report's buffers'), and counts
what the rows would hold. Each image's tokens are known before packing (``image_seq_length`` per image, from the
processor), so the knapsack's costs and this report are exact for the buffers it forms.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any

from megatron.energon import SkipSample

from packsft.layout import IGNORE_INDEX
from packsft.packing.energon import iter_sample_members
from packsft.train.energon_images import train_source


def _row_counts(samples: list[dict], max_seq_len: int) -> tuple[int, int]:
    """``(real tokens, image tokens)`` of one row of ``samples`` (a conversation cut by the row's end counted to it;
    the image tokens of an image cut through are padding, as :class:`ImageConversationEncoder` makes them)."""
    room, real, image = max_seq_len, 0, 0
    for s in samples:
        kept = min(len(s["tokens"]), room)
        real, room = real + kept, room - kept
        size = s.get("image_seq_length") or 1
        image += min(s.get("num_image_tokens", 0), kept // size * size)
    return real, image


def energon_report(cfg, split: str | None = None) -> dict[str, Any]:
    """Pack ``split`` (default ``data.split``) of ``cfg``'s Energon dataset with the training encoder and count.

    Args:
        cfg: a training :class:`~packsft.train.config.Config` with ``data.backend: energon``.

    Returns:
        ``dataset``, ``split``, ``model_family``, ``max_seq_len``, ``buffer_size``; ``samples`` (read),
        ``skipped`` (invalid or dropped ones, each warned on stderr as in training), ``conversations``,
        ``images``; ``rows`` and ``lower_bound_rows`` (``ceil(real tokens / max_seq_len)``); token counts
        ``text_tokens`` and ``image_tokens`` (real tokens in the rows; a conversation longer than a row counted
        to the row's end), ``trained_tokens`` (targets trained), ``padding_tokens`` (CP and row tails);
        ``efficiency`` (real / (rows x max_seq_len), a fraction).

    Raises:
        ValueError: as the trainer's data source (``data.train_path``, ``data.tokenizer``, ...).
        EnergonSampleError: a sample that cannot be trained without ``skip_invalid_samples`` (dataset, shard, key).
    """
    data = cfg.data
    source = train_source(data, cfg.parallel, data.energon.model_family)
    split = split or source.split
    encoder = source.encoder(endless=False)
    size = getattr(source, "image", None) and source.image.image_seq_length
    counts = dict.fromkeys(("samples", "skipped", "conversations", "images", "rows", "text_tokens",
                            "image_tokens", "trained_tokens"), 0)
    buffer: list[dict] = []

    def pack() -> None:
        for row in encoder.select_samples_to_pack(buffer):
            real, image = _row_counts(row, data.max_seq_len)
            counts["rows"] += 1
            counts["text_tokens"] += real - image
            counts["image_tokens"] += image
        buffer.clear()

    for _, shard, key, members in iter_sample_members(source.path, split, encoder.members_read):
        counts["samples"] += 1
        with contextlib.suppress(SkipSample):
            sample = encoder.encode_sample({"__key__": key, "__restore_key__": None, "__shard__": shard, **members})
            images = len(sample.get("pixel_values", ()))
            counts["conversations"] += 1
            counts["images"] += images
            counts["trained_tokens"] += sum(t != IGNORE_INDEX for t in sample["targets"][1:])
            buffer.append({"tokens": sample["tokens"], "num_image_tokens": sample.get("num_image_tokens", 0),
                           "image_seq_length": size})
            if len(buffer) == data.energon.buffer_size:
                pack()
    if buffer:
        pack()
    counts["skipped"] = counts["samples"] - counts["conversations"]
    real = counts["text_tokens"] + counts["image_tokens"]
    capacity = counts["rows"] * data.max_seq_len
    return {"dataset": source.path, "split": split, "model_family": data.energon.model_family,
            "max_seq_len": data.max_seq_len, "buffer_size": data.energon.buffer_size, **counts,
            "lower_bound_rows": math.ceil(real / data.max_seq_len), "padding_tokens": capacity - real,
            "efficiency": round(real / capacity, 6) if capacity else None}
