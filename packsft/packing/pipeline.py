"""The pack pipeline: JSONL conversations -> ``.jsonl.packed`` rows + sidecar + report.

Flow (outputs and formats: ``docs/packing.md``, ``docs/formats.md``):

1. Stream every input line (never the whole file) to worker processes in bounded, ordered batches. Each
   worker parses and validates the record (:mod:`packsft.conversation`) and counts its tokens with
   :func:`packsft.prompt_formats.count_conversation_tokens`, the loader's own tokenization. Invalid lines
   are *rejected* into the report with file, line and reason (or abort with ``strict=True``).
2. The normalised conversation (system message first, carrying its ``tools``) is spooled to a temp file;
   only ``(cost, spool offset)`` stays in memory.
   Lines over ``max_conversation_bytes`` are rejected unparsed.
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
5. With ``token_cache`` (default) the workers' ``(tokens, targets)`` are spooled too (int32, at most
   ``max_seq_len`` tokens each) and written beside the rows as the token cache (:mod:`packsft.token_cache`),
   fingerprinted in the sidecar, so the loader reads token ids instead of re-tokenizing.

Output is a deterministic function of the inputs and settings: batches come back in input order whatever
the number of workers, and no step depends on hash order.
"""

from __future__ import annotations

import dataclasses
import json
import multiprocessing as mp
import os
import random
import signal
import tempfile
import time
import warnings
from collections import deque
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from tqdm import tqdm

from packsft import __version__
from packsft.conversation import ConversationError, parse_record
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
from packsft.layout import IGNORE_INDEX, check_max_seq_len, conversation_cost
from packsft.packing.algorithms import ALGORITHMS, lower_bound_rows, pack
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
)
from packsft.record_formats import RecordFormatError, adapter_identity, record_converter, source_field
from packsft.sidecar import efficiency, rows_file_fields, sidecar_path, sidecar_text
from packsft.token_cache import TokenCacheWriter, cache_paths, encode_conversation, stored_length
from packsft.tokenizer import load_tokenizer, tokenizer_fingerprint

OVERSIZE_POLICIES = ("own-row", "drop", "error")
_BATCH = 64
MAX_CONVERSATION_BYTES = 4 << 20
"""Default ``--max-conversation-bytes``: longer input lines are rejected before they are parsed (4 MiB)."""
STAGE_HOOK_ENV = "PACKSFT_PACK_STAGE_HOOK"
"""Test hook: ``STAGE:SIGNAL`` (e.g. ``rows_written:SIGKILL``) makes the packer send itself SIGNAL at STAGE."""
STAGES = ("tokenized", "rows_written", "sidecar_written", "report_written", "journal_written", "rows_published",
          "published")
"""The packer's publication stages, in order (see :func:`_stage`)."""


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
        num_workers: tokenizer processes (0 = in this process).
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
        if self.train_on not in TRAIN_ON:
            raise ValueError(f"--train-on {self.train_on!r}: choose one of {', '.join(TRAIN_ON)}")
        if self.chat_template_kwargs is not None and not isinstance(self.chat_template_kwargs, dict):
            raise ValueError("--chat-template-kwargs must be a JSON object, e.g. '{\"enable_thinking\": false}'")
        if self.num_workers < 0:
            raise ValueError(f"--num-workers must be >= 0, got {self.num_workers}")
        if Path(self.output).is_dir():
            raise ValueError(f"--output {self.output} is a directory; give the .jsonl.packed file to write")
        if self.max_conversation_bytes < 1:
            raise ValueError(f"--max-conversation-bytes must be >= 1, got {self.max_conversation_bytes}")
        written = {"--output": self.output, "sidecar": str(sidecar_path(self.output)),
                   "--report": self.report or self.output + ".report.json"}
        if self.histogram != "":
            written["--histogram"] = self.histogram or self.output + ".lengths.png"
        if self.token_cache:
            written.update(zip(("token cache", "token cache index"), map(str, cache_paths(self.output))))
        for p in self.inputs:
            for what, out in written.items():
                if _same_file(p, out):
                    raise ValueError(f"--input {p} is also the {what} path {out}: packing would overwrite its "
                                     "own input; write the output elsewhere")


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


