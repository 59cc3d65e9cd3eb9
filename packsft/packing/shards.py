"""Shards, the packer's units of work: line-aligned byte ranges of the JSONL inputs (:func:`plan_shards`), or a whole
row source; :func:`read_shard` reads one, and a worker's count of it comes back as a :class:`ShardResult`."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from packsft.jsonl import iter_jsonl_lines_sized
from packsft.packing.config import PackConfig
from packsft.packing.sources import is_row_source, iter_source

SHARD_BYTES_MIN, SHARD_BYTES_MAX, SHARDS, TAIL_SPLIT = 256 << 10, 64 << 20, 64, 4
"""Shard size: ``total input bytes / SHARDS``, within ``[SHARD_BYTES_MIN, SHARD_BYTES_MAX]`` (not the worker count);
the last ``2 * shard size`` bytes of inputs larger than one shard go in shards ``TAIL_SPLIT`` times smaller, so
that the workers finish together (the last shards a worker takes are short). A shard costs about a millisecond
of its own (a marker file, a result); 256 KiB is about 0.1-0.3 s of work."""


@dataclass(frozen=True)
class Shard:
    """A line-aligned byte range ``[start, end)`` of JSONL input ``file_idx``, or (``start == end == 0``) the
    whole of a row-source input: one task of a worker."""

    index: int
    file_idx: int
    start: int
    end: int


@dataclass
class ShardResult:
    """What a worker sends back for one shard: numpy arrays per accepted conversation, lists for the rest.

    Line numbers are relative to the shard (1 = its first line); the main process adds the lines before it.
    A row source's shard is the whole input: its numbers are the 0-based row indices.

    Attributes:
        shard: the shard read.
        lines: lines read (the shard's line count, blank lines included; rows of a row source).
        conversations: non-blank lines or rows (accepted + rejected).
        spool: the worker's spool file holding the accepted conversations' row messages JSON.
        num_tokens: int32 ``[n]``, tokens of each accepted conversation.
        offset, size: int64 ``[n]``, byte offset and length of each one's messages JSON in ``spool``.
        token_spool: the worker's token spool (``None`` without ``token_cache``): each accepted conversation's
            :func:`packsft.token_cache.encode_conversation` bytes (``8 * min(n, max_seq_len)`` of them).
        token_offset: int64 ``[n]``, byte offset of each one's bytes in ``token_spool`` (``None`` without it).
        rejected: ``(line, reason)`` of each rejected line.
        warnings: ``(kind, line, message)`` of each counting warning (``non_megatron``, ``no_trained_token``).
        oversize: ``(index, line, num_tokens, cut, uncut, exact, nbytes, trained, trained_in_row)`` of each
            accepted conversation whose cost exceeds ``max_seq_len`` (``index`` into the arrays; ``uncut``: its
            tokens before the packer's cut, an estimate unless ``exact``; the counts as in :func:`process_lines`).
        nbytes: bytes of input read.
        trained_fitting: accepted conversations of at most ``max_seq_len`` cost with a trained token.
        split: ``(index, pieces, line, num_tokens, nbytes)`` of each conversation ``--oversize split`` cut (its
            ``pieces`` are the arrays' entries from ``index`` on; ``num_tokens``: of the whole conversation).
        rejected_turns: ``(line, tokens, reason)`` of each assistant turn no piece trains (``tokens``: with the
            system message, or ``None``).
    """

    shard: Shard
    lines: int
    conversations: int
    spool: str
    num_tokens: Any
    offset: Any
    size: Any
    rejected: list[tuple[int, str]]
    warnings: list[tuple[str, int, str]]
    oversize: list[tuple[int, int, int, bool, int, int, int]]
    nbytes: int
    token_spool: str | None = None
    token_offset: Any = None
    trained_fitting: int = 0
    split: list[tuple[int, int, int, int, int]] = field(default_factory=list)
    rejected_turns: list[tuple[int, int | None, str]] = field(default_factory=list)



def read_shard(cfg: PackConfig, shard: Shard):
    """The records of one shard: ``(line, nbytes, text, error)`` with ``line`` counted from the shard's start.

    The one place input is read: a JSONL shard's lines (1-based within the shard), or a row source's rows
    (0-based row index, :func:`packsft.packing.sources.iter_source`). Records over
    ``cfg.max_conversation_bytes`` come with ``text=None`` and an ``error``, as do lines that are not UTF-8.
    The generator returns the shard's number of lines (blank ones included) or rows.

    Raises:
        packsft.packing.sources.SourceError: a row source cannot be read (naming it and the row).
    """
    path = cfg.inputs[shard.file_idx]
    if is_row_source(path):
        return _read_rows(path, cfg.max_conversation_bytes, cfg.split)
    return iter_jsonl_lines_sized(path, cfg.max_conversation_bytes, start=shard.start, end=shard.end)


def _read_rows(path: str, max_bytes: int, split: str | None):
    rows = 0
    for record in iter_source(path, max_bytes, split):
        rows += 1
        yield record
    return rows



def plan_shards(inputs: list[str], shard_bytes: int | None = None) -> list[Shard]:
    """Cut the inputs into line-aligned byte ranges of about ``shard_bytes`` (default: see :data:`SHARDS`, with a
    tail of smaller shards; a given ``shard_bytes`` is used throughout).

    The cut depends on the inputs (and ``shard_bytes``) only, never on the number of workers. A boundary is
    moved to the start of the line it falls in, found by reading forward to the next newline. A row source
    (:func:`packsft.packing.sources.is_row_source`) is one shard ``Shard(i, file_idx, 0, 0)``, read whole.
    """
    sizes = [0 if is_row_source(p) else os.path.getsize(p) for p in inputs]
    tail = 0  # bytes at the end of all the inputs cut TAIL_SPLIT times finer
    if shard_bytes is None:
        shard_bytes = min(SHARD_BYTES_MAX, max(SHARD_BYTES_MIN, sum(sizes) // SHARDS))
        tail = 2 * shard_bytes if sum(sizes) > shard_bytes else 0  # an input of one shard stays one
    shards: list[Shard] = []
    after = sum(sizes)  # bytes of the inputs from this file's start on
    for file_idx, (path, size) in enumerate(zip(inputs, sizes)):
        after -= size  # now: bytes of the files after this one
        if is_row_source(path):
            shards.append(Shard(len(shards), file_idx, 0, 0))
            continue

        def step(pos: int, size=size, after=after) -> int:  # bytes of the shard at pos: whole ones, then quarters
            before_tail, quarter = size - pos + after - tail, max(1, shard_bytes // TAIL_SPLIT)
            return quarter if before_tail <= 0 else min(shard_bytes, max(before_tail, quarter))

        starts = [0]
        with open(path, "rb") as f:
            target = step(0)
            while target < size:
                f.seek(target - 1)  # a boundary right after a newline stays where it is
                pos = target - 1
                while True:
                    chunk = f.read(1 << 16)
                    if not chunk:
                        pos = size
                        break
                    nl = chunk.find(b"\n")
                    if nl >= 0:
                        pos += nl + 1
                        break
                    pos += len(chunk)
                if pos >= size:
                    break
                if pos > starts[-1]:
                    starts.append(pos)
                target = max(pos, target) + step(max(pos, target))
        for start, end in zip(starts, starts[1:] + [size]):
            if end > start or size == 0:
                shards.append(Shard(len(shards), file_idx, start, end))
    return shards

