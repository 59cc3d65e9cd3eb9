"""``PackedSFTDataset``: map-style dataset over a ``.jsonl.packed`` file, one packed row per item.

The file is never held in memory: a byte-offset index of its rows (:mod:`packsft.data.row_index`) is built once
and cached beside it (``X.jsonl.packed.idx``), and ``__getitem__`` seeks to the row, parses it, splits it into
conversations at each system message (:func:`packsft.conversation.split_row`), tokenizes them with the packer's own
:func:`packsft.prompt_formats.tokenize_conversations` (``tokenize_conversation`` of each), and builds the tensors with
:func:`packsft.data.row.build_row` (Megatron-LM ``SFTDataset`` semantics, ``docs/loader.md``).

When the packer wrote a token cache beside the rows (:mod:`packsft.token_cache`) and the sidecar vouches for it,
``__getitem__`` reads the conversations' ``(tokens, targets)`` from it instead (memory-mapped, no parsing or
tokenizing) and feeds the same :func:`~packsft.data.row.build_row`: the tensors are identical. Without a cache
(or a sidecar recording one) the rows are re-tokenized, with one :class:`TokenCacheNotice` at open; a cache
that disagrees with its sidecar is refused (``SidecarError`` naming both files).

Reports (``PackedDataWarning``, once per row and process): a row whose conversations exceed ``max_seq_len``
(right-truncated; names file, line, lengths, what was cut), a row with no trained token (returned with an
all-zero ``loss_mask`` and ``num_trained_tokens == 0`` so sampler indices stay stable; the loss gives such a
micro-batch exactly 0), and a packed file without a sidecar.
"""

from __future__ import annotations

import dataclasses
import json
import os
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import PreTrainedTokenizerBase

from packsft.conversation import ConversationError, split_row
from packsft.data.repack import repack_hint
from packsft.data.row import build_row, build_row_flat
from packsft.data.row_index import COUNT, HEADER, KEY, build_index, file_fingerprint, index_is_current, rows_key
from packsft.io import atomic_open, finish_interrupted_publish, missing_file
from packsft.layout import check_max_seq_len
from packsft.prompt_formats import (
    PromptFormat,
    PromptFormatError,
    Tokenization,
    TokenizationSpec,
    tokenize_conversations,
)
from packsft.sidecar import (
    CACHE_SETTINGS,
    REPACK_INTRO,
    SidecarError,
    cache_settings_changed,
    check_rows_file,
    check_sidecar,
    check_token_cache,
    loader_expectation,
    read_sidecar,
    refuse_sidecar_as_rows,
    row_index_path,
    sidecar_path,
    special_tokens,
)
from packsft.token_cache import TokenCache, TokenCacheError, cache_paths
from packsft.tokenizer import load_tokenizer, tokenizer_fingerprint


class PackedDataWarning(UserWarning):
    """A packed row (or file) that loads, but not as packed: truncated, without trained token, or unverified."""


class TokenCacheNotice(PackedDataWarning):
    """A packed file without a usable token cache: its rows are re-tokenized at every read (slower, same tensors)."""


class RowError(ConversationError):
    """A packed row that cannot become tensors (read at a training or validation step), naming file, line and field.

    In a ``DataLoader`` worker it reaches the main process rebuilt by torch as ``RowError(text)``, ``text`` being
    ``Caught RowError in DataLoader worker process N. Original Traceback ...``: the error's own message, the text's
    last line, is kept.
    """

    def __init__(self, path: str | Path, line: int | None = None, field: str = "", reason: str = ""):
        if line is not None:
            super().__init__(path, line, field, reason)
            return
        text = str(path).rstrip().splitlines()[-1]
        for name in (f"{__name__}.RowError: ", "RowError: "):
            text = text.removeprefix(name)
        ValueError.__init__(self, text)
        self.path, self.line, self.field, self.reason = "", 0, "", text


def load_or_build_index(path: str | Path, index_path: str | Path | None = None, key: int = 0) -> np.ndarray:
    """Return the cached index of ``path``, rebuilding and re-caching it when missing or stale.

    Args:
        path: the packed file.
        index_path: where the index lives; default ``<path>.idx``.
        key: :func:`rows_key` of the file's sidecar, recorded in the index and compared with it.

    Returns:
        The int64 index array (memory-mapped when read from the cache).

    Raises:
        FileNotFoundError: ``path`` does not exist.
    """
    index_path = row_index_path(path, index_path)
    if index_path.is_file():
        try:
            index = np.load(index_path, mmap_mode="r", allow_pickle=False)
            if index_is_current(index, path, key):
                return index
        except (ValueError, OSError):
            pass  # unreadable or foreign file: rebuild
    index = build_index(path)
    index[KEY] = key
    try:
        with atomic_open(index_path, "wb") as f:
            np.save(f, index, allow_pickle=False)
    except OSError as e:  # read-only dataset folder: keep the index in memory
        warnings.warn(f"could not cache the row index at {index_path} ({e}); it is rebuilt on every load",
                      PackedDataWarning, stacklevel=2)
    return index


