"""The token cache beside a packed file: every row's token ids and targets, so the loader need not re-tokenize.

The packer already tokenizes each conversation to count it; it writes those ``(tokens, targets)`` beside the
``X.jsonl.packed`` rows (which stay the interchange format Megatron-LM and NeMo RL read) as two ``.npy``
files, readable with ``np.load(path, mmap_mode="r", allow_pickle=False)``:

``X.jsonl.packed.tokens.npy``: int32 ``[T, 2]``, column 0 the token ids and column 1 the targets
(``IGNORE_INDEX`` = -100 where not trained) of every conversation of every row, in row order. A conversation
stores at most ``max_seq_len`` tokens (the first ones): an own-row conversation longer than ``L`` is stored
cut at ``L``, all that the loader's truncation keeps.

``X.jsonl.packed.tokens-index.npy``: int64 ``[HEADER + 2 * (R + 1) + C]``::

    [MAGIC, VERSION, R, C, T, max_seq_len, rows_blake2b (3 words, the rows file's BLAKE2b-160 zero-padded),
     row_conv_0 .. row_conv_R,     # row r holds conversations row_conv_r .. row_conv_{r+1} - 1
     row_token_0 .. row_token_R,   # and tokens row_token_r .. row_token_{r+1} - 1 of the tokens file
     length_0 .. length_{C-1}]     # each conversation's full length in tokens (stored: min(length, L))

The sidecar records both files' size, BLAKE2b-160 and the BLAKE2b of their first and last MiB
(:func:`file_fields`, checked by :func:`packsft.sidecar.check_token_cache`: the whole hash of a file of at most
256 MiB, or of any size with ``PackedSFTDataset(verify_rows_hash=True)``, the trainer's ``data.verify_hash: full``);
the index carries the rows file's hash, tying the three files together. Nothing here unpickles (``allow_pickle=False``).
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Sequence
from pathlib import Path
from typing import IO

import numpy as np
import numpy.lib.format as npy_format

from packsft.io import HashingWriter
from packsft.layout import IGNORE_INDEX

TOKENS_SUFFIX = ".tokens.npy"
INDEX_SUFFIX = ".tokens-index.npy"
MAGIC = 0x504B5346545F5443  # "PKSFT_TC"
VERSION = 1
HEADER = 9
ENDS_SPAN = 1 << 20
"""Bytes hashed at each end of a cache file for the check at every open (:func:`ends_blake2b`)."""
_DIGEST_WORDS = 3


class TokenCacheError(ValueError):
    """A token cache file that is not one (wrong magic, version, shape or dtype) or disagrees with its rows."""


def cache_paths(packed_path: str | Path) -> tuple[Path, Path]:
    """``(tokens, index)`` paths of the token cache of ``X.jsonl.packed``."""
    p = Path(packed_path)
    return p.with_name(p.name + TOKENS_SUFFIX), p.with_name(p.name + INDEX_SUFFIX)


def stored_length(num_tokens: int, max_seq_len: int) -> int:
    """Tokens stored for a conversation of ``num_tokens``: ``min(num_tokens, max_seq_len)``."""
    return min(int(num_tokens), int(max_seq_len))


def encode_conversation(tokens: Sequence[int], targets: Sequence[int], max_seq_len: int) -> bytes:
    """One conversation as cache bytes: int32 little-endian ``[min(n, L), 2]`` (token, target) pairs of two equally
    long sequences."""
    n = stored_length(len(tokens), max_seq_len)
    return encode_pairs(tokens[:n], targets[:n])


def encode_pairs(tokens: Sequence[int], targets: Sequence[int]) -> bytes:
    """int32 little-endian ``[n, 2]`` (token, target) bytes of two equally long int sequences: for consecutive
    conversations, their :func:`encode_conversation` bytes one after another."""
    pairs = np.empty((len(tokens), 2), dtype="<i4")
    pairs[:, 0] = tokens
    pairs[:, 1] = targets
    return pairs.tobytes()


def encode_runs(tokens: Sequence[int], runs: Sequence[int]) -> bytes:
    """:func:`encode_pairs` of ``tokens`` and the targets their ``runs`` give (``+k``: ``k`` trained tokens,
    their own ids; ``-k``: ``k`` masked ones, ``IGNORE_INDEX``), built in numpy from the runs; the runs cover the
    tokens (``tokenize_conversation(..., runs=True)`` gives both).
    """
    pairs = np.empty((len(tokens), 2), dtype="<i4")
    pairs[:, 0] = tokens
    r = np.array(runs, dtype=np.int64)
    lengths = np.abs(r)
    pairs[:, 1] = np.where(np.repeat(r > 0, lengths), pairs[:, 0], IGNORE_INDEX)
    return pairs.tobytes()


def ends_blake2b(path: str | Path) -> str:
    """BLAKE2b-160 (40 hex) of a file's size, first :data:`ENDS_SPAN` bytes and last :data:`ENDS_SPAN` bytes."""
    size = os.path.getsize(path)
    h = hashlib.blake2b(f"{size}:".encode(), digest_size=20)
    with open(path, "rb") as f:
        h.update(f.read(ENDS_SPAN))
        if size > ENDS_SPAN:
            f.seek(max(ENDS_SPAN, size - ENDS_SPAN))
            h.update(f.read())
    return h.hexdigest()


