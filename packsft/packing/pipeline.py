"""The pack pipeline: JSONL conversations -> ``.jsonl.packed`` rows + sidecar + report.

Flow (outputs and formats: ``docs/packing.md``, ``docs/formats.md``):

1. The inputs are cut into line-aligned byte ranges (:func:`plan_shards`, independent of the worker count).
   Each shard is read (:func:`read_shard`), parsed, validated (:mod:`packsft.conversation`) and tokenized
   with :func:`packsft.prompt_formats.tokenize_conversation`, the loader's own tokenization, by
   :func:`count_shard`: in ``num_workers`` processes (a ``ProcessPoolExecutor``) or in this one. Invalid
   lines are *rejected* into the report with file, line (or row) and reason (or abort with ``strict=True``); line
   numbers are counted per shard and made absolute by the main process.
2. The normalised conversation (system message first, carrying its ``tools``) is appended to the worker's
   spool file; a shard comes back as numpy arrays (tokens, spool offset and size per conversation) and the
   few rejected, warned and oversize lines, so the main process holds no object per conversation.
   Lines over ``max_conversation_bytes`` are rejected unparsed. A worker that dies fails the run
   (:class:`PackError` naming its shard).
3. Conversations longer than ``max_seq_len`` follow the oversize policy: ``own-row`` (a row of their own, cut
   by the worker to :func:`own_row_window` tokens before counting, truncated to ``max_seq_len`` by the
   loader, with a warning), ``drop`` (reported) or ``error`` (abort).
   Conversations with no trained token, own-row conversations whose truncation removes every trained token,
   and a template that trains no stop signal are *warned* about and counted in the report.
4. The packing algorithm (:mod:`packsft.packing.algorithms`) assigns conversations to rows using costs
   ``ceil(n / 2cp) * 2cp``; rows (``{"messages": [...]}`` lines, hashed as written), sidecar
   ``<output>.meta.json`` (with the rows' size and hash), report and histogram go to temp names, then are
   renamed over the outputs as one unit (a roll-forward journal) with SIGTERM held off, the sidecar last
   (:func:`_publish`).
5. With ``token_cache`` (default) each worker also spools the ``(tokens, targets)`` of its conversations (int32,
   at most ``max_seq_len`` tokens each) beside its messages spool; they are written beside the rows as the
   token cache (:mod:`packsft.token_cache`), fingerprinted in the sidecar, so the loader reads token ids
   instead of re-tokenizing.

Row sources (Parquet, Arrow, ``datasets`` folders: :mod:`packsft.packing.sources`) cannot be cut into byte
ranges: each is one shard, read row by row and located by 0-based row index.

With ``engine="ray"`` steps 1-2 and the row writing run as Ray Data tasks on a Ray cluster
(:mod:`packsft.packing.ray_engine`), with the same code and the same output.

Output is a deterministic function of the inputs and settings: shard results are merged in input order,
neither the shard size nor the number of workers changes the output, and no step depends on hash order.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import gc
import json
import multiprocessing as mp
import os
import random
import re
import shutil
import signal
import stat
import sys
import tempfile
import threading
import time
import warnings
from array import array
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from packsft import __version__
from packsft.conversation import ConversationError, iter_jsonl_lines_sized, loads_line, parse_record
from packsft.io import (
    FileLock,
    HashingWriter,
    complete_publish,
    journal_path,
    lock_path,
    publish_files,
    stale_temps,
    temp_path,
)
from packsft.layout import check_max_seq_len, conversation_cost
from packsft.packing.algorithms import ALGORITHMS, lower_bound_rows, pack_order
from packsft.packing.ray_engine import ENGINES
from packsft.packing.sources import (
    check_source,
    count_word,
    entry_where,
    input_bytes,
    is_dataset_dict,
    is_row_source,
    iter_source,
    position,
    source_identity,
    where,
)
from packsft.prompt_formats import (
    MEGATRON_PRESETS,
    TRAIN_ON,
    NonMegatronError,
    PromptFormatError,
    get_prompt_format,
    tokenize_conversation,
    tokenize_conversations,
    unrendered,
)
from packsft.record_formats import ROW_JSON, RecordFormatError, adapter_identity, record_converter, source_field
from packsft.sidecar import (
    REPORT_SUFFIX,
    cache_settings_blake2b,
    efficiency,
    row_index_path,
    rows_file_fields,
    sidecar_path,
    sidecar_text,
    special_tokens,
)
from packsft.token_cache import TokenCacheWriter, cache_paths, encode_runs, stored_length
from packsft.tokenizer import load_tokenizer, tokenizer_fingerprint

OVERSIZE_POLICIES = ("own-row", "drop", "error")
_BATCH = 64
_BATCH_BYTES = 1 << 20
"""Input lines are tokenized in batches of up to :data:`_BATCH` lines and :data:`_BATCH_BYTES` bytes
(:func:`packsft.prompt_formats.tokenize_conversations`)."""
MAX_CONVERSATION_BYTES = 4 << 20
"""Default ``--max-conversation-bytes``: longer input lines are rejected before they are parsed (4 MiB)."""
STAGE_HOOK_ENV = "PACKSFT_PACK_STAGE_HOOK"
"""Test hook: ``STAGE:SIGNAL`` (e.g. ``rows_written:SIGKILL``) makes the packer send itself SIGNAL at STAGE."""
STAGES = ("tokenized", "rows_written", "sidecar_written", "report_written", "journal_written", "rows_published",
          "published")
"""The packer's publication stages, in order (see :func:`_stage`)."""
_STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
"""What stops a run; held off (:func:`_signals_held`) where their exception would leave work half done: while the
workers are forked, while temp files are removed and while the outputs are published."""


@dataclass
class PackConfig:
    """Settings of one packing run (the CLI's flags).

    Attributes:
        inputs: input JSONL files, read in order; also ``datasets`` ``save_to_disk`` folders and ``.parquet`` /
            ``.arrow`` files (:mod:`packsft.packing.sources`, located by row index instead of line).
        split: the split to read of a ``DatasetDict`` folder input.
        output: the ``.jsonl.packed`` file to write.
        tokenizer: local tokenizer folder or ``tokenizer.json``.
        max_seq_len: row length in tokens; a multiple of ``2 * context_parallel_size``.
        prompt_format: ``identity``, ``nemotron-nano-v2``, ``nemotron-h-aligned`` or ``chat-template``.
        chat_template: Jinja string or file for ``chat-template`` (default: the tokenizer's).
        chat_template_kwargs: ``apply_chat_template`` keyword arguments (a record's own override them).
        train_on: ``all`` assistant turns or only the ``last`` of each conversation.
        append_eos: append EOS to every trained assistant turn; ``None``: when the template writes no
            end of turn (see :func:`packsft.prompt_formats.get_prompt_format`).
        pad_token: overrides the prompt format's pad token.
        context_parallel_size: CP size the rows are padded for.
        sequence_parallel_size: the TP size of a run with sequence parallelism (1 without): ``max_seq_len``
            must then be a multiple of ``lcm(2 * cp, cp * tp)`` (:func:`packsft.layout.row_granularity`).
        algorithm: ``bfd-local-search`` (default), ``best-fit-decreasing`` or ``next-fit``.
        oversize: ``own-row``, ``drop`` or ``error`` for conversations longer than ``max_seq_len``.
        seed: seeds the row order when ``shuffle_rows`` is set; recorded in the sidecar.
        shuffle_rows: write rows in a seeded random order instead of creation order.
        num_workers: tokenizer processes (0 = in this process; with ``engine="ray"``: Ray Data actors, 0 = one
            per CPU of the cluster).
        engine: ``local`` (this machine: this process or ``num_workers`` processes) or ``ray`` (Ray Data tasks
            on a Ray cluster, :mod:`packsft.packing.ray_engine`; same output).
        ray_address: the cluster ``ray.init`` joins (``auto``, ``ray://host:10001``, ...); ``None``:
            ``$RAY_ADDRESS``, else a local instance.
        input_key, output_key: prompt/response records instead of ``messages``.
        record_format: ``messages``, ``input-output``, ``sharegpt`` or ``alpaca`` (``packsft.record_formats``).
        adapter: import path ``pkg.module:fn`` of a record -> ``{"messages", "tools"?}`` function (replaces
            ``record_format``); its path and file hash go into the sidecar.
        default_system_prompt: system content given to conversations without one.
        strict: abort at the first invalid record instead of reporting it.
        allow_non_megatron: keep (warned, kind ``non_megatron``) a conversation that a Megatron preset can
            tokenize but Megatron-LM's ``SFTTokenizer`` refuses, instead of rejecting it; the file is then
            packsft-only (sidecar ``megatron_lm_compatible: false``).
        report: JSON report path (default ``<output>.report.json``).
        histogram: PNG path (default ``<output>.lengths.png``); ``""`` disables it.
        progress: show a tqdm progress bar (bytes read of all inputs, with ETA).
        max_conversation_bytes: input lines (or rows' JSON) longer than this (bytes) are rejected into the
            report unparsed.
        token_cache: also write the rows' token ids and targets beside them (``<output>.tokens.npy`` and
            ``<output>.tokens-index.npy``, :mod:`packsft.token_cache`) so the loader need not re-tokenize.
        shard_bytes: bytes of JSONL input per shard, a worker's unit of work (default: see :func:`plan_shards`);
            the output does not depend on it nor on ``num_workers``.
    """

    inputs: list[str]
    output: str
    tokenizer: str
    max_seq_len: int
    prompt_format: str = "chat-template"
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    train_on: str = "all"
    append_eos: bool | None = None
    pad_token: str | None = None
    context_parallel_size: int = 1
    sequence_parallel_size: int = 1
    algorithm: str = "bfd-local-search"
    oversize: str = "own-row"
    seed: int = 1234
    shuffle_rows: bool = False
    num_workers: int = 0
    input_key: str | None = None
    record_format: str = "messages"
    adapter: str | None = None
    output_key: str | None = None
    default_system_prompt: str = ""
    strict: bool = False
    allow_non_megatron: bool = False
    report: str | None = None
    histogram: str | None = None
    progress: bool = True
    max_conversation_bytes: int = MAX_CONVERSATION_BYTES
    token_cache: bool = True
    split: str | None = None
    shard_bytes: int | None = None
    engine: str = "local"
    ray_address: str | None = None

    def validate(self) -> None:
        """Raise ``ValueError`` naming the bad setting."""
        if not self.inputs:
            raise ValueError("at least one --input is required")
        for p in self.inputs:
            check_source(p, self.split)
        if self.split is not None and not any(is_dataset_dict(p) for p in self.inputs):
            raise ValueError(f"--split {self.split}: no --input is a DatasetDict folder (dataset_dict.json)")
        check_max_seq_len(self.max_seq_len, self.context_parallel_size, self.sequence_parallel_size)
        if self.algorithm not in ALGORITHMS:
            raise ValueError(f"--algorithm {self.algorithm!r}: choose one of {', '.join(ALGORITHMS)}")
        if self.oversize not in OVERSIZE_POLICIES:
            raise ValueError(f"--oversize {self.oversize!r}: choose one of {', '.join(OVERSIZE_POLICIES)}")
        record_converter(self.record_format, self.adapter)          # an unknown format or adapter fails here
        if self.record_format == "input-output" and not self.input_key:
            raise ValueError("--format input-output needs --input-key and --output-key")
        if bool(self.input_key) != bool(self.output_key):
            raise ValueError("--input-key and --output-key must be given together")
        if self.input_key and (self.adapter or self.record_format not in ("messages", "input-output")):
            raise ValueError(f"--input-key/--output-key read prompt/response records (--format input-output); "
                             f"{'--adapter' if self.adapter else '--format ' + self.record_format} records have "
                             "their own fields")
        if self.train_on not in TRAIN_ON:
            raise ValueError(f"--train-on {self.train_on!r}: choose one of {', '.join(TRAIN_ON)}")
        if self.chat_template_kwargs is not None and not isinstance(self.chat_template_kwargs, dict):
            raise ValueError("--chat-template-kwargs must be a JSON object, e.g. '{\"enable_thinking\": false}'")
        for name, value in (("--default-system-prompt", self.default_system_prompt),
                            ("--chat-template-kwargs", self.chat_template_kwargs)):
            try:
                json.dumps(value, ensure_ascii=False).encode("utf-8")
            except (UnicodeEncodeError, TypeError) as e:
                raise ValueError(f"{name}: not valid text ({e})") from None
        if self.engine not in ENGINES:
            raise ValueError(f"--engine {self.engine!r}: choose one of {', '.join(ENGINES)}")
        if self.ray_address is not None and self.engine != "ray":
            raise ValueError("--ray-address needs --engine ray")
        if self.num_workers < 0:
            raise ValueError(f"--num-workers must be >= 0, got {self.num_workers}")
        if Path(self.output).is_dir():
            raise ValueError(f"--output {self.output} is a directory; give the .jsonl.packed file to write")
        if self.shard_bytes is not None and self.shard_bytes < 1:
            raise ValueError(f"shard_bytes must be >= 1, got {self.shard_bytes}")
        if self.max_conversation_bytes < 1:
            raise ValueError(f"--max-conversation-bytes must be >= 1, got {self.max_conversation_bytes}")
        written = {_OUTPUT_NAMES[key]: path for key, path in _output_paths(self).items()}
        for i, p in enumerate(self.inputs):
            for q in self.inputs[:i]:
                if _same_file(q, p):
                    raise ValueError(f"--input {p} is given twice (also as {q}): its conversations would be packed "
                                     "twice; to train on a source more often, weight it in the training mixture")
            for what, out in written.items():
                if _same_file(p, out):
                    raise ValueError(f"--input {p} is also the {what} path {out}: packing would overwrite its "
                                     "own input; write the output elsewhere")
            if _same_file(p, row_index_path(self.output)):
                raise ValueError(f"--input {p} is the path of the loader's row index of {self.output}: loading the "
                                 "rows would overwrite it; rename the input or write the output elsewhere")
        targets: dict[tuple[Path, str], str] = {}
        for what, out in written.items():
            _check_output_target(what, out)
            key = (Path(out).parent.resolve(), Path(out).name)  # the entry a rename replaces
            if key in targets:
                raise ValueError(f"{what} {out} is also the {targets[key]} path: one output would replace the "
                                 "other; give each its own path")
            targets[key] = what