class PackedSFTDataset(torch.utils.data.Dataset):
    """Map-style dataset: item ``i`` is row ``i`` (the ``i``-th non-blank line) of a ``.jsonl.packed`` file.

    Args:
        path: the packed file (rows ``{"messages": [...]}``, ``docs/formats.md``).
        tokenizer: a fast Hugging Face tokenizer, or a local folder / ``tokenizer.json`` to load one from.
        prompt_format: a :class:`~packsft.prompt_formats.PromptFormat` bound to ``tokenizer``, or a
            :class:`~packsft.prompt_formats.TokenizationSpec` (its options left ``None`` are the sidecar's:
            :meth:`~packsft.prompt_formats.TokenizationSpec.with_packed`), or the name of one.
        max_seq_len: ``L``, tokens per row; a multiple of ``2 * context_parallel_size`` when CP > 1.
        context_parallel_size: CP size the rows are padded for (each conversation to a multiple of ``2 * cp``).
        pad_token, chat_template, train_on, chat_template_kwargs, append_eos: the spec's when ``prompt_format``
            is a name; ``None`` for the last three (default): the sidecar's (``all``, no kwargs and the template's
            default without a sidecar), so the loader masks exactly as the packer counted. Given values are
            checked against the sidecar.
        index_path: where the row index is cached; default ``<path>.idx``.
        require_sidecar: refuse (rather than warn about) a file without ``<path>.meta.json``.
        verify_rows_hash: check the rows file against the sidecar's ``rows_file`` BLAKE2b: ``None`` (default)
            for files up to :data:`packsft.sidecar.HASH_AUTO_LIMIT` bytes, ``True`` always, ``False`` never.
            Its size is always checked (:func:`packsft.sidecar.check_rows_file`). The same policy applies to
            each token cache file, whose size and first and last MiB are always checked
            (:func:`packsft.sidecar.check_token_cache`).
        use_token_cache: read token ids from the token cache when the sidecar records one (default); ``False``
            re-tokenizes every row (no notice).
        sequence_parallel_size: the TP size under sequence parallelism (1 without); ``max_seq_len`` must be a
            multiple of :func:`packsft.layout.row_granularity`. Conversations are padded for CP only, so a file
            packed without ``--sequence-parallel`` serves an SP run whenever its ``max_seq_len`` divides.

    Attributes (besides the arguments): ``tokenizer`` (loaded), ``tokenizer_fingerprint``
    (:func:`packsft.tokenizer.tokenizer_fingerprint`), ``sidecar`` (dict or ``None``).

    Items: ``tokens``, ``labels``, ``position_ids`` (int64 ``[L]``), ``loss_mask`` (float32 ``[L]``),
    ``cu_seqlens`` (int32 ``[segments + 1]``, real lengths), ``cu_seqlens_padded`` (int32 ``[segments + 1]``,
    padded offsets 0..``L``), ``max_seqlen`` (int), ``num_trained_tokens`` (int); see
    :func:`packsft.data.row.build_row`.

    Raises:
        FileNotFoundError: the packed file (or the tokenizer path) does not exist.
        SidecarError: the sidecar contradicts this configuration (names the field and the re-pack command),
            records another rows file or token cache (size or hash; names both files), or is missing and
            ``require_sidecar`` is set.
        ValueError: ``max_seq_len`` is not a positive multiple of the CP granularity.

    Picklable (for ``spawn`` workers): the open file handle is dropped and reopened in each process.
    """

    def __init__(
        self,
        path: str | Path,
        tokenizer: PreTrainedTokenizerBase | str | Path,
        prompt_format: PromptFormat | TokenizationSpec | str,
        max_seq_len: int,
        context_parallel_size: int = 1,
        *,
        pad_token: str | None = None,
        chat_template: str | Path | None = None,
        train_on: str | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        append_eos: bool | None = None,
        index_path: str | Path | None = None,
        require_sidecar: bool = False,
        sequence_parallel_size: int = 1,
        verify_rows_hash: bool | None = None,
        use_token_cache: bool = True,
    ):
        check_max_seq_len(max_seq_len, context_parallel_size, sequence_parallel_size)
        self.path = Path(path)
        finish_interrupted_publish(self.path)  # a packer killed while renaming: its new set is complete
        if not self.path.is_file():
            raise missing_file("packed file", self.path)
        refuse_sidecar_as_rows(self.path)
        self.tokenizer = load_tokenizer(tokenizer) if isinstance(tokenizer, (str, Path)) else tokenizer
        if isinstance(prompt_format, str):
            prompt_format = TokenizationSpec(str(getattr(self.tokenizer, "name_or_path", "")), prompt_format,
                                             pad_token, chat_template, chat_template_kwargs, train_on, append_eos)
        if isinstance(prompt_format, TokenizationSpec):
            packed = (read_sidecar(self.path) or {}).get("prompt_format")
            prompt_format = prompt_format.with_packed(packed).bind(self.tokenizer)
        # a Megatron preset tokenizes a conversation Megatron-LM accepts identically either way; this also
        # reads the packsft-only ones a file packed with --allow-non-megatron holds
        self.prompt_format = dataclasses.replace(prompt_format, allow_non_megatron=True)
        self.max_seq_len = max_seq_len
        self.context_parallel_size = context_parallel_size
        self.sidecar = self._check_sidecar(require_sidecar)
        self.rows_hash_checked = check_rows_file(self.sidecar, self.path, verify_rows_hash) if self.sidecar else False
        self.index_path = row_index_path(self.path, index_path)
        self._index = load_or_build_index(self.path, self.index_path, rows_key(self.sidecar))
        self.token_cache, self.token_cache_status = self._open_token_cache(use_token_cache, verify_rows_hash)
        self._fingerprint: str | None = None
        self._file = None
        self._file_pid: int | None = None
        self._reported: set[tuple[str, int]] = set()

    def _check_sidecar(self, require: bool) -> dict[str, Any] | None:
        meta = read_sidecar(self.path)
        self.tokenizer_fingerprint = tokenizer_fingerprint(self.tokenizer)
        expected = loader_expectation(self.tokenizer_fingerprint, self.prompt_format, self.max_seq_len,
                                      self.context_parallel_size, special_tokens(self.tokenizer, self.prompt_format))
        template = self.prompt_format.chat_template

        def hint() -> str:  # only for a refusal: it may read the packing report
            return repack_hint(self.path, meta or {}, self.prompt_format,
                               str(getattr(self.tokenizer, "name_or_path", "") or "<tokenizer>"),
                               self.max_seq_len, self.context_parallel_size,
                               custom_template=template is not None and template != self.tokenizer.chat_template)

        if meta is None:
            message = (f"{self.path} has no sidecar {sidecar_path(self.path).name}: its tokenizer, prompt format, "
                       f"pad, max_seq_len and context_parallel_size cannot be checked against the loader's (and "
                       f"its rows are re-tokenized: a token cache is used only with a sidecar)")
            if require:
                raise SidecarError(f"{message}. {REPACK_INTRO}:\n  {hint()}")
            warnings.warn(message, PackedDataWarning, stacklevel=3)
            return None
        check_sidecar(meta, expected, self.path, hint)
        if self.prompt_format.name == "identity" and meta.get("format_version") == 1:
            raise SidecarError(f"{self.path} was packed for identity by an earlier packsft, which trained every "
                               "token; identity now trains only assistant turns, as Megatron-LM does, so its rows "
                               f"would be masked differently from what was packed. {REPACK_INTRO}:\n"
                               f"  {hint()}")
        return meta

    def _open_token_cache(self, use: bool, verify_hash: bool | None) -> tuple[TokenCache | None, str]:
        """``(cache or None, status)``: the checked token cache, or why rows are re-tokenized (one notice)."""
        if not use:
            return None, "re-tokenized (use_token_cache=False)"
        if self.sidecar is None:
            return None, "re-tokenized (no sidecar)"
        tokens_path, index_path = cache_paths(self.path)
        if "token_cache" not in self.sidecar:
            reason = "its sidecar records no token cache (packed by an earlier packsft or with --no-token-cache)"
        elif not isinstance(self.sidecar.get("rows_file"), dict):  # nothing ties the cache to these rows' bytes
            reason = ("its sidecar records a token cache but not the rows file's size and hash (rows_file: the "
                      "sidecar was edited after packing)")
        elif cache_settings_changed(self.sidecar):
            reason = ("its token cache was written under other tokenizer or prompt-format settings than its sidecar "
                      f"now records ({', '.join(CACHE_SETTINGS)}: the sidecar was edited after packing)")
        elif not (tokens_path.is_file() and index_path.is_file()):
            missing = tokens_path if not tokens_path.is_file() else index_path
            reason = f"its token cache {missing.name} is " + ("not a file" if missing.exists() else "missing")
        else:
            hashed = check_token_cache(self.sidecar, self.path, verify_hash)
            try:
                cache = TokenCache(self.path, len(self), self.max_seq_len, self.sidecar["rows_file"].get("blake2b"))
            except TokenCacheError as e:
                raise SidecarError(f"{e}: it does not belong to {self.path} and its sidecar "
                                   f"{sidecar_path(self.path)}; delete the cache files to re-tokenize, or re-pack"
                                   ) from e
            return cache, f"token cache {tokens_path.name} ({'hash checked' if hashed else 'size and ends checked'})"
        warnings.warn(f"{self.path}: {reason}; rows are re-tokenized at every read (slower, same tensors; re-pack "
                      "to write the cache)", TokenCacheNotice, stacklevel=3)
        return None, f"re-tokenized ({reason})"

    def __len__(self) -> int:
        """Number of rows (non-blank lines) in the packed file."""
        return int(self._index[COUNT])

    @property
    def fingerprint(self) -> str:
        """Identity of the packed file for resume checks (see :func:`file_fingerprint`), hex str."""
        if self._fingerprint is None:
            self._fingerprint = file_fingerprint(self.path, self._index)
        return self._fingerprint

    def line_number(self, i: int) -> int:
        """1-based line number in the packed file of row ``i``."""
        return int(self._index[HEADER + len(self) + self._position(i)])

    def _position(self, i: int) -> int:
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"row {i} out of range for {self.path} with {n} rows")
        return int(i) % n

    def read_messages(self, i: int) -> list[dict[str, Any]]:
        """The ``messages`` list of row ``i`` as stored (one JSON line, read by seeking to its offset).

        The row's structure was checked when the index was built (:func:`build_index`), so it is not
        checked again here.

        Raises:
            IndexError: ``i`` out of range.
            RowError: no row at the index's offset: the file changed after its row index was built in a
                way the index key misses (no sidecar, same size and modification time).
        """
        pos = self._position(i)
        if self._file is None or self._file_pid != os.getpid():
            self._file, self._file_pid = open(self.path, "rb"), os.getpid()  # kept open for reuse
        self._file.seek(int(self._index[HEADER + pos]))
        try:
            return json.loads(self._file.readline())["messages"]
        except (ValueError, KeyError, TypeError) as e:
            raise RowError(self.path, self.line_number(pos), "", f"row {pos} is not at its row index's "
                           f"offset ({type(e).__name__}: {e}): the file changed after its index was "
                           f"built; delete {self.index_path} (rebuilt on the next load)") from e

    def tokenize_row(self, i: int) -> list[tuple[list[int], list[int]]]:
        """``(tokens, targets)`` of each conversation of row ``i``, as the packer counted them.

        Raises:
            RowError: the row is malformed, or a conversation fails to tokenize (names file, line and
                the conversation).
        """
        pos = self._position(i)
        conversations = split_row(self.read_messages(pos), self.path, self.line_number(pos), validate=False)
        pieces = tokenize_conversations([(c.messages, c.tools, c.chat_template_kwargs) for c in conversations],
                                        Tokenization.of(self.tokenizer, self.prompt_format))  # as the packer, a batch
        for k, got in enumerate(pieces):
            if isinstance(got, PromptFormatError):
                raise RowError(self.path, self.line_number(pos), f"conversation {k}", str(got)) from got
        return pieces

    def __getitem__(self, i: int) -> dict[str, Any]:
        """Row ``i`` as tensors (see the class docstring); warns once per row when truncated or untrained."""
        pos = self._position(i)
        pad, L, cp = self.prompt_format.pad_token_id, self.max_seq_len, self.context_parallel_size
        if self.token_cache is not None:  # the packer's ids (build_row_flat is build_row's own core)
            row, truncation = build_row_flat(*self.token_cache.row(pos), pad, L, cp)
        else:
            row, truncation = build_row(self.tokenize_row(pos), pad, L, cp)
        where = f"{self.path}:{self.line_number(pos)} (row {pos})"
        if truncation is not None:
            self._report("truncated", pos, f"{where} right-truncated to max_seq_len: {truncation.describe()}")
        if row["num_trained_tokens"] == 0:
            self._report("untrained", pos, f"{where} has no trained token (every label is masked); it is returned "
                                           "with an all-zero loss_mask and contributes 0 to the loss")
        return row

    def _report(self, kind: str, pos: int, message: str) -> None:
        if (kind, pos) not in self._reported:
            self._reported.add((kind, pos))
            warnings.warn(message, PackedDataWarning, stacklevel=3)

    def __getstate__(self) -> dict[str, Any]:
        """Pickle without the open file handle (each worker process opens its own)."""
        state = dict(self.__dict__)
        state["_file"], state["_file_pid"] = None, None
        state["_index"] = np.asarray(self._index)
        return state