def _init_worker(cfg: PackConfig) -> None:
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    tok = load_tokenizer(cfg.tokenizer)
    fmt = _prompt_format(cfg, tok)
    _W.update(cfg=cfg, tok=tok, fmt=fmt, lenient=dataclasses.replace(fmt, allow_non_megatron=True),
              convert=record_converter(cfg.record_format, cfg.adapter))


def own_row_window(max_seq_len: int) -> tuple[int, int]:
    """Token counts ``(low, high)`` an own-row conversation is cut to by the packer: ``L + 8 .. L + margin``.

    ``margin = max(32, L // 16)``. At least 8 tokens beyond ``L`` stay so that the loader's truncation, not
    the template's end of turn after a cut message, ends the row (the model is not taught to stop mid-text).
    """
    return max_seq_len + 8, max_seq_len + max(32, max_seq_len // 16)


def _message_chars(m: dict[str, Any]) -> int:
    return len(json.dumps(m, ensure_ascii=False))


def _cut_messages(messages: list[dict[str, Any]], budget: int, train_on: str,
                  sizes: list[int] | None = None) -> tuple[list[dict[str, Any]], bool]:
    """The longest prefix of ``messages`` within ``budget`` JSON characters, the last kept content cut short.

    At least the system message and one more are kept. A message whose string content does not fit is kept
    with a prefix of its content (never emptied); one that cannot be cut so is dropped with all after it. With
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
        room = left - (size - len(content)) if isinstance(content, str) else 0
        if i == 0:  # the system message: cut (possibly to ""), then keep one more
            kept.append({**m, "content": content[:max(room, 0)]} if isinstance(content, str) else m)
            left = 0
            continue
        if room > 0 and content[:room].strip():
            kept.append({**m, "content": content[:room]})
        elif len(kept) < 2 and i >= 1:  # keep one non-system message whatever it costs
            kept.append({**m, "content": content[:max(room, 1)]} if isinstance(content, str) and content else m)
        break
    else:
        return list(messages), False
    if train_on == "last":
        last = max((i for i, m in enumerate(messages) if m["role"] == "assistant"), default=-1)
        if last >= len(kept):
            kept = [{**m, "weight": 0} if m["role"] == "assistant" else m for m in kept]
    return kept, True


def _tokenize_record(conv, tok, fmt, cfg: PackConfig):
    """``(conv, tokens, targets, cut)``: ``conv`` tokenized with ``fmt`` (own-row: cut to its window first)."""
    cut = False
    if cfg.oversize == "own-row":
        msgs, tokens, targets, cut = _fit_own_row(conv, tok, fmt, cfg)
        if cut:
            conv = type(conv)(messages=msgs, tools=conv.tools, path=conv.path, line=conv.line,
                              meta=conv.meta, chat_template_kwargs=conv.chat_template_kwargs)
    else:
        tokens, targets = tokenize_conversation(conv.messages, tok, fmt, conv.tools,
                                                conv.chat_template_kwargs)
    return conv, tokens, targets, cut


def _fit_own_row(conv, tok, fmt, cfg: PackConfig):
    """Tokenize ``conv``, cutting it (:func:`_cut_messages`) into :func:`own_row_window` when it is longer.

    Work is bounded by a few tokenizations of about ``L`` tokens, whatever the conversation's length: the
    character budget starts at ``8 * high`` and is doubled, then bisected (with a proportional guess).

    Returns:
        ``(messages, tokens, targets, cut)``: the messages to store and their tokenization.

    Raises:
        PromptFormatError: the conversation (or every cut of it tried) does not tokenize.
    """
    low, high = own_row_window(cfg.max_seq_len)
    sizes = [_message_chars(m) for m in conv.messages]
    total = sum(sizes)
    budget = min(total, 8 * high)
    lo, hi = 0, None  # budgets known to give fewer than `low` tokens / more than `high`
    best = None  # the smallest cut seen above `low` (used if the window is never hit)
    error = None
    for _ in range(24):
        msgs, cut = _cut_messages(conv.messages, budget, cfg.train_on, sizes)
        try:
            tokens, targets = tokenize_conversation(msgs, tok, fmt, conv.tools, conv.chat_template_kwargs)
        except PromptFormatError as e:  # a cut the format cannot render: try a shorter one
            if not cut:
                raise
            error, hi, n = e, budget, None
        else:
            n = len(tokens)
            if not cut and n <= high:
                return msgs, tokens, targets, False
            if low <= n <= high:
                return msgs, tokens, targets, True
            if n > high:
                hi = budget
                if best is None or n < len(best[1]):
                    best = (msgs, tokens, targets, cut)
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
        return best
    raise error or PromptFormatError("the conversation could not be cut to max_seq_len")


def _process_batch(batch: list[tuple[int, int, int, str | None, str | None]]) -> list[tuple]:
    """Parse, validate and count one batch of lines: ``(file_idx, line, nbytes, text, error)`` each.

    Under ``own-row`` a conversation longer than :func:`own_row_window` is cut there first
    (:func:`_fit_own_row`), and the stored, cut conversation is the one counted.

    Returns:
        ``(file_idx, line, nbytes, (num_tokens, trained, trained_in_row), row_messages_json, None, cut, cache)`` for a
        good line (``trained``: tokens the model is trained to predict, or 1 for a cut conversation (its cut-off
        part is not counted); ``trained_in_row``: those within the first ``max_seq_len`` tokens, what the
        loader's truncation keeps; ``cut``: the packer cut it; ``cache``: its token cache bytes,
        :func:`packsft.token_cache.encode_conversation`, or ``None`` without ``token_cache``), or
        ``(file_idx, line, nbytes, None, None, reason, False, None)`` for a rejected one.
    """
    cfg, tok, fmt = _W["cfg"], _W["tok"], _W["fmt"]
    out = []
    for file_idx, line, nbytes, text, decode_error in batch:
        path = cfg.inputs[file_idx]
        try:
            if decode_error:
                raise ConversationError(path, line, "", decode_error)
            try:
                record = json.loads(text.rstrip("\r\n"))  # an error at the end is then on this line
            except json.JSONDecodeError as e:
                raise ConversationError(path, line, "", f"not valid JSON: {e.msg} (column {e.colno})") from e
            except RecursionError as e:
                raise ConversationError(path, line, "", "not valid JSON: nested too deeply") from e
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
            non_megatron = None
            try:
                conv, tokens, targets, cut = _tokenize_record(conv, tok, fmt, cfg)
            except NonMegatronError as e:
                if not cfg.allow_non_megatron:
                    raise
                non_megatron = str(e)
                conv, tokens, targets, cut = _tokenize_record(conv, tok, _W["lenient"], cfg)
            trained = [t != IGNORE_INDEX for t in targets[1:]]
            in_row = sum(trained[: cfg.max_seq_len - 1])
            counts = (len(tokens), max(1, in_row) if cut else sum(trained), in_row, non_megatron)
            cache = encode_conversation(tokens, targets, cfg.max_seq_len) if cfg.token_cache else None
            out.append((file_idx, line, nbytes, counts, json.dumps(conv.to_row_messages(), ensure_ascii=False),
                        None, cut, cache))
        except ConversationError as e:
            out.append((file_idx, line, nbytes, None, None, f"{e.field + ': ' if e.field else ''}{e.reason}", False,
                        None))
        except PromptFormatError as e:
            out.append((file_idx, line, nbytes, None, None, f"{cfg.prompt_format}: {e}", False, None))
    return out


# ---------------------------------------------------------------- main side
def _batches(cfg: PackConfig):
    batch = []
    for file_idx, path in enumerate(cfg.inputs):
        for line, nbytes, text, err in iter_source(path, cfg.max_conversation_bytes, cfg.split):
            batch.append((file_idx, line, nbytes, text, err))
            if len(batch) == _BATCH:
                yield batch
                batch = []
    if batch:
        yield batch


def _ordered_results(cfg: PackConfig):
    """Yield worker results in input order with at most ``4 * num_workers`` batches in flight."""
    if cfg.num_workers == 0:
        _init_worker(cfg)
        for batch in _batches(cfg):
            yield from _process_batch(batch)
        return
    ctx = mp.get_context("spawn")
    with ctx.Pool(cfg.num_workers, initializer=_init_worker, initargs=(cfg,)) as pool:
        pending: deque = deque()
        for batch in _batches(cfg):
            pending.append(pool.apply_async(_process_batch, (batch,)))
            if len(pending) >= 4 * cfg.num_workers:
                yield from pending.popleft().get()
        while pending:
            yield from pending.popleft().get()


@dataclass
class _Counted:
    """What the main process keeps per accepted conversation."""

    file_idx: int
    line: int
    num_tokens: int
    offset: int  # byte offset of its messages JSON in the spool file
    size: int
    trained_in_row: int = 1  # trained tokens within the first max_seq_len tokens
    cut: bool = False  # the packer cut it to own_row_window (own-row)
    nbytes: int = 0  # its input line's bytes
    token_offset: int = -1  # byte offset of its token cache bytes in the token spool (-1: none)


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
        seen = sum(w["kind"] == kind for w in self.warnings)
        if seen <= 5:
            more = " (further ones of this kind are only listed in the report)" if seen == 5 else ""
            warnings.warn((f"{where(input, line)}: {message}" if input else message) + more, PackWarning,
                          stacklevel=3)

    def summary(self) -> str:
        """Human-readable multi-line summary."""
        lines = [
            f"input conversations : {self.input_conversations}",
            f"packed conversations: {self.packed_conversations}",
            f"rejected            : {len(self.rejected)}",
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


def _count_all(cfg: PackConfig, spool, report: PackReport, token_spool=None) -> list[_Counted]:
    counted: list[_Counted] = []
    total = input_bytes(cfg.inputs)
    bar = tqdm(desc="reading", total=total, unit="B", unit_scale=True, disable=not cfg.progress, mininterval=1.0)
    for file_idx, line, nbytes, counts, msgs_json, reason, cut, cache in _ordered_results(cfg):
        bar.update(nbytes)
        bar.set_postfix_str(f"{report.input_conversations + 1} conv", refresh=False)
        report.input_conversations += 1
        stats = report.per_input.setdefault(cfg.inputs[file_idx], {"conversations": 0, "rejected": 0})
        stats["conversations"] += 1
        if reason is not None:
            stats["rejected"] += 1
            if cfg.strict:
                raise PackError(f"{where(cfg.inputs[file_idx], line)}: {reason} (strict mode)")
            report.rejected.append({"input": cfg.inputs[file_idx], **position(cfg.inputs[file_idx], line),
                                    "reason": reason})
            continue
        n, trained, trained_in_row, non_megatron = counts
        if non_megatron is not None:
            report.warn("non_megatron", f"kept with --allow-non-megatron (packsft-only): {non_megatron}",
                        cfg.inputs[file_idx], line)
        if trained == 0:
            report.warn("no_trained_token", "conversation has no trained token (no assistant turn to train: "
                        "empty, weight 0, or not the last with --train-on last); it is packed as context only",
                        cfg.inputs[file_idx], line)
        data = msgs_json.encode("utf-8")
        counted.append(_Counted(file_idx, line, n, spool.tell(), len(data), trained_in_row if trained else 1,
                                cut, nbytes, _spool_tokens(token_spool, cache)))
        spool.write(data)
    bar.close()
    return counted


def _apply_oversize(cfg: PackConfig, counted: list[_Counted], report: PackReport) -> list[_Counted]:
    kept = []
    for c in counted:
        cost = conversation_cost(c.num_tokens, cfg.context_parallel_size)
        if cost <= cfg.max_seq_len:
            kept.append(c)
            continue
        if cfg.oversize == "error":
            raise PackError(f"{where(cfg.inputs[c.file_idx], c.line)}: conversation has {c.num_tokens} tokens "
                            f"(cost {cost}) > max_seq_len "
                            f"{cfg.max_seq_len}; use --oversize own-row or drop, or a larger --max-seq-length")
        action = "dropped" if cfg.oversize == "drop" else "own row, truncated by the loader"
        entry = {"input": cfg.inputs[c.file_idx], **position(cfg.inputs[c.file_idx], c.line), "tokens": c.num_tokens,
                 "action": action}
        if c.cut:
            entry.update(cut_by_packer=True, input_bytes=c.nbytes)
        report.oversize.append(entry)
        if cfg.oversize == "own-row":
            kept.append(c)
            if c.trained_in_row == 0:
                report.warn("truncation_removes_training",
                            f"conversation has {'more than ' if c.cut else ''}{c.num_tokens} tokens; truncated "
                            f"to max_seq_len {cfg.max_seq_len} "
                            "in its own row it keeps no trained token (its assistant turns all lie beyond the "
                            "cut); use --oversize drop or a larger --max-seq-length", cfg.inputs[c.file_idx],
                            c.line)
    return kept


def _nothing_to_pack(cfg: PackConfig, report: PackReport) -> str:
    """The error of a run that kept no conversation: the counts and the first reasons."""
    lines = [f"no conversation to pack: {report.input_conversations} input {count_word(cfg.inputs)}(s) in "
             f"{', '.join(cfg.inputs)}, {len(report.rejected)} rejected, {len(report.oversize)} oversize (dropped)"]
    lines += [f"  rejected {entry_where(r)}: {r['reason']}" for r in report.rejected[:5]]
    lines += [f"  dropped {entry_where(o)}: {o['tokens']} tokens > max_seq_len {cfg.max_seq_len}"
              for o in report.oversize[:5]]
    if len(report.rejected) > 5 or len(report.oversize) > 5:
        lines.append("  ... (more of them; --strict stops at the first)")
    return "\n".join(lines)


def _stage(name: str) -> None:
    """Publication stage ``name`` (one of :data:`STAGES`) reached: the :data:`STAGE_HOOK_ENV` test hook."""
    hook = os.environ.get(STAGE_HOOK_ENV, "")
    stage, _, sig = hook.partition(":")
    if stage == name:
        os.kill(os.getpid(), getattr(signal, sig or "SIGKILL"))
        time.sleep(0.2)  # let an unblocked handler run here


def _output_paths(cfg: PackConfig) -> dict[str, str]:
    """``{rows, sidecar, report, histogram?}``: the paths a run writes (histogram absent when disabled)."""
    paths = {"rows": cfg.output, "sidecar": str(sidecar_path(cfg.output)),
             "report": cfg.report or cfg.output + ".report.json"}
    histogram = cfg.histogram if cfg.histogram is not None else cfg.output + ".lengths.png"
    if histogram:
        paths["histogram"] = histogram
    if cfg.token_cache:
        paths["token_cache"], paths["token_index"] = map(str, cache_paths(cfg.output))
    return paths


def _spool_tokens(token_spool, cache: bytes | None) -> int:
    """Append one conversation's token cache bytes to ``token_spool``; return their offset (-1: not spooled)."""
    if token_spool is None or cache is None:
        return -1
    offset = token_spool.tell()
    token_spool.write(cache)
    return offset


def _token_cache_writer(cfg: PackConfig, rows: list[list[int]], kept: list[_Counted],
                        temps: dict[str, Path]) -> TokenCacheWriter | None:
    """The token cache writer into fresh temp files (``temps["token_cache"]``, ``temps["token_index"]``)."""
    if not cfg.token_cache:
        return None
    tokens_path, index_path = cache_paths(cfg.output)
    temps["token_cache"], temps["token_index"] = temp_path(tokens_path), temp_path(index_path)
    total = sum(stored_length(c.num_tokens, cfg.max_seq_len) for c in kept)
    return TokenCacheWriter(temps["token_cache"], temps["token_index"], cfg.output, total, len(rows), len(kept),
                            cfg.max_seq_len)


def _cache_row(cache: TokenCacheWriter | None, token_spool, row: list[int], kept: list[_Counted], L: int) -> None:
    """Copy the token cache bytes of ``row``'s conversations from the spool into the cache writer."""
    if cache is None:
        return
    for i in row:
        token_spool.seek(kept[i].token_offset)
        cache.add(token_spool.read(8 * stored_length(kept[i].num_tokens, L)), kept[i].num_tokens)
    cache.end_row()


def _write_rows(cfg: PackConfig, rows: list[list[int]], kept: list[_Counted], spool, tmp: Path,
                cache: TokenCacheWriter | None = None, token_spool=None) -> tuple[int, str]:
    """Write the rows into ``tmp`` (fsynced), and their tokens into ``cache``; return the rows' size in bytes and
    BLAKE2b-160 hex."""
    with open(tmp, "wb") as f:
        out = HashingWriter(f)
        for row in rows:
            parts = []
            for i in row:
                spool.seek(kept[i].offset)
                parts.append(spool.read(kept[i].size)[1:-1])  # strip the list brackets
            out.write(b'{"messages": [' + b", ".join(parts) + b"]}\n")
            _cache_row(cache, token_spool, row, kept, cfg.max_seq_len)
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


class _Terminated(SystemExit):
    """SIGTERM during :func:`run_pack`: unwinds so that every temp file is removed (exit code 143)."""


def _on_sigterm(signum, frame):
    raise _Terminated(128 + signum)


def run_pack(cfg: PackConfig) -> PackReport:
    """Run the whole pipeline for ``cfg`` and return its report (also written to disk).

    Writes ``cfg.output`` (rows), ``cfg.output + ".meta.json"`` (sidecar, with the rows' size and BLAKE2b), the
    JSON report and the length histogram PNG: all to temp names first, then renamed as one unit through a
    publish journal (:func:`packsft.io.publish_files`) with SIGTERM held off, the sidecar last. A run killed at
    any point leaves the previous complete set or the new one: killed during the renames, it leaves the
    journal, and the next packer run or reader (:func:`packsft.io.finish_interrupted_publish`) finishes them.
    Temp files of an earlier killed run are removed at start; SIGTERM (handled while this runs in the main
    thread) removes this run's own.

    Raises:
        ValueError: invalid settings (see :meth:`PackConfig.validate`), unusable tokenizer or prompt format.
        PackError: strict mode met an invalid record, ``oversize="error"`` met a long conversation, or another
            packer is writing the same output.
        SystemExit: 143 on SIGTERM (nothing of this run is left behind).
    """
    cfg.validate()
    handler = None
    if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        try:
            handler = signal.signal(signal.SIGTERM, _on_sigterm)
        except ValueError:  # not the main thread
            handler = None
    try:
        return _run_pack(cfg)
    finally:
        if handler is not None:
            signal.signal(signal.SIGTERM, handler)


def _run_pack(cfg: PackConfig) -> PackReport:
    tok = load_tokenizer(cfg.tokenizer)
    fmt = _prompt_format(cfg, tok)
    report = PackReport(settings={k: v for k, v in asdict(cfg).items() if k not in ("progress",)})
    if fmt.missing_stop_signal(tok):
        report.warn("no_stop_signal", f"{fmt.template_name} writes nothing after an assistant turn's content and "
                    "--no-append-eos is set: no end-of-turn or EOS token is trained, so the model will not learn "
                    "to stop")
    out_dir = Path(cfg.output).resolve().parent
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = _output_paths(cfg)
    with _Lock(cfg.output):
        journal = journal_path(cfg.output)
        complete_publish(journal)  # a run killed while publishing: its set is complete, finish the renames
        for final in {*paths.values(), *map(str, cache_paths(cfg.output)), str(journal)}:
            for stale in stale_temps(final):
                stale.unlink(missing_ok=True)
        temps: dict[str, Path] = {}
        try:
            temps["rows"] = temp_path(cfg.output)
            with tempfile.TemporaryFile(dir=out_dir) as spool, tempfile.TemporaryFile(dir=out_dir) as token_spool:
                counted = _count_all(cfg, spool, report, token_spool)
                kept = _apply_oversize(cfg, counted, report)
                L, cp = cfg.max_seq_len, cfg.context_parallel_size
                costs = [min(conversation_cost(c.num_tokens, cp), L) for c in kept]
                if not kept:
                    raise PackError(_nothing_to_pack(cfg, report))
                rows = pack(costs, L, cfg.algorithm)
                if cfg.shuffle_rows:
                    random.Random(cfg.seed).shuffle(rows)
                _stage("tokenized")
                cache = _token_cache_writer(cfg, rows, kept, temps)
                try:
                    size, digest = _write_rows(cfg, rows, kept, spool, temps["rows"], cache, token_spool)
                    cache_fields = cache.finish(digest) if cache is not None else None
                finally:
                    if cache is not None:
                        cache.close()
            _stage("rows_written")
            lengths = [c.num_tokens for c in kept]
            report.packed_conversations = len(kept)
            report.rows = len(rows)
            report.real_tokens = sum(min(n, L) for n in lengths)
            report.padding_tokens = report.rows * L - report.real_tokens
            report.lower_bound_rows = lower_bound_rows(costs, L) if costs else 0
            _write_outputs(cfg, fmt, tok, report, lengths, rows, costs, paths, temps, size, digest, cache_fields)
        finally:
            for tmp in temps.values():
                tmp.unlink(missing_ok=True)
    return report


def _write_outputs(cfg, fmt, tok, report: PackReport, lengths, rows, costs, paths, temps, size, digest,
                   cache_fields=None) -> None:
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
        "tokenizer_fingerprint": tokenizer_fingerprint(tok),
        "tokenizer": str(cfg.tokenizer),
        "prompt_format": fmt.spec(),
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
    temps["sidecar"] = temp_path(paths["sidecar"])
    temps["sidecar"].write_text(sidecar_text(sidecar), encoding="utf-8")
    _stage("sidecar_written")
    temps["report"] = temp_path(paths["report"])
    temps["report"].write_text(json.dumps(report.to_dict(), indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    if "histogram" in paths:
        from packsft.packing.report import plot_lengths

        temps["histogram"] = temp_path(paths["histogram"])
        plot_lengths(temps["histogram"], lengths, [sum(costs[i] for i in r) for r in rows], cfg.max_seq_len)
    for key in ("sidecar", "report"):
        with open(temps[key], "rb+") as f:
            os.fsync(f.fileno())
    _stage("report_written")
    _publish(paths, temps)


def _input_identity(cfg: PackConfig) -> dict[str, Any]:
    """``{"input_identity": {input: source_identity}}`` for the row-source inputs (none for JSONL only)."""
    found = {p: source_identity(p, cfg.split) for p in cfg.inputs if is_row_source(p)}
    return {"input_identity": found} if found else {}


def _publish(paths: dict[str, str], temps: dict[str, Path]) -> None:
    """Rename the temp files over their outputs as one unit (:func:`packsft.io.publish_files`), the sidecar last,
    with SIGTERM and SIGINT held off.

    A token cache of an earlier run that this one does not write (``token_cache=False``) is removed in the same
    unit.
    """
    held = {signal.SIGTERM, signal.SIGINT}
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, held)
    rows = Path(paths["rows"])

    def hook(final: Path | None) -> None:
        if final is None or final == rows:
            _stage("journal_written" if final is None else "rows_published")

    journal = journal_path(paths["rows"])
    try:
        order = [k for k in ("histogram", "report", "token_index", "token_cache", "rows", "sidecar") if k in temps]
        removes = () if "token_cache" in paths else tuple(cache_paths(paths["rows"]))
        publish_files([(temps[k], Path(paths[k])) for k in order], journal, hook, removes)
        temps.clear()
    except BaseException:
        if journal.exists():  # the temps now belong to the journal: the next run or reader finishes the renames
            temps.clear()
        raise
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)
    _stage("published")