def _check_output_target(what: str, path: str) -> None:
    """Refuse an output path whose existing entry a rename cannot or must not replace (a folder, a device)."""
    try:
        mode = os.lstat(path).st_mode
    except OSError:
        return  # nothing there yet (or a folder that _check_writable reports)
    if stat.S_ISDIR(mode):
        raise ValueError(f"{what} {path} is a directory; give the file to write")
    if stat.S_ISLNK(mode):      # the rename replaces the link; refuse one to a device or pipe (/dev/stdout) alike
        try:
            mode = os.stat(path).st_mode
        except OSError:
            return              # a dangling link: replaced by the file
    if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
        hint = " (--histogram '' writes none)" if what == "--histogram" else ""
        raise ValueError(f"{what} {path} is not a regular file (a device, pipe or socket): the packer publishes "
                         f"its outputs by renaming files over their paths, which would replace it; give a file "
                         f"path{hint}")


def _same_file(a: str, b: str) -> bool:
    if os.path.exists(b):
        return os.path.samefile(a, b)
    return Path(a).resolve() == Path(b).resolve()


class PackWarning(UserWarning):
    """A conversation or setting that packs but may not train as intended (also listed in the report)."""


class PackError(RuntimeError):
    """A packing run stopped: strict mode met an invalid record, or an oversize conversation with ``error``."""


# ---------------------------------------------------------------- worker side
_W: dict[str, Any] = {}


def _prompt_format(cfg: PackConfig, tok):
    return get_prompt_format(cfg.prompt_format, tok, pad_token=cfg.pad_token, chat_template=cfg.chat_template,
                             train_on=cfg.train_on, chat_template_kwargs=cfg.chat_template_kwargs,
                             append_eos=cfg.append_eos)


def _init_worker(cfg: PackConfig, spool_dir: str, in_worker: bool, tok=None) -> None:
    """Set up this process to read shards: tokenizer (``tok``, else loaded), prompt format, record converter."""
    if in_worker:
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # the main process stops the workers
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a forked worker inherits the packer's handler
        signal.pthread_sigmask(signal.SIG_UNBLOCK, _STOP_SIGNALS)  # blocked while the packer forked (_shard_results)
        _exit_with_parent(os.getppid())
    tok = tok if tok is not None else load_tokenizer(cfg.tokenizer)
    fmt = _prompt_format(cfg, tok)
    _W.clear()
    _W.update(cfg=cfg, tok=tok, fmt=fmt, lenient=dataclasses.replace(fmt, allow_non_megatron=True),
              convert=record_converter(cfg.record_format, cfg.adapter), spool_dir=spool_dir, in_worker=in_worker)


def _exit_with_parent(parent: int, poll: float = 0.5) -> None:
    """End this worker process soon after the packer that spawned it is gone (a ``kill -9`` of the packer
    leaves nobody to stop it): a daemon thread polls the parent pid every ``poll`` seconds."""

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(poll)
        os._exit(1)

    threading.Thread(target=watch, name="packsft-parent-watch", daemon=True).start()


def _close_worker() -> None:
    """Close this process's spools and forget its state (after an in-process run)."""
    for key in ("spool", "token_spool"):
        if key in _W:
            _W[key].close()
    _W.clear()