def file_fields(path: str | Path, size: int, blake2b: str, name: str) -> dict[str, object]:
    """The sidecar entry of one cache file ``path``: ``{file: name, size, blake2b, ends_blake2b}``."""
    return {"file": name, "size": int(size), "blake2b": str(blake2b), "ends_blake2b": ends_blake2b(path)}


def _digest_words(hex_digest: str) -> list[int]:
    raw = bytes.fromhex(hex_digest).ljust(8 * _DIGEST_WORDS, b"\0")
    return np.frombuffer(raw, dtype="<i8").tolist()


class TokenCacheWriter:
    """Streams the rows' conversations into the two cache files (temp paths), hashing as it writes.

    Args:
        tokens_path, index_path: where to write (the packer's temp names; published by the caller).
        packed_path: the rows file the cache is published beside (names the files in the sidecar entry).
        total_tokens: ``T``, the stored tokens of all conversations (sum of :func:`stored_length`); the
            ``.npy`` header needs it first.
        rows, conversations: ``R`` and ``C``.
        max_seq_len: ``L``.

    Call :meth:`add_rows` for the rows in order (in any grouping), then :meth:`finish`.
    """

    def __init__(self, tokens_path: str | Path, index_path: str | Path, packed_path: str | Path, total_tokens: int,
                 rows: int, conversations: int, max_seq_len: int):
        self.tokens_path, self.index_path = Path(tokens_path), Path(index_path)
        self._names = [p.name for p in cache_paths(packed_path)]
        self.max_seq_len = int(max_seq_len)
        self._file: IO[bytes] = open(self.tokens_path, "wb")
        self._out = HashingWriter(self._file)
        npy_format.write_array_header_1_0(
            self._out, {"descr": "<i4", "fortran_order": False, "shape": (int(total_tokens), 2)})
        self._data_start = self._out.size
        self._total = int(total_tokens)
        self._row_conv = np.zeros(rows + 1, dtype=np.int64)
        self._row_token = np.zeros(rows + 1, dtype=np.int64)
        self._lengths = np.zeros(conversations, dtype=np.int64)
        self._rows = self._conv = self._tokens = 0

    def add_rows(self, data, num_tokens, row_sizes) -> None:
        """Append whole rows (the packer's own counts: within those announced).

        Args:
            data: bytes-like, the rows' conversations' :func:`encode_conversation` bytes one after another:
                ``8 * sum(min(num_tokens, L))`` of them.
            num_tokens: int ``[c]``, each of those conversations' full length in tokens.
            row_sizes: int ``[r]``, conversations of each row (summing to ``c``).
        """
        num_tokens = np.asarray(num_tokens, dtype=np.int64)
        row_sizes = np.asarray(row_sizes, dtype=np.int64)
        stored = np.minimum(num_tokens, self.max_seq_len)
        c, r = len(num_tokens), len(row_sizes)
        assert memoryview(data).nbytes == 8 * int(stored.sum()) and int(row_sizes.sum()) == c, "rows and bytes differ"
        self._out.write(data)
        self._lengths[self._conv : self._conv + c] = num_tokens
        conv_ends = np.cumsum(row_sizes)
        token_ends = np.concatenate([[0], np.cumsum(stored)])[conv_ends]
        self._row_conv[self._rows + 1 : self._rows + 1 + r] = self._conv + conv_ends
        self._row_token[self._rows + 1 : self._rows + 1 + r] = self._tokens + token_ends
        self._rows, self._conv, self._tokens = self._rows + r, self._conv + c, self._tokens + int(stored.sum())

    def finish(self, rows_blake2b: str) -> dict[str, object]:
        """fsync the tokens file, write the index (fsynced), return the sidecar's ``token_cache`` entry.

        Args:
            rows_blake2b: the rows file's BLAKE2b-160 hex (stored in the index header).
        """
        written = (self._rows, self._conv, self._tokens)
        assert written == (len(self._row_conv) - 1, len(self._lengths), self._total), f"{written} not as announced"
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        header = [MAGIC, VERSION, self._rows, self._conv, self._tokens, self.max_seq_len,
                  *_digest_words(rows_blake2b)]
        index = np.concatenate([np.asarray(header, dtype=np.int64), self._row_conv, self._row_token, self._lengths])
        with open(self.index_path, "wb") as f:
            out = HashingWriter(f)
            npy_format.write_array_header_1_0(out, npy_format.header_data_from_array_1_0(index))
            out.write(index.astype("<i8", copy=False).tobytes())
            f.flush()
            os.fsync(f.fileno())
        return {"format_version": VERSION, "rows": self._rows, "conversations": self._conv,
                "stored_tokens": self._tokens,
                "tokens": file_fields(self.tokens_path, self._out.size, self._out.hexdigest(), self._names[0]),
                "index": file_fields(self.index_path, out.size, out.hexdigest(), self._names[1])}

    def close(self) -> None:
        """Close the tokens file without finishing (an aborted run; the caller removes the temp files)."""
        if not self._file.closed:
            self._file.close()


