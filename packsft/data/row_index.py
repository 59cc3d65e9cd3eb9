"""The row index of a ``.jsonl.packed`` file: each row's byte offset and line, checked once when it is built.

Index file: a ``.npy`` array of int64, ``[MAGIC, INDEX_VERSION, file_size, file_mtime_ns, rows_key, n, start_0 ..
start_{n-1}, line_0 .. line_{n-1}]`` (byte offset and 1-based line number of each non-blank row; ``rows_key``: the
first 60 bits of the sidecar's ``rows_file.blake2b``, 0 without one). It is written atomically (temporary file +
``os.replace``) and rebuilt when the packed file's size, mtime or sidecar hash differs from the recorded ones (a
re-pack of the same size restored with the same mtime gets a new index); when the folder is read-only the index
is kept in memory only (:func:`packsft.data.dataset.load_or_build_index`).

:func:`file_fingerprint` is the file's cheap identity for the loader's resume check.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import numpy as np

from packsft.conversation import ConversationError, split_row
from packsft.sidecar import sidecar_path

INDEX_MAGIC = 0x504B5346545F4958  # "PKSFT_IX"
INDEX_VERSION = 2
HEADER = 6
KEY, COUNT = 4, 5  # header positions of rows_key and n
_FINGERPRINT_SPAN = 1 << 20  # bytes hashed at each end of the file


def build_index(path: str | Path) -> np.ndarray:
    """Scan a packed file once, check every row's structure, and return its index array (layout above).

    Each row must be a JSON object whose ``messages`` split into valid conversations (:func:`split_row`: a system
    message first, known roles, string contents, ...), so a corrupt row is reported when the dataset is opened,
    not at the training step that first reads it. Token counts are not checked here (that needs the tokenizer).

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ConversationError: a row that is not JSON or not a valid packed row, naming ``path``, its line and field.
    """
    stat = os.stat(path)
    starts, lines = [], []
    offset = 0
    with open(path, "rb") as f:
        for number, raw in enumerate(f, start=1):
            if raw.strip():
                _check_row(raw, path, number)
                starts.append(offset)
                lines.append(number)
            offset += len(raw)
    header = [INDEX_MAGIC, INDEX_VERSION, stat.st_size, stat.st_mtime_ns, 0, len(starts)]
    return np.asarray(header + starts + lines, dtype=np.int64)


def _check_row(raw: bytes, path: str | Path, line: int) -> None:
    try:
        record = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConversationError(path, line, "", f"not valid JSON: {e}") from e
    if not isinstance(record, dict):
        raise ConversationError(path, line, "", f"a packed row must be a JSON object, got {type(record).__name__}")
    split_row(record.get("messages"), path, line)


def index_is_current(index: np.ndarray, path: str | Path, rows_key: int) -> bool:
    """Whether ``index`` is this module's layout for ``path`` as it is now (size, mtime) and ``rows_key``."""
    stat = os.stat(path)
    return (index.ndim == 1 and index.size >= HEADER and index.dtype == np.int64
            and list(index[:HEADER - 1]) == [INDEX_MAGIC, INDEX_VERSION, stat.st_size, stat.st_mtime_ns, rows_key]
            and index.size == HEADER + 2 * int(index[COUNT]))


def rows_key(sidecar: dict[str, Any] | None) -> int:
    """The index's ``rows_key`` of a sidecar: the first 60 bits of its ``rows_file.blake2b``, 0 without one."""
    rows_file = (sidecar or {}).get("rows_file")
    digest = rows_file.get("blake2b") if isinstance(rows_file, dict) else None
    try:
        return int(str(digest)[:15], 16)
    except ValueError:
        return 0


def file_fingerprint(path: str | Path, index: np.ndarray) -> str:
    """Cheap identity of a packed file: SHA-256 (hex, 16 chars) of its size, first and last MiB, and sidecar.

    Hashing the whole file would cost a full read of a possibly many-GB file at every start; the packer
    rewrites the sidecar (with its counts) on every run, and any re-pack that changes rows changes the size
    or the ends in practice; its sidecar's ``rows_file`` records the BLAKE2b of the whole rows file, so a
    re-pack always changes the fingerprint. Not detected: an edit in the middle of the file that keeps its
    size and both ends, on a file without a sidecar (or without ``rows_file``). The mtime is left out so a
    copied file keeps its fingerprint.
    """
    size = int(index[2])
    h = hashlib.sha256(f"packsft-packed-v1:{size}:{int(index[COUNT])}".encode())
    with open(path, "rb") as f:
        h.update(f.read(_FINGERPRINT_SPAN))
        if size > _FINGERPRINT_SPAN:
            f.seek(max(_FINGERPRINT_SPAN, size - _FINGERPRINT_SPAN))
            h.update(f.read())
    side = sidecar_path(path)
    if side.is_file():
        h.update(side.read_bytes())
    return h.hexdigest()[:16]