def own_row_window(max_seq_len: int) -> tuple[int, int]:
    """Token counts ``(low, high)`` an own-row conversation is cut to by the packer: ``L + 8 .. L + margin``.

    ``margin = max(32, L // 16)``. At least 8 tokens beyond ``L`` stay so that the loader's truncation, not
    the template's end of turn after a cut message, ends the row (the model is not taught to stop mid-text).
    """
    return max_seq_len + 8, max_seq_len + max(32, max_seq_len // 16)


def _message_chars(m: dict[str, Any]) -> int:
    return len(ROW_JSON(m))


def _content_chars(m: dict[str, Any]) -> int:
    """At most :func:`_message_chars`: the string content's length (no JSON for a plain text message)."""
    content = m.get("content")
    if isinstance(content, str) and "tool_calls" not in m:
        return len(content)
    return _message_chars(m)


def _cut_messages(messages: list[dict[str, Any]], budget: int, train_on: str,
                  sizes: list[int] | None = None) -> tuple[list[dict[str, Any]], bool]:
    """The longest prefix of ``messages`` within ``budget`` JSON characters, the last kept content cut short.

    At least the system message and one more are kept. A message whose string content does not fit is kept
    with a prefix of its content (never emptied); one that cannot be cut so (or an assistant turn with
    ``tool_calls``, which templates render after the content) is dropped with all after it. With
    ``train_on == "last"`` and the last assistant turn dropped, the kept assistant turns get ``weight: 0``
    (what the loader's truncation of the whole conversation would have trained: nothing of them).

    Args:
        sizes: ``_message_chars`` of each message, when known.

    Returns:
        ``(messages, cut)``: new message dicts; ``cut`` is False when all of ``messages`` fit.
    """
    kept: list[dict[str, Any]] = []
    left = budget
    for i, m in enumerate(messages):
        size = sizes[i] if sizes is not None else _message_chars(m)
        if size <= left:
            kept.append(m)
            left -= size
            continue
        content = m.get("content")
        # an assistant turn's tool calls are rendered after its content: a cut content would be followed by them
        # in the row, a reply the assistant never gave, so such a turn is kept whole or dropped, never cut
        cuttable = isinstance(content, str) and not m.get("tool_calls")
        room = left - (size - len(content)) if cuttable else 0
        if i == 0:  # the system message: cut (possibly to ""), then keep one more
            kept.append({**m, "content": content[:max(room, 0)]} if isinstance(content, str) else m)
            left = 0
            continue
        if room > 0 and content[:room].strip():
            kept.append({**m, "content": content[:room]})
        elif len(kept) < 2 and i >= 1:  # keep one non-system message whatever it costs
            kept.append({**m, "content": content[:max(room, 1)]} if cuttable and content else m)
        break
    else:
        return list(messages), False
    if train_on == "last":
        last = max((i for i, m in enumerate(messages) if m["role"] == "assistant"), default=-1)
        if last >= len(kept):
            kept = [{**m, "weight": 0} if m["role"] == "assistant" else m for m in kept]
    return kept, True


def _tokenize_record(conv, tok, fmt, cfg: PackConfig, first=None, known=None):
    """``(conv, tokens, runs, cut, uncut)``: ``conv`` tokenized with ``fmt`` (own-row: cut to its window first),
    its targets as runs (``tokenize_conversation(..., runs=True)``), and ``uncut``: ``(tokens, exact)``, the
    length of the conversation as given, before any cut (:func:`_fit_own_row`).

    ``first``: when already computed (:func:`_process_lines`, where :func:`_tokenized_whole` is true), the
    result of ``tokenize_conversation(..., runs=True)`` on the whole ``conv`` with ``fmt``, or the error it
    raised; ``known``: the ids of its segment texts (``known`` of ``tokenize_conversation``), reused by the cuts.
    """
    cut = False
    if cfg.oversize == "own-row":
        msgs, tokens, runs, cut, uncut = _fit_own_row(conv, tok, fmt, cfg, first, known)
        if cut:
            conv = type(conv)(messages=msgs, tools=conv.tools, path=conv.path, line=conv.line,
                              meta=conv.meta, chat_template_kwargs=conv.chat_template_kwargs)
    else:
        tokens, runs = _whole(conv, tok, fmt, first)
        uncut = (len(tokens), True)
    return conv, tokens, runs, cut, uncut


def _whole(conv, tok, fmt, first=None, known=None):
    """``tokenize_conversation(..., runs=True)`` of the whole ``conv``: ``first`` when given (raised when an error)."""
    if first is None:
        return tokenize_conversation(conv.messages, tok, fmt, conv.tools, conv.chat_template_kwargs, known,
                                     runs=True)
    if isinstance(first, PromptFormatError):
        raise first
    return first


def _tokenized_whole(conv, cfg: PackConfig) -> bool:
    """Whether :func:`_tokenize_record` starts by tokenizing the whole ``conv`` (own-row: unless it is long)."""
    return cfg.oversize != "own-row" or \
        sum(map(_content_chars, conv.messages)) <= 8 * own_row_window(cfg.max_seq_len)[1]


def _fit_own_row(conv, tok, fmt, cfg: PackConfig, first=None, known=None):
    """Tokenize ``conv``, cutting it (:func:`_cut_messages`) into :func:`own_row_window` when it is longer.

    A conversation whose contents have at most ``8 * high`` characters is first tokenized whole (kept when it
    fits). Work is bounded by a few tokenizations of about ``L`` tokens, whatever the conversation's length:
    the character budget starts at ``8 * high`` and is doubled, then bisected (with a proportional guess).
    Each try renders the cut conversation but encodes only the segment texts not encoded before (``known``):
    with ``chat-template`` and ``passthrough`` mostly the segment the cut falls in (the presets also encode
    each try's whole text).

    Args:
        first, known: as in :func:`_tokenize_record`.

    Returns:
        ``(messages, tokens, runs, cut, uncut)``: the messages to store and their tokenization (targets as
        runs); ``uncut = (n, exact)``: the whole conversation's tokens, or (``exact`` false: it was not
        tokenized whole) an estimate, the stored tokens scaled by the characters of all the messages over
        those of the stored ones.

    Raises:
        PromptFormatError: the conversation (or every cut of it tried) does not tokenize.
    """
    low, high = own_row_window(cfg.max_seq_len)
    known = {} if known is None else known  # each segment text's ids: a cut encodes only the texts it changed
    whole = None  # the uncut conversation's (tokens, runs), once known
    if first is not None or _tokenized_whole(conv, cfg):  # most conversations: tokenized whole, once
        whole = _whole(conv, tok, fmt, first, known)
        if len(whole[0]) <= high:
            return conv.messages, *whole, False, (len(whole[0]), True)
    sizes = [_message_chars(m) for m in conv.messages]
    total = sum(sizes)

    def done(msgs, tokens, runs, cut):
        if whole is not None:
            return msgs, tokens, runs, cut, (len(whole[0]), True)
        kept = sum(map(_message_chars, msgs)) if cut else total
        return msgs, tokens, runs, cut, (max(len(tokens), round(len(tokens) * total / max(1, kept))), not cut)

    budget = min(total, 8 * high)
    lo, hi = 0, None  # budgets known to give fewer than `low` tokens / more than `high`
    best = None  # the smallest cut seen above `low` (used if the window is never hit)
    error = None
    for _ in range(24):
        msgs, cut = _cut_messages(conv.messages, budget, cfg.train_on, sizes)
        try:
            tokens, runs = whole if whole is not None and not cut else \
                tokenize_conversation(msgs, tok, fmt, conv.tools, conv.chat_template_kwargs, known, runs=True)
        except PromptFormatError as e:  # a cut the format cannot render: try a shorter one
            if not cut:
                raise
            error, hi, n = e, budget, None
        else:
            n = len(tokens)
            if not cut and n <= high:
                return done(msgs, tokens, runs, False)
            if low <= n <= high:
                return done(msgs, tokens, runs, True)
            if n > high:
                hi = budget
                if best is None or n < len(best[1]):
                    best = (msgs, tokens, runs, cut)
            else:
                lo = budget
        if hi is None:
            guess = budget * 2 if not n else max(budget * 2, int(budget * high / n))
            budget = min(total, guess)
        else:
            guess = int(budget * (low + high) / 2 / n) if n else (lo + hi) // 2
            budget = guess if lo < guess < hi else (lo + hi) // 2
        if hi is not None and hi - lo <= 1:
            break
    if best is not None:
        return done(*best)
    raise error or PromptFormatError("the conversation could not be cut to max_seq_len")


def _process_lines(path: str, items: list[tuple[int, int, str | None, str | None]]) -> list[tuple]:
    """Parse, validate and tokenize a batch of input lines or rows (in a worker), as ``read_shard`` yields them.

    The whole conversations are tokenized together (:func:`packsft.prompt_formats.tokenize_conversations`);
    under ``own-row`` a conversation longer than :func:`own_row_window` is then cut there
    (:func:`_fit_own_row`), and the stored, cut conversation is the one counted.

    Returns:
        Per line, ``(counts, row_messages_json, None, cut, tokens, runs)`` for a good line, with ``counts`` =
        ``(num_tokens, trained, trained_in_row, notes, uncut)`` (``trained``: tokens the model is trained to
        predict, or at least 1 for a cut conversation (its cut-off part is not counted); ``trained_in_row``:
        those within the first ``max_seq_len`` tokens, what the loader's truncation keeps; ``notes``: its
        warnings ``(kind, message)``: ``non_megatron`` (kept with ``--allow-non-megatron``) and those of
        :func:`packsft.prompt_formats.unrendered`; ``uncut``: ``(tokens, exact)`` before the packer's cut
        (:func:`_fit_own_row`); ``cut``: the packer cut it; ``tokens``: list
        of int ids, ``runs``: their targets as runs, ``tokenize_conversation(..., runs=True)``), or
        ``(None, None, reason, False, None, None)`` for a rejected line.
    """
    cfg, tok, fmt = _W["cfg"], _W["tok"], _W["fmt"]
    parsed: list = []  # per line: (conv, record, source), or its rejection
    for line, _, text, decode_error in items:
        try:
            parsed.append(_parse_line(cfg, path, line, text, decode_error))
        except ConversationError as e:
            parsed.append(_rejected(f"{e.field + ': ' if e.field else ''}{e.reason}"))
    whole = [i for i, p in enumerate(parsed) if p[0] is not None and _tokenized_whole(p[0], cfg)]
    known = [{} for _ in whole] if cfg.oversize == "own-row" else None  # kept for the cuts of long ones
    first = dict(zip(whole, tokenize_conversations(
        [(parsed[i][0].messages, parsed[i][0].tools, parsed[i][0].chat_template_kwargs) for i in whole], tok, fmt,
        known, runs=True)))
    memo = dict(zip(whole, known)) if known else {}
    return [p if p[0] is None else _finish_line(cfg, tok, fmt, *p, first.get(i), memo.get(i))
            for i, p in enumerate(parsed)]


def _rejected(reason: str) -> tuple:
    return None, None, reason, False, None, None


def _parse_line(cfg: PackConfig, path: str, line: int, text: str | None, decode_error: str | None):
    """``(conv, record, source)`` of one input line: its :class:`Conversation`, its record (converted) and the
    record as read.

    Raises:
        ConversationError: the line is not a valid record (naming the input's own field).
    """
    record = loads_line(text, path, line, decode_error)
    source = record
    if _W["convert"] is not None:
        try:
            record = _W["convert"](record)
        except RecordFormatError as e:
            raise ConversationError(path, line, "", str(e)) from e
    try:
        conv = parse_record(record, path, line, input_key=cfg.input_key, output_key=cfg.output_key,
                            default_system_prompt=cfg.default_system_prompt)
    except ConversationError as e:  # name the input's own field (ShareGPT's conversations[j].value)
        e.field = source_field(cfg.record_format, source, e.field)
        raise
    return conv, record, source


def _finish_line(cfg: PackConfig, tok, fmt, conv, record, source, first, known=None) -> tuple:
    """One line's :func:`_process_lines` result, from its parsed conversation, ``first`` and ``known`` (as in
    :func:`_tokenize_record`)."""
    try:
        non_megatron = None
        try:
            conv, tokens, runs, cut, uncut = _tokenize_record(conv, tok, fmt, cfg, first, known)
        except NonMegatronError as e:
            if not cfg.allow_non_megatron:
                raise
            non_megatron = _input_turn(e, record, source, cfg.record_format)  # the input's own message index
            conv, tokens, runs, cut, uncut = _tokenize_record(conv, tok, _W["lenient"], cfg, known=known)
    except PromptFormatError as e:
        return _rejected(f"{cfg.prompt_format}: {_input_turn(e, record, source, cfg.record_format)}")
    n = len(tokens)
    trained = _trained_in(runs, 1, n)  # targets[1:], the tokens predicted
    in_row = trained if n <= cfg.max_seq_len else _trained_in(runs, 1, cfg.max_seq_len)
    notes = unrendered(conv.messages, conv.tools, fmt)
    if non_megatron is not None:
        notes.insert(0, ("non_megatron", f"kept with --allow-non-megatron (packsft-only): {non_megatron}"))
    counts = (n, max(1, in_row) if cut else trained, in_row, notes, uncut)
    return counts, ROW_JSON(conv.to_row_messages()), None, cut, tokens, runs


def _trained_in(runs: list[int], start: int, end: int) -> int:
    """Trained tokens among positions ``[start, end)`` of a conversation whose targets are ``runs``."""
    count = pos = 0
    for r in runs:
        nxt = pos + abs(r)
        if r > 0 and nxt > start:
            count += min(nxt, end) - max(pos, start)
        pos = nxt
        if pos >= end:
            break
    return count


def _runs_head(runs: list[int], k: int) -> list[int]:
    """The runs of the first ``k`` tokens."""
    out: list[int] = []
    pos = 0
    for r in runs:
        if pos + abs(r) >= k:
            if k > pos:
                out.append(k - pos if r > 0 else pos - k)
            return out
        out.append(r)
        pos += abs(r)
    return out


def _input_turn(e: PromptFormatError, record, source, record_format: str) -> str:
    """``e`` with its message index in the input's own numbering: the packer's system message (added when the
    record's ``messages`` start without one) is not counted, and a converted record names its own field."""
    given = record.get("messages") if isinstance(record, dict) else None
    if e.turn is None or not isinstance(given, list):
        return str(e)
    added = int(not (given and isinstance(given[0], dict) and given[0].get("role") == "system"))
    if added and e.turn == 0:
        return f"the system message the packer adds: {e.reason}"
    return f"{source_field(record_format, source, f'messages[{e.turn - added}]')}: {e.reason}"


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
            tokens before the packer's cut, an estimate unless ``exact``; the counts as in :func:`_process_lines`).
        nbytes: bytes of input read.
        trained_fitting: accepted conversations of at most ``max_seq_len`` cost with a trained token.
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


def _worker_spool(key: str = "spool"):
    """This process's spool file ``key`` (``spool``: messages JSON, ``token_spool``: token cache bytes), opened
    at its first shard, appended to, flushed after each shard (named by the process id, or with
    ``_W["spool_name"]`` set, by that: the Ray engine's one spool per shard)."""
    if key not in _W:
        name = _W.get("spool_name", os.getpid())
        path = os.path.join(_W["spool_dir"], f"{'tokens' if key == 'token_spool' else 'spool'}.{name}")
        _W[key] = open(path, "wb" if "spool_name" in _W else "ab")  # noqa: SIM115 (open for the process's lifetime)
        _W[key + "_path"] = path
    return _W[key], _W[key + "_path"]


def count_shard(shard: Shard) -> ShardResult:
    """Read, validate, tokenize and count one shard, spooling the accepted conversations (in a worker).

    With ``token_cache`` the int32 token ids and targets (:func:`packsft.token_cache.encode_conversation`) go
    to a second per-worker spool next to the messages JSON, their offsets returned as an array.
    """
    import numpy as np

    cfg = _W["cfg"]
    # which shard this worker reads, should it die (an in-process run has nobody to tell)
    marker = os.path.join(_W["spool_dir"], f"worker.{os.getpid()}") if _W["in_worker"] else None
    if marker:
        with open(marker, "w") as f:
            f.write(str(shard.index))
    _worker_hook(shard.index)
    spool, spool_path = _worker_spool()
    token_spool, token_spool_path = _worker_spool("token_spool") if cfg.token_cache else (None, None)
    path = cfg.inputs[shard.file_idx]
    L, cp = cfg.max_seq_len, cfg.context_parallel_size
    ntok, offsets, sizes, token_offsets = array("i"), array("q"), array("q"), array("q")
    rejected, warns, oversize = [], [], []
    lines = conversations = nbytes_total = trained_fitting = 0
    total: list[int] = []

    def shard_lines():
        total.append((yield from read_shard(cfg, shard)))  # the reader returns the shard's line count

    # spool bytes are gathered and written in blocks (a few MiB), their offsets counted here
    msg_block, tok_block, run_block = [], [], []
    spool_pos = spool.tell()
    token_pos = token_spool.tell() if token_spool is not None else 0

    def write_block() -> None:
        spool.write(b"".join(msg_block))
        msg_block.clear()
        if token_spool is not None:
            token_spool.write(encode_runs(tok_block, run_block))
            tok_block.clear()
            run_block.clear()

    def batches():  # of _BATCH lines and _BATCH_BYTES at most (one longer line alone)
        batch, size = [], 0
        for item in shard_lines():
            if batch and (len(batch) == _BATCH or size + item[1] > _BATCH_BYTES):
                yield batch
                batch, size = [], 0
            batch.append(item)
            size += item[1]
        if batch:
            yield batch

    def processed():
        for batch in batches():
            yield from zip(batch, _process_lines(path, batch))

    for (line, nbytes, _, _), (counts, msgs_json, reason, cut, tokens, runs) in processed():
        lines, conversations, nbytes_total = line, conversations + 1, nbytes_total + nbytes
        if reason is not None:
            rejected.append((line, reason))
            if cfg.strict:
                break
            continue
        n, trained, trained_in_row, notes, (uncut, exact) = counts
        warns.extend((kind, line, message) for kind, message in notes)
        if trained == 0:
            warns.append(("no_trained_token", line, "conversation has no trained token (no assistant turn to "
                          "train: empty, weight 0, or not the last with --train-on last); it is packed as context "
                          "only"))
        if conversation_cost(n, cp) > L:
            oversize.append((len(ntok), line, n, cut, uncut, exact, nbytes, trained, trained_in_row))
        elif trained_in_row:
            trained_fitting += 1
        data = msgs_json.encode("utf-8")
        ntok.append(n)
        offsets.append(spool_pos)
        sizes.append(len(data))
        spool_pos += len(data)
        msg_block.append(data)
        if token_spool is not None:  # encode_conversation's bytes: the first stored_length(n, L) pairs
            k = stored_length(n, L)
            token_offsets.append(token_pos)
            token_pos += 8 * k
            tok_block.extend(tokens if k == n else tokens[:k])
            run_block.extend(runs if k == n else _runs_head(runs, k))
        if len(msg_block) >= 1024 or len(tok_block) >= 1 << 20:
            write_block()
    write_block()
    spool.flush()
    if token_spool is not None:
        token_spool.flush()
    if marker:
        with open(marker, "w") as f:  # this shard is done: a death from now on is not its fault
            f.write(f"{shard.index} done")
    if "spool_name" in _W:  # one spool per shard: closed, so that other hosts see all of it
        for key in ("spool", "token_spool"):
            if key in _W:
                os.fsync(_W[key].fileno())
                _W.pop(key).close()
    lines = total[0] if total else lines
    return ShardResult(shard, lines, conversations, spool_path, np.frombuffer(ntok, np.int32),
                       np.frombuffer(offsets, np.int64), np.frombuffer(sizes, np.int64), rejected, warns,
                       oversize, nbytes_total, token_spool_path,
                       np.frombuffer(token_offsets, np.int64) if token_spool is not None else None,
                       trained_fitting)


WORKER_HOOK_ENV = "PACKSFT_PACK_WORKER_HOOK"
"""Test hook: ``SHARD:SIGNAL`` (e.g. ``1:SIGKILL``) makes the worker reading shard SHARD send itself SIGNAL."""


def _worker_hook(index: int) -> None:
    shard, _, sig = os.environ.get(WORKER_HOOK_ENV, "").partition(":")
    if shard == str(index) and _W.get("in_worker"):
        os.kill(os.getpid(), getattr(signal, sig or "SIGKILL"))
        time.sleep(1)


@dataclass
class PackReport:
    """What a packing run did (printed, and written as JSON).

    Token counts are in tokens; :attr:`efficiency` and :attr:`pack_factor` are derived from them.
    """

    input_conversations: int = 0
    packed_conversations: int = 0
    rows: int = 0
    real_tokens: int = 0
    padding_tokens: int = 0
    lower_bound_rows: int = 0
    oversize: list[dict[str, Any]] = field(default_factory=list)
    rejected: list[dict[str, Any]] = field(default_factory=list)
    warnings: list[dict[str, Any]] = field(default_factory=list)
    per_input: dict[str, dict[str, int]] = field(default_factory=dict)
    settings: dict[str, Any] = field(default_factory=dict)
    outputs: dict[str, str] = field(default_factory=dict)
    rows_file: dict[str, Any] = field(default_factory=dict)  # {size, blake2b} of the rows written
    working_dir: str = ""  # where the packer ran: its relative input paths start there (the re-pack hint)

    def __post_init__(self):
        self._seen: dict[str, int] = {}  # warnings per kind (not a field: not in the JSON)

    @property
    def efficiency(self) -> float:
        """Real tokens / (rows * max_seq_len), 0.0 before packing."""
        return efficiency(self.real_tokens, self.padding_tokens)

    @property
    def pack_factor(self) -> float:
        """Conversations per row."""
        return self.packed_conversations / self.rows if self.rows else 0.0

    def to_dict(self) -> dict[str, Any]:
        """The report as written to JSON: the fields plus ``efficiency`` and ``pack_factor``."""
        return {**asdict(self), "efficiency": self.efficiency, "pack_factor": self.pack_factor,
                "warning_counts": self.warning_counts()}

    def warning_counts(self) -> dict[str, int]:
        """Number of warnings of each kind (``no_trained_token``, ``truncation_removes_training``, ...)."""
        counts: dict[str, int] = {}
        for w in self.warnings:
            counts[w["kind"]] = counts.get(w["kind"], 0) + 1
        return counts

    def warning_counts_text(self) -> str:
        """``kind: n, ...`` or ``none``."""
        return ", ".join(f"{k}: {n}" for k, n in sorted(self.warning_counts().items())) or "none"

    def warn(self, kind: str, message: str, input: str | None = None, line: int | None = None) -> None:
        """Record a warning; the first 5 of each kind are also issued as :class:`PackWarning`.

        ``line`` is the row index for a row source (the entry then has ``row`` instead of ``line``).
        """
        self.warnings.append({"kind": kind, "input": input, **(position(input, line) if input else {"line": line}),
                              "message": message})
        self._seen[kind] = seen = self._seen.get(kind, 0) + 1
        if seen <= 5:
            more = " (only the first 5 of each kind are printed; the report lists them all)" if seen == 5 else ""
            warnings.warn((f"{where(input, line)}: {message}" if input else message) + more, PackWarning,
                          stacklevel=3)

    def summary(self) -> str:
        """Human-readable multi-line summary."""
        lines = [
            f"input conversations : {self.input_conversations}",
            f"packed conversations: {self.packed_conversations}",
            f"rejected            : {len(self.rejected)}",
            *([f"blank lines skipped : {blank}"] if (blank := sum(v.get("blank_lines", 0)
                                                                  for v in self.per_input.values())) else []),
            f"warnings            : {len(self.warnings)} ({self.warning_counts_text()})",
            f"oversize            : {len(self.oversize)} "
            f"({sum(o['action'] == 'dropped' for o in self.oversize)} dropped)",
            f"rows                : {self.rows} (lower bound {self.lower_bound_rows})",
            f"real tokens         : {self.real_tokens}",
            f"padding tokens      : {self.padding_tokens}",
            f"efficiency          : {100 * self.efficiency:.2f} %",
            f"pack factor         : {self.pack_factor:.2f} conversations/row",
        ]
        if self.warnings:  # the first 5 of each kind were issued as PackWarning while packing
            lines.append("  (the first warnings of each kind are printed above; all are in the report)")
        for r in self.rejected[:5]:
            lines.append(f"  rejected {entry_where(r)}: {r['reason']}")
        if len(self.rejected) > 5:
            lines.append(f"  ... {len(self.rejected) - 5} more rejected records in the report")
        lines += [f"{k:<20}: {v}" for k, v in self.outputs.items()]
        return "\n".join(lines)


# ---------------------------------------------------------------- main side
SHARD_BYTES_MIN, SHARD_BYTES_MAX, SHARDS, TAIL_SPLIT = 256 << 10, 64 << 20, 64, 4
"""Shard size: ``total input bytes / SHARDS``, within ``[SHARD_BYTES_MIN, SHARD_BYTES_MAX]`` (not the worker count);
the last ``2 * shard size`` bytes of inputs larger than one shard go in shards ``TAIL_SPLIT`` times smaller, so
that the workers finish together (the last shards a worker takes are short). A shard costs about a millisecond
of its own (a marker file, a result); 256 KiB is about 0.1-0.3 s of work."""


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


def _abort_workers(executor) -> None:
    """Stop an executor's worker processes now (a strict stop or an error: their work is not needed)."""
    for proc in list(getattr(executor, "_processes", {}).values()):
        if proc.is_alive():
            proc.terminate()
    executor.shutdown(wait=True, cancel_futures=True)


def _dead_worker_message(cfg: PackConfig, shards: list[Shard], spool_dir: str, executor) -> str:
    """Which worker died and which shard it was reading (from the marker file each worker writes per shard).

    The pool ends the other workers with SIGTERM once one has died, so those are only counted, unless SIGTERM
    ended them all: then one of them was sent it from outside the packer, and each is named with its shard."""
    manager = getattr(executor, "_executor_manager_thread", None)
    if manager is not None:  # it joins the workers of a broken pool; polling them meanwhile races its waitpid
        manager.join(timeout=30)
    deaths, stopped = [], []  # stopped: the workers ended by SIGTERM
    for pid, proc in sorted((getattr(executor, "_processes", None) or {}).items()):
        code = proc.exitcode
        if code is None or code == 0:
            continue
        at = _worker_whereabouts(cfg, shards, spool_dir, pid)
        if code == -signal.SIGTERM:
            stopped.append(f"worker process {pid}{at}")
            continue
        how = (f"killed by {signal.Signals(-code).name}" if code < 0 and -code in signal.valid_signals()
               else f"exit code {code}")
        deaths.append(f"worker process {pid} died ({how}){at}")
    if stopped and deaths:
        deaths.append(f"{len(stopped)} worker process(es) ended by SIGTERM (the pool stops the others when one dies)")
    elif stopped:
        return ("SIGTERM from outside the packer ended a worker process (the pool then stops the others with it): "
                + "; ".join(stopped))
    what = "; ".join(deaths) or "a worker process died"
    return (f"{what}; SIGKILL is what the out-of-memory killer sends: use fewer --num-workers or more memory, "
            "or lower --max-conversation-bytes")


def _worker_whereabouts(cfg: PackConfig, shards: list[Shard], spool_dir: str, pid: int) -> str:
    """`` while reading shard K of FILE (bytes A-B)``, `` while idle, after shard K of FILE`` or `` before reading a
    shard``: what worker ``pid`` was doing, from its marker file."""
    try:
        with open(os.path.join(spool_dir, f"worker.{pid}")) as f:
            index, _, done = f.read().partition(" ")
        shard = shards[int(index)]
    except (OSError, ValueError, IndexError):
        return " before reading a shard"
    span = "all rows" if is_row_source(cfg.inputs[shard.file_idx]) else f"bytes {shard.start}-{shard.end}"
    return (f" while idle, after shard {shard.index} of {cfg.inputs[shard.file_idx]}" if done else
            f" while reading shard {shard.index} of {cfg.inputs[shard.file_idx]} ({span})")


def _shard_progress(bar, result: ShardResult, conversations: int) -> None:
    """Advance the progress bar by a merged shard (its byte range, or a row source's records' JSON bytes) and show
    the ``conversations`` read so far."""
    shard = result.shard
    bar.set_postfix_str(f"{conversations} conversations", refresh=False)  # drawn by the update
    bar.update(shard.end - shard.start if shard.end > shard.start else result.nbytes)


def _worker_start_method() -> str:
    """``fork`` on Linux: the workers inherit the packer's imports and loaded tokenizer, so none pays an
    interpreter start, the transformers import and a tokenizer load (about a second each), as the workers of
    ``datasets.map(num_proc=...)`` and PyTorch's ``DataLoader`` start. ``spawn`` elsewhere, and in a process
    connected to Ray (whose threads a forked child would inherit the state of)."""
    ray = sys.modules.get("ray")
    if sys.platform != "linux" or (ray is not None and getattr(ray, "is_initialized", lambda: False)()):
        return "spawn"
    return "fork"


def _worker_fingerprint() -> str:
    """:func:`packsft.tokenizer.tokenizer_fingerprint` of this worker's tokenizer (a pool task)."""
    return tokenizer_fingerprint(_W["tok"])


@contextlib.contextmanager
def _frozen_gc(active: bool = True):
    """With ``active``, the garbage collector's objects frozen (:func:`gc.freeze`) for the block: its collections
    then leave them alone. While forking: a forked worker's collections leave the objects it inherits alone,
    instead of going through them all and writing to (so copying) the pages holding them (the workers' first
    shard took about 0.04 s longer without, 2-core machine). While counting in this process: each full
    collection went through the imports' and the tokenizer's objects (about 65,000; 25-30 ms each, one per
    2,000 two-turn conversations). Nothing is done when the caller has frozen objects already:
    :func:`gc.unfreeze` would release theirs too."""
    if not active or gc.get_freeze_count():
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def _shard_results(cfg: PackConfig, shards: list[Shard], spool_dir: str, tok=None, fingerprint=None):
    """Yield :class:`ShardResult` in shard order; with workers, ``num_workers`` processes read shards in parallel
    (forked workers use ``tok``, the packer's tokenizer). One JSONL shard in all, or by default JSONL inputs of at
    most 256 KiB in all, are read in this process: one worker would do the same work after its start.

    Args:
        fingerprint: a list, to which the tokenizer's fingerprint is appended when worker processes read the
            shards: one of them takes it, as a task before the shards (in this process it would hold the GIL for
            its whole serialization, and the thread that hands the workers their shards would wait for it).
            Otherwise (no workers, small inputs read in this process, Ray) the list stays empty.

    Raises:
        PackError: a worker process died (e.g. SIGKILL from the out-of-memory killer), naming its shard.
    """
    if cfg.engine == "ray":
        from packsft.packing import ray_engine

        yield from ray_engine.shard_results(cfg, shards, spool_dir)
        return
    # one JSONL shard, or by default JSONL inputs of at most a shard's bytes in all: a worker would only add its start
    small = not any(is_row_source(cfg.inputs[s.file_idx]) for s in shards) and (
        len(shards) == 1 or (cfg.shard_bytes is None and sum(s.end - s.start for s in shards) <= SHARD_BYTES_MIN))
    if cfg.num_workers == 0 or small:
        if cfg.num_workers:
            _init_worker(cfg, spool_dir, False, tok)  # closed by the caller of _count_all, as without workers
        with _frozen_gc():  # the imports' and the tokenizer's objects, which every full collection went through
            for shard in shards:
                yield count_shard(shard)
        return
    from concurrent.futures import ProcessPoolExecutor
    from concurrent.futures.process import BrokenProcessPool

    method = _worker_start_method()  # a forked pool starts all its workers at once: no more than there are shards
    executor = ProcessPoolExecutor(max(1, min(cfg.num_workers, len(shards))), mp_context=mp.get_context(method),
                                   initializer=_init_worker,
                                   initargs=(cfg, spool_dir, True, tok if method == "fork" else None))
    done = False
    try:
        # The pool forks its workers at the first submit. A SIGTERM/SIGINT handled meanwhile would raise inside the
        # at-fork hooks, where Python ignores the exception (the run went on and exited 0), or between two forks,
        # leaving a worker the pool does not know of (the packer hung waiting for it at exit): it is held until the
        # pool is consistent, then raised here, and the `finally` stops the workers.
        with _signals_held(_STOP_SIGNALS), _frozen_gc(method == "fork"):
            taken = executor.submit(_worker_fingerprint) if fingerprint is not None else None
            futures = [executor.submit(count_shard, s) for s in shards]

        def result_of(future):
            try:
                return future.result()
            except BrokenProcessPool as e:
                raise PackError(_dead_worker_message(cfg, shards, spool_dir, executor)) from e

        for future in futures:
            yield result_of(future)
        if taken is not None:
            fingerprint.append(result_of(taken))
        done = True
    finally:
        if done:
            executor.shutdown(wait=True)
        else:
            _abort_workers(executor)


class _Counted:
    """What the main process keeps of the accepted conversations: numpy arrays, no object per conversation.

    Attributes:
        num_tokens: int32 ``[n]``; spool: int32 ``[n]`` index into ``spools`` (one spool per worker, or per shard
            with Ray); offset, size: int64 ``[n]``.
        spools: the spool files.
        token_spools: the token spool of each of ``spools`` (the same worker's), or ``None`` without the cache.
        token_offset: int64 ``[n]``, offset in ``token_spools[spool]``, or ``None`` without the cache.
        trained: conversations with a trained token within ``max_seq_len``.
        uncut: ``(tokens, exact)`` of each conversation longer than ``max_seq_len`` (own row or dropped, in
            input order) before the packer's cut: the length as given, for the histogram.
    """

    def __init__(self, results: list[ShardResult]):
        import numpy as np

        self.spools = sorted({r.spool for r in results})
        ids = {p: i for i, p in enumerate(self.spools)}
        pair = {r.spool: r.token_spool for r in results}
        cached = bool(results) and results[0].token_spool is not None
        self.token_spools = [pair[p] for p in self.spools] if cached else None

        def cat(arrays, dtype):
            return np.concatenate(arrays).astype(dtype, copy=False) if arrays else np.zeros(0, dtype)

        self.num_tokens = cat([r.num_tokens for r in results], np.int32)
        self.offset = cat([r.offset for r in results], np.int64)
        self.size = cat([r.size for r in results], np.int64)
        self.spool = cat([np.full(len(r.num_tokens), ids[r.spool], np.int32) for r in results], np.int32)
        self.token_offset = cat([r.token_offset for r in results], np.int64) if cached else None
        self.trained = sum(r.trained_fitting for r in results)  # set by _count_all with the oversize ones kept
        self.uncut: list[tuple[int, bool]] = []  # set by _count_all

    def keep(self, mask) -> None:
        """Keep only the conversations where boolean ``mask`` is true."""
        self.num_tokens, self.offset = self.num_tokens[mask], self.offset[mask]
        self.size, self.spool = self.size[mask], self.spool[mask]
        if self.token_offset is not None:
            self.token_offset = self.token_offset[mask]


class _NoBar:
    """The progress bar's methods the packer calls, doing nothing (``progress=False``)."""

    def update(self, n: int = 1) -> None:
        pass

    def set_postfix_str(self, s: str = "", refresh: bool = True) -> None:
        pass

    def close(self) -> None:
        pass


def _count_all(cfg: PackConfig, spool_dir: str, report: PackReport, tok=None, fingerprint=None) -> _Counted:
    """Read and count every shard; fill the report's counts, rejections and warnings (exact line numbers).
    ``fingerprint``: as in :func:`_shard_results`."""
    import numpy as np

    shards = plan_shards(cfg.inputs, cfg.shard_bytes)
    total = input_bytes(cfg.inputs)
    if cfg.progress:
        from tqdm import tqdm

        bar = tqdm(desc="reading", total=total, unit="B", unit_scale=True, mininterval=1.0)
    else:  # a disabled tqdm still starts its monitor thread and a multiprocessing lock (about 10 ms)
        bar = _NoBar()
    results: list[ShardResult] = []
    lines_before = {}  # file_idx -> lines of that file in the shards before
    oversize: list[tuple] = []  # (global index, file_idx, absolute line, tokens, cut, uncut, exact, nbytes,
    #                              trained, in row)
    base = 0
    try:  # closed on an error too, so that the bar is not redrawn after the error line
        for r in _shard_results(cfg, shards, spool_dir, tok, fingerprint):
            path = cfg.inputs[r.shard.file_idx]
            before = lines_before.get(r.shard.file_idx, 0)
            lines_before[r.shard.file_idx] = before + r.lines
            report.input_conversations += r.conversations
            _shard_progress(bar, r, report.input_conversations)
            stats = report.per_input.setdefault(path, {"conversations": 0, "rejected": 0, "blank_lines": 0})
            stats["conversations"] += r.conversations
            stats["rejected"] += len(r.rejected)
            stats["blank_lines"] += r.lines - r.conversations  # skipped, but counted: every line is accounted for
            events = sorted([(line, 0, reason) for line, reason in r.rejected]
                            + [(line, 1, (kind, message)) for kind, line, message in r.warnings],
                            key=lambda e: (e[0], e[1]))
            for line, is_warning, what in events:
                if not is_warning:
                    if cfg.strict:
                        raise PackError(f"{where(path, before + line)}: {what} (strict mode)")
                    report.rejected.append({"input": path, **position(path, before + line), "reason": what})
                else:
                    report.warn(what[0], what[1], path, before + line)
            oversize += [(base + i, r.shard.file_idx, before + line, *rest) for i, line, *rest in r.oversize]
            base += len(r.num_tokens)
            r.rejected, r.warnings, r.oversize = [], [], []
            results.append(r)
    finally:
        bar.close()
    counted = _Counted(results)
    del results
    _apply_oversize(cfg, counted, oversize, report, np)
    counted.uncut = [(uncut, exact) for *_, uncut, exact, _, _, _ in oversize]
    counted.trained += 0 if cfg.oversize == "drop" else sum(1 for o in oversize if o[-1])
    return counted


def _apply_oversize(cfg: PackConfig, counted: _Counted, oversize: list[tuple], report: PackReport, np) -> None:
    """Report (and with ``drop`` remove) the conversations longer than a row; ``error`` stops at the first."""
    drop = []
    for index, file_idx, line, n, cut, _, _, nbytes, trained, in_row in oversize:
        cost = conversation_cost(n, cfg.context_parallel_size)
        if cfg.oversize == "error":
            raise PackError(f"{where(cfg.inputs[file_idx], line)}: conversation has {n} tokens (cost {cost}) > "
                            f"max_seq_len {cfg.max_seq_len}; use --oversize own-row or drop, or a larger "
                            "--max-seq-length")
        action = "dropped" if cfg.oversize == "drop" else "own row, truncated by the loader"
        entry = {"input": cfg.inputs[file_idx], **position(cfg.inputs[file_idx], line), "tokens": n,
                 "action": action}
        if cut:
            entry.update(cut_by_packer=True, input_bytes=nbytes)
        report.oversize.append(entry)
        if cfg.oversize == "drop":
            drop.append(index)
        elif trained and not in_row:  # (one without any has its no_trained_token warning)
            report.warn("truncation_removes_training",
                        f"conversation has {'more than ' if cut else ''}{n} tokens; truncated "
                        f"to max_seq_len {cfg.max_seq_len} "
                        "in its own row, it keeps no trained token (its trained assistant turns all lie beyond the "
                        "cut); use --oversize drop or a larger --max-seq-length", cfg.inputs[file_idx], line)
    if drop:
        mask = np.ones(len(counted.num_tokens), bool)
        mask[drop] = False
        counted.keep(mask)


def _nothing_trained(cfg: PackConfig, report: PackReport, conversations: int) -> str:
    """The error of a run whose rows would hold no trained token: the counts and the first warnings."""
    kinds = ("no_trained_token", "truncation_removes_training")
    counts = report.warning_counts()
    lines = [f"nothing to train: none of the {conversations} conversations to pack keeps a trained token in its "
             f"row (warnings: {counts.get(kinds[0], 0)} {kinds[0]}, {counts.get(kinds[1], 0)} {kinds[1]} at "
             f"max_seq_len {cfg.max_seq_len}); check --train-on, 'weight: 0', --prompt-format, or use a larger "
             "--max-seq-length"]
    lines += [f"  {w['kind']} {entry_where(w)}: {w['message']}" for w in report.warnings if w["kind"] in kinds][:5]
    return "\n".join(lines)


def _nothing_to_pack(cfg: PackConfig, report: PackReport, kinds: int = 8) -> str:
    """The error of a run that kept no conversation: the counts, and every reason once with the number of lines
    rejected for it (reasons that differ only in their numbers, such as a message index, count as one; the
    ``kinds`` most frequent are listed, with their first line)."""
    lines = [f"no conversation to pack: {report.input_conversations} input {count_word(cfg.inputs)}(s) in "
             f"{', '.join(cfg.inputs)}, {len(report.rejected)} rejected, {len(report.oversize)} oversize (dropped)"]
    groups: dict[str, list[dict]] = {}
    for r in report.rejected:
        groups.setdefault(re.sub(r"\d+", "0", r["reason"]), []).append(r)
    ranked = sorted(groups.values(), key=len, reverse=True)  # stable: the first seen first among equals
    for entries in ranked[:kinds]:
        more = f" and {len(entries) - 1:,} more line(s) like it" if len(entries) > 1 else ""
        lines.append(f"  rejected {entry_where(entries[0])}{more}: {entries[0]['reason']}")
    if len(ranked) > kinds:
        rest = sum(map(len, ranked[kinds:]))
        lines.append(f"  ... {rest:,} more rejected line(s) for {len(ranked) - kinds} other reason(s)")
    if report.oversize:
        o = report.oversize[0]
        more = f" and {len(report.oversize) - 1:,} more" if len(report.oversize) > 1 else ""
        lines.append(f"  dropped {entry_where(o)}{more}: {o['tokens']} tokens > max_seq_len {cfg.max_seq_len}")
    return "\n".join(lines)


def _stage(name: str) -> None:
    """Publication stage ``name`` (one of :data:`STAGES`) reached: the :data:`STAGE_HOOK_ENV` test hook."""
    hook = os.environ.get(STAGE_HOOK_ENV, "")
    stage, _, sig = hook.partition(":")
    if stage == name:
        os.kill(os.getpid(), getattr(signal, sig or "SIGKILL"))
        time.sleep(0.2)  # let an unblocked handler run here


def _check_writable(paths: dict[str, str]) -> None:
    """Create the outputs' folders (as needed) and check that a file can be written in each, before any work.

    Raises:
        PackError: a folder cannot be created or written (names the output, the folder and the system's reason).
    """
    seen: set[Path] = set()
    for name, path in paths.items():
        folder = Path(path).resolve().parent
        if folder in seen:
            continue
        seen.add(folder)
        try:
            folder.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryFile(dir=folder):
                pass
        except OSError as e:
            flag = {"rows": "--output", "report": "--report", "histogram": "--histogram"}.get(name, "--output")
            blocking = next((p for p in (folder, *folder.parents) if p.exists()), folder)
            reason = f"{blocking} is a file, not a folder" if not blocking.is_dir() else e.strerror or e
            raise PackError(f"{flag} {path}: cannot write in {folder}: {reason}") from e


_OUTPUT_NAMES = {"rows": "--output", "sidecar": "sidecar", "report": "--report", "histogram": "--histogram",
                 "token_cache": "token cache", "token_index": "token cache index"}
"""How messages name each of :func:`_output_paths`."""


HISTOGRAM_SUFFIX = ".lengths.png"


def _stale_outputs(paths: dict[str, str]) -> tuple[Path, ...]:
    """Files of an earlier run on the same output that this run's set (``paths``) does not replace: its token
    cache when this run writes none, and its report and histogram at their default paths when this run writes
    them elsewhere or not at all (they would describe the earlier rows)."""
    rows = paths["rows"]
    stale = [] if "token_cache" in paths else list(cache_paths(rows))
    for key, default in (("report", rows + REPORT_SUFFIX), ("histogram", rows + HISTOGRAM_SUFFIX)):
        if key not in paths or Path(paths[key]).resolve() != Path(default).resolve():
            stale.append(Path(default))
    written = {Path(p).resolve() for p in paths.values()}  # (--report X.lengths.png: a new output, not stale)
    return tuple(p for p in stale if p.resolve() not in written)


def output_folders(cfg: PackConfig) -> list[str]:
    """The folders a run writes to (its outputs', the spools beside ``cfg.output``), resolved, in order."""
    return list(dict.fromkeys(str(Path(p).resolve().parent) for p in _output_paths(cfg).values()))


def _output_paths(cfg: PackConfig) -> dict[str, str]:
    """``{rows, sidecar, report, histogram?, token_cache?, token_index?}``: the paths a run writes."""
    paths = {"rows": cfg.output, "sidecar": str(sidecar_path(cfg.output)),
             "report": cfg.report or cfg.output + REPORT_SUFFIX}
    histogram = cfg.histogram if cfg.histogram is not None else cfg.output + HISTOGRAM_SUFFIX
    if histogram:
        paths["histogram"] = histogram
    if cfg.token_cache:
        paths["token_cache"], paths["token_index"] = map(str, cache_paths(cfg.output))
    return paths


def _shuffled_rows(order, starts, seed: int, np):
    """``(order, starts)`` with the rows in the order ``random.Random(seed).shuffle`` gives a list of them."""
    perm = list(range(len(starts)))
    random.Random(seed).shuffle(perm)
    perm = np.asarray(perm, dtype=np.int64)
    lengths = np.diff(np.r_[starts, len(order)])[perm]
    new_starts = np.cumsum(lengths) - lengths
    # position k of new row j reads old position starts[perm[j]] + (k - new_starts[j])
    take = np.repeat(starts[perm] - new_starts, lengths) + np.arange(len(order), dtype=np.int64)
    return order[take], new_starts


def _token_cache_writer(cfg: PackConfig, rows: int, counted: _Counted, temps: dict[str, Path],
                        np) -> TokenCacheWriter | None:
    """The token cache writer into fresh temp files (``temps["token_cache"]``, ``temps["token_index"]``)."""
    if not cfg.token_cache:
        return None
    tokens_path, index_path = cache_paths(cfg.output)
    temps["token_cache"], temps["token_index"] = temp_path(tokens_path), temp_path(index_path)
    total = int(np.minimum(counted.num_tokens.astype(np.int64), cfg.max_seq_len).sum())
    return TokenCacheWriter(temps["token_cache"], temps["token_index"], cfg.output, total, rows,
                            len(counted.num_tokens), cfg.max_seq_len)


def _row_groups(starts, r0: int, r1: int, conversations: int, block: int, np) -> list[tuple[int, int]]:
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


def _byte_groups(groups, starts, ends, order, counted: _Counted, max_seq_len: int, tokens: bool, np):
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


def _write_row_range(order, starts, counted: _Counted, r0: int, r1: int, rows_out, tokens_out, np,
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
        groups = _row_groups(starts, r0, r1, len(order), block, np)
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


def _write_rows(order, starts, counted: _Counted, tmp: Path, np, cache: TokenCacheWriter | None = None,
                max_seq_len: int = 0, block: int = 1 << 16) -> tuple[int, str]:
    """Write all rows into ``tmp`` (fsynced) and their tokens into ``cache``; return the rows' size in bytes and
    BLAKE2b-160 hex."""
    with open(tmp, "wb") as f:
        out = HashingWriter(f)
        _write_row_range(order, starts, counted, 0, len(starts), out, cache.add_rows if cache is not None else None,
                         np, max_seq_len, block)
        f.flush()
        os.fsync(f.fileno())
    return out.size, out.hexdigest()


class _Lock(FileLock):
    """An exclusive ``flock`` on ``.NAME.lock`` beside the output: one packer per output at a time."""

    def __init__(self, output: str):
        super().__init__(lock_path(output))
        self.output = output

    def __enter__(self):
        try:
            return super().__enter__()
        except BlockingIOError as e:
            raise PackError(f"another packer is writing {self.output} (it holds {self.path}); wait for it or "
                            "pick another --output") from e


class Terminated(SystemExit):
    """SIGTERM during :func:`run_pack`: unwinds so that every temp file is removed (exit code 143)."""


_STOPS: list[int] = []
"""Stop signals received by :func:`_on_sigterm` / :func:`_on_sigint` during :func:`run_pack`. Python prints and
drops an exception raised in a finalizer (``__del__``, e.g. one run by an import), so a signal handled there would
not stop the run: :func:`_publish` checks this list before the point of no return."""


def _on_sigterm(signum, frame):
    _STOPS.append(signum)
    raise Terminated(128 + signum)


def _on_sigint(signum, frame):
    _STOPS.append(signum)
    raise KeyboardInterrupt


def _restore_handler(signum: int, handler) -> None:
    """Put back ``handler`` (from ``signal.signal``); ``None``, a handler Python did not install, cannot be put
    back and becomes ``SIG_DFL``."""
    signal.signal(signum, handler if handler is not None else signal.SIG_DFL)


def _hold_sigterm() -> tuple[bool, Any, Any]:
    """Install :func:`_on_sigterm`, and :func:`_on_sigint` where SIGINT has Python's default handler (main thread
    only); return ``(installed, the SIGTERM handler replaced, the SIGINT one or None)``.

    Whatever SIGTERM had is replaced: a handler left by an earlier ``ray.init`` in this process (``sys.exit(15)``)
    or one Python cannot see (``signal.getsignal`` is ``None``) would end the run without removing its temps. An
    ignored SIGINT (a job started with ``&`` by a script) stays ignored.
    """
    try:
        previous = signal.signal(signal.SIGTERM, _on_sigterm)
    except ValueError:  # not the main thread
        return False, None, None
    sigint = signal.getsignal(signal.SIGINT) is signal.default_int_handler
    return True, previous, signal.signal(signal.SIGINT, _on_sigint) if sigint else None


def run_pack(cfg: PackConfig) -> PackReport:
    """Run the whole pipeline for ``cfg`` and return its report (also written to disk).

    Writes ``cfg.output`` (rows), ``cfg.output + ".meta.json"`` (sidecar, with the rows' size and BLAKE2b), the
    JSON report and the length histogram PNG: all to temp names first, then renamed as one unit through a
    publish journal (:func:`packsft.io.publish_files`) with SIGTERM held off, the sidecar last. A run killed at
    any point leaves the previous complete set or the new one: killed during the renames, it leaves the
    journal, and the next packer run or reader (:func:`packsft.io.finish_interrupted_publish`) finishes them.
    Temp files of an earlier killed run are removed at start. While this runs in the main thread, SIGTERM is
    its own (the previous handler is restored at the end): it removes this run's temp files and exits 143.

    Raises:
        ValueError: invalid settings (see :meth:`PackConfig.validate`), unusable tokenizer or prompt format.
        PackError: strict mode met an invalid record, ``oversize="error"`` met a long conversation, or another
            packer is writing the same output.
        SystemExit: 143 on SIGTERM (nothing of this run is left behind).
    """
    cfg.validate()
    _STOPS.clear()
    held, previous, previous_int = _hold_sigterm()
    try:
        if cfg.engine == "ray":
            from packsft.packing.ray_engine import ray_session

            with ray_session(cfg.ray_address):
                if held:
                    _hold_sigterm()  # ray.init installs its own (sys.exit(15)), and a C-level one
                return _run_pack(cfg)
        return _run_pack(cfg)
    finally:
        if held:
            _restore_handler(signal.SIGTERM, previous)
        if previous_int is not None:
            _restore_handler(signal.SIGINT, previous_int)


def _run_pack(cfg: PackConfig) -> PackReport:
    import numpy as np

    tok = load_tokenizer(cfg.tokenizer)
    fmt = _prompt_format(cfg, tok)
    report = PackReport(settings={k: v for k, v in asdict(cfg).items() if k not in ("progress",)},
                        working_dir=os.getcwd())
    if fmt.missing_stop_signal(tok):
        report.warn("no_stop_signal", f"{fmt.template_name} writes nothing after an assistant turn's content and "
                    "--no-append-eos is set: no end-of-turn or EOS token is trained, so the model will not learn "
                    "to stop")
    out_dir = Path(cfg.output).resolve().parent
    paths = _output_paths(cfg)
    _check_writable(paths)
    spool_name = cfg.output + ".spool"
    with _Lock(cfg.output):
        journal = journal_path(cfg.output)
        _finish_publish(journal)  # a run killed while publishing: its set is complete, finish the renames
        for final in {*paths.values(), *map(str, cache_paths(cfg.output)), str(journal), spool_name}:
            for stale in stale_temps(final):
                if stale.is_dir():
                    shutil.rmtree(stale, ignore_errors=True)
                else:
                    stale.unlink(missing_ok=True)
        temps: dict[str, Path] = {}
        try:
            temps["rows"] = temp_path(cfg.output)
            spool_dir = tempfile.mkdtemp(prefix=f".{Path(spool_name).name}.", suffix=".tmp", dir=out_dir)
            try:
                if cfg.num_workers == 0 and cfg.engine == "local":
                    _init_worker(cfg, spool_dir, False, tok)
                try:
                    fingerprint: list[str] = []  # the sidecar's, when a worker process took it
                    counted = _count_all(cfg, spool_dir, report, tok, fingerprint)
                finally:
                    _close_worker()
                L, cp = cfg.max_seq_len, cfg.context_parallel_size
                if not len(counted.num_tokens):
                    raise PackError(_nothing_to_pack(cfg, report))
                if not counted.trained:
                    raise PackError(_nothing_trained(cfg, report, len(counted.num_tokens)))
                costs = np.minimum(conversation_cost(counted.num_tokens.astype(np.int64), cp), L)
                order, starts = pack_order(costs, L, cfg.algorithm)
                report.lower_bound_rows = lower_bound_rows(costs, L)
                if cfg.shuffle_rows:
                    order, starts = _shuffled_rows(order, starts, cfg.seed, np)
                report.rows = len(starts)
                _stage("tokenized")
                cache = _token_cache_writer(cfg, report.rows, counted, temps, np)
                try:
                    if cfg.engine == "ray":
                        from packsft.packing.ray_engine import write_rows

                        size, digest = write_rows(cfg, order, starts, counted, temps["rows"], spool_dir, cache)
                    else:
                        size, digest = _write_rows(order, starts, counted, temps["rows"], np, cache, L)
                    cache_fields = cache.finish(digest) if cache is not None else None
                finally:
                    if cache is not None:
                        cache.close()
            finally:
                with _signals_held():  # a stop signal inside rmtree would leave the folder half removed
                    shutil.rmtree(spool_dir, ignore_errors=True)
            _stage("rows_written")
            lengths = counted.num_tokens
            report.packed_conversations = len(lengths)
            report.real_tokens = int(np.minimum(lengths, L).sum())
            report.padding_tokens = report.rows * L - report.real_tokens
            row_fill = np.add.reduceat(costs[order], starts) if report.rows else costs[:0]
            _write_outputs(cfg, fmt, tok, report, lengths, row_fill, paths, temps, size, digest, cache_fields,
                           fingerprint[0] if fingerprint else None, counted.uncut)
        finally:
            with _signals_held():
                for tmp in temps.values():
                    tmp.unlink(missing_ok=True)
    return report


def _write_outputs(cfg, fmt, tok, report: PackReport, lengths, row_fill, paths, temps, size, digest,
                   cache_fields=None, fingerprint: str | None = None, uncut=()) -> None:
    """Write the sidecar, the report and the histogram to temp names and publish the set (``fingerprint``: the
    tokenizer's, when already taken; ``uncut``: :attr:`_Counted.uncut`, the oversize conversations' lengths
    before the cut, which the histogram shows)."""
    report.outputs = dict(paths)
    report.rows_file = {"size": size, "blake2b": digest}
    sidecar = {
        "packsft_version": __version__,
        "inputs": list(cfg.inputs),
        **({"split": cfg.split} if cfg.split is not None else {}),
        **_input_identity(cfg),
        "record_format": cfg.record_format,
        "megatron_lm_compatible": (None if fmt.name not in MEGATRON_PRESETS
                                   else "non_megatron" not in report.warning_counts()),
        **(adapter_identity(cfg.adapter) if cfg.adapter else {}),
        "tokenizer_fingerprint": fingerprint or tokenizer_fingerprint(tok),
        "tokenizer": str(cfg.tokenizer),
        "prompt_format": fmt.spec(),
        **({"special_tokens": specials} if (specials := special_tokens(tok, fmt)) else {}),
        "max_seq_len": cfg.max_seq_len,
        "context_parallel_size": cfg.context_parallel_size,
        "sequence_parallel_size": cfg.sequence_parallel_size,
        "algorithm": cfg.algorithm,
        "seed": cfg.seed,
        "shuffle_rows": cfg.shuffle_rows,
        "default_system_prompt": cfg.default_system_prompt,
        "counts": {"input_conversations": report.input_conversations, "packed_conversations": len(lengths),
                   "rejected": len(report.rejected), "oversize": len(report.oversize),
                   "warnings": report.warning_counts(), "rows": report.rows,
                   "real_tokens": report.real_tokens, "padding_tokens": report.padding_tokens},
        **rows_file_fields(size, digest),
        **({"token_cache": cache_fields} if cache_fields else {}),
    }
    if cache_fields:
        cache_fields["settings_blake2b"] = cache_settings_blake2b(sidecar)
    temps["sidecar"] = temp_path(paths["sidecar"])
    temps["sidecar"].write_text(sidecar_text(sidecar), encoding="utf-8")
    _stage("sidecar_written")
    temps["report"] = temp_path(paths["report"])
    temps["report"].write_text(json.dumps(report.to_dict(), indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    if "histogram" in paths:
        from packsft.packing.report import plot_lengths

        temps["histogram"] = temp_path(paths["histogram"])
        over = [n for n, _ in uncut]
        plot_lengths(temps["histogram"], lengths[lengths <= cfg.max_seq_len], row_fill, cfg.max_seq_len,
                     truncated=over if cfg.oversize == "own-row" else (),
                     dropped=over if cfg.oversize == "drop" else (), estimated=sum(not e for _, e in uncut))
    for key in ("sidecar", "report"):
        with open(temps[key], "rb+") as f:
            os.fsync(f.fileno())
    _stage("report_written")
    _publish(paths, temps)


def _input_identity(cfg: PackConfig) -> dict[str, Any]:
    """``{"input_identity": {input: source_identity}}`` for the row-source inputs (none for JSONL only)."""
    found = {p: source_identity(p, cfg.split) for p in cfg.inputs if is_row_source(p)}
    return {"input_identity": found} if found else {}


@contextlib.contextmanager
def _signals_held(signals: tuple[int, ...] = _STOP_SIGNALS):
    """Hold ``signals`` off for the block, then act on one that came (its handler runs after the block; of two
    different ones, CPython runs the lower-numbered handler first: SIGINT's).

    Blocking them (``pthread_sigmask``) covers only this thread, and the kernel gives a signal sent to the process
    to any thread that does not block it (the packer has several: the tokenizer's, the pools'); CPython then runs
    the Python handler in the main thread all the same. So in the main thread the handlers are also swapped for
    one that only records the signal, which is raised again once the block has finished without an error.
    """
    got: list[int] = []
    swapped = {}
    if threading.current_thread() is threading.main_thread():
        for s in signals:
            swapped[s] = signal.signal(s, lambda signum, frame: got.append(signum))
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, signals)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)  # one pending on this thread goes to the recorder
        for s, handler in swapped.items():
            _restore_handler(s, handler)
    if got:
        signal.raise_signal(got[0])  # to this thread: its handler (SIGTERM: exit 143) runs here


def _finish_publish(journal: Path) -> None:
    """Finish the renames of a publish that a killed run left in ``journal`` (:func:`packsft.io.complete_publish`),
    under the writer lock.

    A journal with a rename that can no longer be done (its temp file and its output both gone: the set was
    deleted after the kill) is stale: there is nothing to finish, this run writes a whole new set, and the
    journal is removed.

    Raises:
        PackError: ``journal`` is not a publish journal (a hand-made file, a folder, not UTF-8, another format,
            relative paths) or a rename fails: one line naming it, saying to remove it.
        OSError: the disk is full (ENOSPC, EDQUOT: the CLI's own message).
    """
    try:
        complete_publish(journal)
    except FileNotFoundError:
        journal.unlink()
    except (OSError, ValueError) as e:
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            raise
        if isinstance(e, UnicodeDecodeError):
            what = "not UTF-8 text, so not a packsft publish journal"
        elif isinstance(e, IsADirectoryError) and e.filename == str(journal):
            what = "a folder, not a packsft publish journal"
        elif isinstance(e, OSError):
            files = " -> ".join(str(f) for f in (e.filename, e.filename2) if f not in (None, str(journal)))
            what = f"{e.strerror or e}{f' ({files})' if files else ''}"
        else:
            what = str(e)
        hint = "" if "remove" in what else ("; a packer killed while publishing leaves this file, and this one "
                                               "cannot be finished: remove it and re-run the packer")
        raise PackError(f"{journal}: {what}{hint}") from None


def _publish(paths: dict[str, str], temps: dict[str, Path]) -> None:
    """Rename the temp files over their outputs as one unit (:func:`packsft.io.publish_files`), the sidecar last,
    with SIGTERM and SIGINT held off (:func:`_signals_held`).

    The files of an earlier run that this one does not replace (:func:`_stale_outputs`) are removed in the same
    unit.
    """
    rows = Path(paths["rows"])

    def hook(final: Path | None) -> None:
        if final is None or final == rows:
            _stage("journal_written" if final is None else "rows_published")

    journal = journal_path(paths["rows"])
    if _STOPS:  # a stop signal whose exception a finalizer dropped: stop here, as the signal would have
        raise Terminated(128 + signal.SIGTERM) if signal.SIGTERM in _STOPS else KeyboardInterrupt
    try:
        with _signals_held():
            try:
                order = [k for k in ("histogram", "report", "token_index", "token_cache", "rows", "sidecar")
                         if k in temps]
                publish_files([(temps[k], Path(paths[k])) for k in order], journal, hook, _stale_outputs(paths))
                temps.clear()
            except BaseException:
                if journal.exists():  # the temps belong to the journal: the next run or reader finishes the renames
                    temps.clear()
                raise
        _stage("published")
    except (Terminated, KeyboardInterrupt) as e:  # held while publishing, raised after: the new set is out
        e.published = True
        raise