class TokenCache:
    """Read side: the ``(tokens, targets)`` of each conversation of row ``r``, from memory-mapped files.

    Args:
        packed_path: the rows file ``X.jsonl.packed`` (the cache files are found beside it).
        rows: the rows file's row count (from its index).
        max_seq_len: ``L`` the loader builds rows of.
        rows_blake2b: the rows file's BLAKE2b-160 its sidecar records, or ``None`` not to check it.

    Raises:
        FileNotFoundError: a cache file is missing.
        TokenCacheError: a file that is not a version-1 cache, or whose header disagrees (rows, ``L``, the
            rows file's hash, the token count), naming the file.

    Picklable (for ``spawn`` workers): the memory maps are dropped and reopened in each process.
    """

    def __init__(self, packed_path: str | Path, rows: int, max_seq_len: int, rows_blake2b: str | None = None):
        self.tokens_path, self.index_path = cache_paths(packed_path)
        self._rows, self._max_seq_len, self._rows_blake2b = int(rows), int(max_seq_len), rows_blake2b
        self._pid: int | None = None
        self._open()

    def _open(self) -> None:
        index = self._load(self.index_path, np.int64, 1)
        if index.size < HEADER or int(index[0]) != MAGIC or int(index[1]) != VERSION:
            raise TokenCacheError(f"{self.index_path}: not a version-{VERSION} packsft token cache index")
        rows, convs, tokens, length = (int(x) for x in index[2:6])
        digest = None if self._rows_blake2b is None else _digest_words(self._rows_blake2b)
        pairs = self._load(self.tokens_path, np.int32, 2)
        for path, found, wanted, says in (  # the index header against the files, then against the caller's values
                (self.index_path, index.size, HEADER + 2 * (rows + 1) + convs, "{} entries, its header describes {}"),
                (self.tokens_path, pairs.shape, (tokens, 2), "shape {}, its index describes {}"),
                (self.index_path, rows, self._rows, "{} rows, the rows file has {}"),
                (self.index_path, length, self._max_seq_len, "written for max_seq_len {}, the loader has {}"),
                (self.index_path, index[6:HEADER].tolist(), digest,
                 "written with another rows file (its BLAKE2b differs from the sidecar's rows_file)")):
            if wanted is not None and found != wanted:
                raise TokenCacheError(f"{path}: " + says.format(found, wanted))
        index, pairs = np.asarray(index), np.asarray(pairs)  # plain views of the maps: slicing a memmap is slow
        self._row_conv = index[HEADER:HEADER + rows + 1]
        self._row_token = index[HEADER + rows + 1:HEADER + 2 * (rows + 1)]
        self._lengths = index[HEADER + 2 * (rows + 1):]
        self._pairs, self._pid = pairs, os.getpid()

    @staticmethod
    def _load(path: Path, dtype, ndim: int) -> np.ndarray:
        try:
            array = np.load(path, mmap_mode="r", allow_pickle=False)
        except ValueError as e:
            raise TokenCacheError(f"{path}: not a .npy array ({e})") from e
        if array.dtype != np.dtype(dtype) or array.ndim != ndim:
            raise TokenCacheError(f"{path}: {array.dtype} of {array.ndim} dimension(s), expected {np.dtype(dtype)} "
                                  f"of {ndim}")
        return array

    def row(self, r: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Row ``r`` (``0 <= r < R``) as ``(tokens, targets, lengths)``: int32 ``[T_r]`` views of its
        conversations' stored ids and targets one after another (each at most ``L``), and int64 ``[n]`` their
        full lengths in tokens: the arguments of :func:`packsft.data.row.build_row_flat`."""
        if self._pid != os.getpid():
            self._open()
        block = self._pairs[int(self._row_token[r]):int(self._row_token[r + 1])]
        return block[:, 0], block[:, 1], self._lengths[int(self._row_conv[r]):int(self._row_conv[r + 1])]

    def trained_tokens_per_row(self, pad_id: int, chunk_rows: int = 1 << 16) -> np.ndarray:
        """int64 ``[R]``: each row's trained tokens as :func:`packsft.data.row.build_row_flat` counts them for a
        row that fits ``L`` (every row the packer writes): targets neither ``IGNORE_INDEX`` nor ``pad_id``, less
        each conversation's first token (no label crosses a conversation). Reads the targets column in blocks of
        ``chunk_rows`` rows; tokenizes nothing."""
        if self._pid != os.getpid():
            self._open()
        rows = len(self._row_token) - 1
        stored = np.minimum(self._lengths, self._max_seq_len)
        conv_start = np.concatenate([[0], np.cumsum(stored)[:-1]]).astype(np.int64)
        out = np.zeros(rows, dtype=np.int64)
        for a in range(0, rows, chunk_rows):
            b = min(rows, a + chunk_rows)
            lo, hi = int(self._row_token[a]), int(self._row_token[b])
            targets = self._pairs[lo:hi, 1]
            trained = ((targets != IGNORE_INDEX) & (targets != pad_id)).astype(np.int64)
            sums = np.concatenate([[0], np.cumsum(trained)])
            firsts = conv_start[int(self._row_conv[a]):int(self._row_conv[b])] - lo
            sums_at_first = np.concatenate([[0], np.cumsum(trained[firsts])])
            token_ends, conv_ends = self._row_token[a:b + 1] - lo, self._row_conv[a:b + 1] - self._row_conv[a]
            out[a:b] = np.diff(sums[token_ends]) - np.diff(sums_at_first[conv_ends])
        return out

    def __getstate__(self) -> dict[str, object]:
        """Pickle the paths and checks only (each process maps the files itself)."""
        return {k: v for k, v in self.__dict__.items() if k in
                ("tokens_path", "index_path", "_rows", "_max_seq_len", "_rows_blake2b")} | {"_pid": None}
