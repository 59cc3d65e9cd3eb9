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

from packsft.packing.energon import iter_sample_members
from packsft.train.energon_images import train_source


def energon_report(cfg, split: str | None = None) -> dict[str, Any]:
    """Pack ``split`` (default ``data.split``) of ``cfg``'s Energon dataset with the training encoder and count.

    Args:
        cfg: a training :class:`~packsft.train.config.Config` with ``data.backend: energon``.

    Returns:
        ``dataset``, ``split``, ``model_family``, ``max_seq_len``, ``buffer_size``; ``samples`` (read),
        ``skipped`` (invalid or dropped ones, each warned on stderr as in training), ``conversations``; of the rows
        (each built by the encoder, as the trainer builds it): ``rows``, ``images`` (an image cut by a row's end
        is dropped, as in training), ``text_tokens`` and ``image_tokens``, ``cut_image_tokens`` (the kept ids of
        the dropped images, padding ids inside their conversation's segment), ``trained_tokens`` (the rows'
        ``num_trained_tokens``), ``padding_tokens`` (CP and tail padding), ``lower_bound_rows`` (``ceil(real /
        max_seq_len)``, real = the three token counts = the rows' ``cu_seqlens``) and ``efficiency`` (real /
        (rows x max_seq_len), a fraction: training's ``packing_efficiency``).

    Raises:
        ValueError: as the trainer's data source (``data.train_path``, ``data.tokenizer``, ...).
        EnergonSampleError: a sample that cannot be trained without ``skip_invalid_samples`` (dataset, shard, key).
    """
    data = cfg.data
    source = train_source(data, cfg.parallel, data.energon.model_family)
    split = split or source.split
    encoder = source.encoder(endless=False)
    counts = dict.fromkeys(("samples", "skipped", "conversations", "images", "rows", "text_tokens",
                            "image_tokens", "trained_tokens", "real_tokens"), 0)
    buffer: list[dict] = []

    def pack() -> None:   # the rows as the trainer builds them: cuts, dropped images and trained tokens included
        for selected in encoder.select_samples_to_pack(buffer):
            row = encoder.pack_selected_samples(selected)
            real = int(row["cu_seqlens"][-1])
            image = int(row.get("num_image_tokens", 0))
            counts["rows"] += 1
            counts["real_tokens"] += real
            counts["image_tokens"] += image
            counts["text_tokens"] += int(row.get("num_text_tokens", real))
            counts["trained_tokens"] += int(row["num_trained_tokens"])
            counts["images"] += len(row.get("images", ()))
        buffer.clear()

    for _, shard, key, members in iter_sample_members(source.path, split, encoder.members_read):
        counts["samples"] += 1
        with contextlib.suppress(SkipSample):
            buffer.append(encoder.encode_sample({"__key__": key, "__restore_key__": None, "__shard__": shard,
                                                 **members}))
            counts["conversations"] += 1
            if len(buffer) == data.energon.buffer_size:
                pack()
    if buffer:
        pack()
    counts["skipped"] = counts["samples"] - counts["conversations"]
    real, capacity = counts.pop("real_tokens"), counts["rows"] * data.max_seq_len
    counts["cut_image_tokens"] = real - counts["text_tokens"] - counts["image_tokens"]
    return {"dataset": source.path, "split": split, "model_family": data.energon.model_family,
            "max_seq_len": data.max_seq_len, "buffer_size": data.energon.buffer_size, **counts,
            "lower_bound_rows": math.ceil(real / data.max_seq_len), "padding_tokens": capacity - real,
            "efficiency": round(real / capacity, 6) if capacity else None}
