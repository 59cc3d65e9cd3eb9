"""Writing the rows: the packed rows' JSON lines gathered from the spools (:func:`write_row_range`), hashed as
written, and their token ids into the token cache."""

from __future__ import annotations

import os
import random
from pathlib import Path

from packsft.io import HashingWriter, temp_path
from packsft.packing.config import PackConfig
from packsft.packing.merge import Counted
from packsft.token_cache import TokenCacheWriter, cache_paths


def shuffled_rows(order, starts, seed: int, np):
    """``(order, starts)`` with the rows in the order ``random.Random(seed).shuffle`` gives a list of them."""
    perm = list(range(len(starts)))
    random.Random(seed).shuffle(perm)
    perm = np.asarray(perm, dtype=np.int64)
    lengths = np.diff(np.r_[starts, len(order)])[perm]
    new_starts = np.cumsum(lengths) - lengths
    # position k of new row j reads old position starts[perm[j]] + (k - new_starts[j])
    take = np.repeat(starts[perm] - new_starts, lengths) + np.arange(len(order), dtype=np.int64)
    return order[take], new_starts


def token_cache_writer(cfg: PackConfig, rows: int, counted: Counted, temps: dict[str, Path],
                        np) -> TokenCacheWriter | None:
    """The token cache writer into fresh temp files (``temps["token_cache"]``, ``temps["token_index"]``)."""
    if not cfg.token_cache:
        return None
    tokens_path, index_path = cache_paths(cfg.output)
    temps["token_cache"], temps["token_index"] = temp_path(tokens_path), temp_path(index_path)
    total = int(np.minimum(counted.num_tokens.astype(np.int64), cfg.max_seq_len).sum())
    return TokenCacheWriter(temps["token_cache"], temps["token_index"], cfg.output, total, rows,
                            len(counted.num_tokens), cfg.max_seq_len)


def row_groups(starts, r0: int, r1: int, conversations: int, block: int, np) -> list[tuple[int, int]]:
    """Rows ``r0 .. r1-1`` cut into consecutive ``(ra, rb)`` groups of about ``block`` conversations (whole rows)."""
    if r1 <= r0:
        return []
    ends = np.append(starts[1:], conversations)
    targets = np.arange(int(starts[r0]) + block, int(ends[r1 - 1]), block)
    cuts = (np.searchsorted(ends, targets, side="left") + 1).tolist()  # each group ends with the row holding one
    bounds = sorted({r0, r1, *(c for c in cuts if r0 < c < r1)})
    return list(zip(bounds, bounds[1:]))


ROW_GROUP_BYTES = 64 << 20
"""Most spool bytes (messages JSON, plus token cache bytes when written) the row writer holds at once, unless
one row is larger: with long conversations a group of 65,536 would hold gigabytes."""


def _byte_groups(groups, starts, ends, order, counted: Counted, max_seq_len: int, tokens: bool, np):
    """``groups`` of rows, each cut further (whole rows) so that its spool bytes stay under :data:`ROW_GROUP_BYTES`."""
    for ra, rb in groups:
        lo, hi = int(starts[ra]), int(ends[rb - 1])
        idx = order[lo:hi]
        nbytes = counted.size[idx] + (8 * np.minimum(counted.num_tokens[idx], max_seq_len) if tokens else 0)
        row_end = np.cumsum(nbytes)[ends[ra:rb] - lo - 1]  # bytes through the end of each row
        cuts = (np.searchsorted(row_end, np.arange(ROW_GROUP_BYTES, int(row_end[-1]), ROW_GROUP_BYTES), side="left")
                + 1 + ra).tolist()
        bounds = sorted({ra, rb, *(c for c in cuts if ra < c < rb)})
        yield from zip(bounds, bounds[1:])


def write_row_range(order, starts, counted: Counted, r0: int, r1: int, rows_out, tokens_out, np,
                     max_seq_len: int = 0, block: int = 1 << 16) -> None:
    """Write rows ``r0 .. r1-1`` from the spools: their JSON lines to ``rows_out`` (``.write(bytes)``) and, unless
    ``tokens_out`` is ``None``, their token cache bytes as ``tokens_out(data, num_tokens, row_sizes)`` (the
    arguments of :meth:`packsft.token_cache.TokenCacheWriter.add_rows`).

    Rows go ``block`` conversations and at most :data:`ROW_GROUP_BYTES` of spool bytes at a time (whole rows;
    Python lists only of one group). The spools are read
    with ``os.pread``, not memory-mapped: a row gathers conversations from anywhere in them, and the mapped
    pages it touched would stay in the resident set (about 800 bytes per conversation). The local engine
    writes all rows in one call; the Ray engine's tasks write parts (:mod:`packsft.packing.ray_engine`).
    """
    fds: list[int] = []
    try:
        fds += [os.open(p, os.O_RDONLY) for p in counted.spools]
        token_fds = [os.open(p, os.O_RDONLY) for p in counted.token_spools] if tokens_out is not None else []
        fds += token_fds
        pread = os.pread
        ends = np.append(starts[1:], len(order))
        groups = row_groups(starts, r0, r1, len(order), block, np)
        for ra, rb in _byte_groups(groups, starts, ends, order, counted, max_seq_len, tokens_out is not None, np):
            lo, hi = int(starts[ra]), int(ends[rb - 1])
            idx = order[lo:hi]
            spools, offsets = counted.spool[idx].tolist(), counted.offset[idx].tolist()
            sizes = counted.size[idx].tolist()
            parts = [pread(fds[s], n - 2, o + 1) for s, o, n in zip(spools, offsets, sizes)]  # without the brackets
            lines, k = [], 0
            for end in (ends[ra:rb] - lo).tolist():
                lines.append(b'{"messages": [' + b", ".join(parts[k:end]) + b"]}\n")
                k = end
            rows_out.write(b"".join(lines))
            if tokens_out is not None:
                ntok = counted.num_tokens[idx]
                tok_offsets = counted.token_offset[idx].tolist()
                tok_sizes = (8 * np.minimum(ntok, max_seq_len)).tolist()
                data = b"".join(pread(token_fds[s], n, t) for s, t, n in zip(spools, tok_offsets, tok_sizes))
                tokens_out(data, ntok, np.diff(np.append(starts[ra:rb], hi)))
    finally:
        for fd in fds:
            os.close(fd)


def write_rows(order, starts, counted: Counted, tmp: Path, np, cache: TokenCacheWriter | None = None,
                max_seq_len: int = 0, block: int = 1 << 16) -> tuple[int, str]:
    """Write all rows into ``tmp`` (fsynced) and their tokens into ``cache``; return the rows' size in bytes and
    BLAKE2b-160 hex."""
    with open(tmp, "wb") as f:
        out = HashingWriter(f)
        write_row_range(order, starts, counted, 0, len(starts), out, cache.add_rows if cache is not None else None,
                         np, max_seq_len, block)
        f.flush()
        os.fsync(f.fileno())
    return out.size, out.hexdigest()

