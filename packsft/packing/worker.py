"""The worker side of the packer: a shard read, parsed, validated, tokenized and counted (:func:`count_shard`), its
accepted conversations spooled, in a worker process, a Ray actor or the packer's own process."""

from __future__ import annotations

import dataclasses
import os
import signal
import threading
import time
from array import array
from dataclasses import dataclass, field
from typing import Any

from packsft.conversation import ConversationError
from packsft.layout import conversation_cost
from packsft.packing import energon
from packsft.packing.config import PackConfig
from packsft.packing.records import parse_line
from packsft.packing.shards import Shard, ShardResult, read_shard
from packsft.packing.signals import STOP_SIGNALS
from packsft.packing.split import split_conversation
from packsft.packing.truncation import tokenize_record, tokenized_whole
from packsft.prompt_formats import (
    NonMegatronError,
    PromptFormatError,
    Tokenization,
    tokenize_conversations,
    unrendered,
)
from packsft.record_formats import ROW_JSON, record_converter, source_field
from packsft.token_cache import encode_runs, stored_length

_BATCH = 64
_BATCH_BYTES = 1 << 20
"""Input lines are tokenized in batches of up to :data:`_BATCH` lines and :data:`_BATCH_BYTES` bytes
(:func:`packsft.prompt_formats.tokenize_conversations`)."""
WORKER_HOOK_ENV = "PACKSFT_PACK_WORKER_HOOK"
"""Test hook: ``SHARD:SIGNAL`` (e.g. ``1:SIGKILL``) makes the worker reading shard SHARD send itself SIGNAL."""


@dataclass
class WorkerState:
    """What a process (or a Ray actor) needs to count shards: set up once, used for each shard.

    Attributes:
        cfg: the run's settings.
        tokenization: the tokenizer and the run's prompt format (:attr:`tok`, :attr:`fmt`); lenient: ``fmt``
            keeping conversations Megatron-LM refuses (``--allow-non-megatron``).
        convert: the record converter (``None``: ``messages`` records).
        spool_dir: the run's temp folder, holding the spools and the marker files.
        in_worker: a worker process or Ray actor: writes a marker file per shard and acts on
            :data:`WORKER_HOOK_ENV`.
        spool_name: ``None``: one spool per process, named by its id and appended to; else the name of this
            shard's own spools (the Ray engine), closed after the shard.
        files: the open spools by key (``spool``, ``token_spool``) with their paths.
    """

    cfg: PackConfig
    tokenization: Tokenization
    lenient: Any
    convert: Any
    spool_dir: str
    in_worker: bool
    spool_name: str | None = None
    files: dict[str, tuple[Any, str]] = field(default_factory=dict)

    @property
    def tok(self) -> Any:
        """The tokenizer."""
        return self.tokenization.tokenizer

    @property
    def fmt(self) -> Any:
        """The run's prompt format."""
        return self.tokenization.fmt

    def spool(self, key: str = "spool"):
        """``(file, path)`` of spool ``key`` (``spool``: messages JSON, ``token_spool``: token cache bytes), opened
        at its first shard, appended to, flushed after each shard (named by the process id, or by
        :attr:`spool_name`)."""
        if key not in self.files:
            name = self.spool_name if self.spool_name is not None else os.getpid()
            path = os.path.join(self.spool_dir, f"{'tokens' if key == 'token_spool' else 'spool'}.{name}")
            # open for the process's lifetime
            self.files[key] = (open(path, "wb" if self.spool_name is not None else "ab"), path)  # noqa: SIM115
        return self.files[key]

    def close(self) -> None:
        """Close the spools."""
        for f, _ in self.files.values():
            f.close()
        self.files.clear()


_worker: WorkerState | None = None
"""This process's state (:func:`init_worker`): what :func:`count_shard` uses when given none."""


def worker_state(cfg: PackConfig, spool_dir: str, in_worker: bool,
                 tokenization: Tokenization | None = None) -> WorkerState:
    """A :class:`WorkerState` for ``cfg``: its tokenization (given resolved, else resolved here: the tokenizer
    loaded), record converter."""
    tokenization = tokenization if tokenization is not None else cfg.tokenization.resolve()
    return WorkerState(cfg, tokenization, dataclasses.replace(tokenization.fmt, allow_non_megatron=True),
                       record_converter(cfg.record_format, cfg.adapter), spool_dir, in_worker)


def init_worker(cfg: PackConfig, spool_dir: str, in_worker: bool, tokenization: Tokenization | None = None) -> None:
    """Set up this process to read shards (:func:`worker_state`); a worker process (``in_worker``) also leaves stop
    signals to the packer and ends with it."""
    global _worker
    if in_worker:
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # the main process stops the workers
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a forked worker inherits the packer's handler
        signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)  # blocked while the packer forked (local_engine)
        _exit_with_parent(os.getppid())
    _worker = worker_state(cfg, spool_dir, in_worker, tokenization)


def _exit_with_parent(parent: int, poll: float = 0.5) -> None:
    """End this worker process soon after the packer that spawned it is gone (a ``kill -9`` of the packer
    leaves nobody to stop it): a daemon thread polls the parent pid every ``poll`` seconds."""

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(poll)
        os._exit(1)

    threading.Thread(target=watch, name="packsft-parent-watch", daemon=True).start()


def close_worker() -> None:
    """Close this process's spools and forget its state (after an in-process run)."""
    global _worker
    if _worker is not None:
        _worker.close()
    _worker = None


def worker_fingerprint() -> str:
    """:func:`packsft.tokenizer.tokenizer_fingerprint` of this worker's tokenizer (a pool task)."""
    return _worker.tokenization.fingerprint


def count_shard(shard: Shard, state: WorkerState | None = None) -> ShardResult:
    """Read, validate, tokenize and count one shard, spooling the accepted conversations (in a worker).

    With ``token_cache`` the int32 token ids and targets (:func:`packsft.token_cache.encode_conversation`) go
    to a second per-worker spool next to the messages JSON, their offsets returned as an array.

    Args:
        state: the worker's state; ``None``: this process's (:func:`init_worker`).
    """
    import numpy as np

    state = state if state is not None else _worker
    cfg = state.cfg
    # which shard this worker reads, should it die (an in-process run has nobody to tell)
    marker = os.path.join(state.spool_dir, f"worker.{os.getpid()}") if state.in_worker else None
    if marker:
        with open(marker, "w") as f:
            f.write(str(shard.index))
    _worker_hook(state, shard.index)
    spool, spool_path = state.spool()
    token_spool, token_spool_path = state.spool("token_spool") if cfg.token_cache else (None, None)
    path = cfg.inputs[shard.file_idx]
    L, cp = cfg.max_seq_len, cfg.context_parallel_size
    ntok, offsets, sizes, token_offsets = array("i"), array("q"), array("q"), array("q")
    rejected, warns, oversize, split, rejected_turns = [], [], [], [], []
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
            yield from zip(batch, _process_lines(state, path, batch))

    def add(n: int, msgs_json: str, tokens: list[int], runs: list[int]) -> None:  # one conversation to the spools
        nonlocal spool_pos, token_pos
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
            run_block.extend(runs if k == n else runs_head(runs, k))
        if len(msg_block) >= 1024 or len(tok_block) >= 1 << 20:
            write_block()

    for (line, nbytes, _, _), (counts, msgs_json, reason, cut, tokens, runs, pieces) in processed():
        lines, conversations, nbytes_total = line, conversations + 1, nbytes_total + nbytes
        if reason is not None:
            rejected.append((line, reason))
            if cfg.strict:
                break
            continue
        n, trained, trained_in_row, notes, (uncut, exact) = counts
        warns.extend((kind, line, message) for kind, message in notes)
        if trained == 0 and pieces is None:
            warns.append(("no_trained_token", line, "conversation has no trained token (no assistant turn to "
                          "train: empty, weight 0, or not the last with --train-on last); it is packed as context "
                          "only"))
        if pieces is not None:  # --oversize split: the pieces instead of the conversation
            split.append((len(ntok), len(pieces[0]), line, n, nbytes))
            rejected_turns.extend((line, count, reason) for count, reason in pieces[1])
            for piece_json, piece_tokens, piece_runs in pieces[0]:
                trained_fitting += trained_in(piece_runs, 1, len(piece_tokens)) > 0
                add(len(piece_tokens), piece_json, piece_tokens, piece_runs)
            continue
        if conversation_cost(n, cp) > L:
            oversize.append((len(ntok), line, n, cut, uncut, exact, nbytes, trained, trained_in_row))
        elif trained_in_row:
            trained_fitting += 1
        add(n, msgs_json, tokens, runs)
    write_block()
    spool.flush()
    if token_spool is not None:
        token_spool.flush()
    if marker:
        with open(marker, "w") as f:  # this shard is done: a death from now on is not its fault
            f.write(f"{shard.index} done")
    if state.spool_name is not None:  # one spool per shard: closed, so that other hosts see all of it
        for key in ("spool", "token_spool"):
            if key in state.files:
                os.fsync(state.files[key][0].fileno())
                state.files.pop(key)[0].close()
    lines = total[0] if total else lines
    return ShardResult(shard, lines, conversations, spool_path, np.frombuffer(ntok, np.int32),
                       np.frombuffer(offsets, np.int64), np.frombuffer(sizes, np.int64), rejected, warns,
                       oversize, nbytes_total, token_spool_path,
                       np.frombuffer(token_offsets, np.int64) if token_spool is not None else None,
                       trained_fitting, split, rejected_turns)


def _worker_hook(state: WorkerState, index: int) -> None:
    shard, _, sig = os.environ.get(WORKER_HOOK_ENV, "").partition(":")
    if shard == str(index) and state.in_worker:
        os.kill(os.getpid(), getattr(signal, sig or "SIGKILL"))
        time.sleep(1)


def _process_lines(state: WorkerState, path: str, items: list[tuple[int, int, str | None, str | None]]) -> list[tuple]:
    """Parse, validate and tokenize a batch of input lines or rows (in a worker), as ``read_shard`` yields them.

    The whole conversations are tokenized together (:func:`packsft.prompt_formats.tokenize_conversations`);
    under ``own-row`` a conversation longer than :func:`packsft.packing.truncation.own_row_window` is then cut
    there (:mod:`packsft.packing.truncation`), and the stored, cut conversation is the one counted.

    Returns:
        Per line, ``(counts, row_messages_json, None, cut, tokens, runs, pieces)`` for a good line, with ``counts`` =
        ``(num_tokens, trained, trained_in_row, notes, uncut)`` (``trained``: tokens the model is trained to
        predict, or at least 1 for a cut conversation (its cut-off part is not counted); ``trained_in_row``:
        those within the first ``max_seq_len`` tokens, what the loader's truncation keeps; ``notes``: its
        warnings ``(kind, message)``: ``non_megatron`` (kept with ``--allow-non-megatron``) and those of
        :func:`packsft.prompt_formats.unrendered`; ``uncut``: ``(tokens, exact)`` before the packer's cut
        (:mod:`packsft.packing.truncation`); ``cut``: the packer cut it; ``tokens``: list
        of int ids, ``runs``: their targets as runs, ``tokenize_conversation(..., runs=True)``; ``pieces``:
        ``None``, or with ``--oversize split`` for a conversation longer than a row ``([(row_messages_json,
        tokens, runs)], [(tokens, reason)])``, its pieces (:mod:`packsft.packing.split`) and its rejected turns),
        or ``(None, None, reason, False, None, None, None)`` for a rejected line.
    """
    cfg = state.cfg
    parsed: list = []  # per line: (conv, record, source), or its rejection
    text_only = energon.is_energon(path)  # an Energon sample: refused with media
    for line, _, text, decode_error in items:
        try:
            parsed.append(parse_line(path, line, text, decode_error, state.convert, cfg.record_format, text_only,
                                     input_key=cfg.input_key, output_key=cfg.output_key,
                                     default_system_prompt=cfg.default_system_prompt))
        except ConversationError as e:
            parsed.append(_rejected(f"{e.field + ': ' if e.field else ''}{e.reason}"))
    whole = [i for i, p in enumerate(parsed) if p[0] is not None and tokenized_whole(p[0], cfg)]
    known = [{} for _ in whole] if cfg.oversize in ("own-row", "split") else None  # for the cuts of long ones
    first = dict(zip(whole, tokenize_conversations(
        [(parsed[i][0].messages, parsed[i][0].tools, parsed[i][0].chat_template_kwargs) for i in whole],
        state.tokenization, known, runs=True)))
    memo = dict(zip(whole, known)) if known else {}
    return [p if p[0] is None else _finish_line(state, *p, first.get(i), memo.get(i))
            for i, p in enumerate(parsed)]


def _rejected(reason: str) -> tuple:
    return None, None, reason, False, None, None, None


def _finish_line(state: WorkerState, conv, record, source, first, known=None) -> tuple:
    """One line's :func:`_process_lines` result, from its parsed conversation, ``first`` and ``known`` (as in
    :func:`packsft.packing.truncation.tokenize_record`)."""
    cfg, tok, fmt = state.cfg, state.tok, state.fmt
    try:
        non_megatron = None
        try:
            conv, tokens, runs, cut, uncut = tokenize_record(conv, tok, fmt, cfg, first, known)
        except NonMegatronError as e:
            if not cfg.allow_non_megatron:
                raise
            non_megatron = _input_turn(e, record, source, cfg.record_format)  # the input's own message index
            conv, tokens, runs, cut, uncut = tokenize_record(conv, tok, state.lenient, cfg, known=known)
    except PromptFormatError as e:
        return _rejected(f"{cfg.prompt_format}: {_input_turn(e, record, source, cfg.record_format)}")
    n = len(tokens)
    trained = trained_in(runs, 1, n)  # targets[1:], the tokens predicted
    in_row = trained if n <= cfg.max_seq_len else trained_in(runs, 1, cfg.max_seq_len)
    notes = unrendered(conv.messages, conv.tools, fmt)
    if non_megatron is not None:
        notes.insert(0, ("non_megatron", f"kept with --allow-non-megatron (packsft-only): {non_megatron}"))
    counts = (n, max(1, in_row) if cut else trained, in_row, notes, uncut)
    pieces = None
    if cfg.oversize == "split" and conversation_cost(n, cfg.context_parallel_size) > cfg.max_seq_len:
        got = split_conversation(conv, state.tokenization, cfg.max_seq_len, cfg.context_parallel_size,
                                 fmt.train_on, known)
        pieces = ([(ROW_JSON(c.to_row_messages()), t, r) for c, t, r, _ in got.pieces],
                  [(count, _input_turn(err, record, source, cfg.record_format)) for _, count, err in got.rejected])
    return counts, ROW_JSON(conv.to_row_messages()) if pieces is None else None, None, cut, tokens, runs, pieces


def trained_in(runs: list[int], start: int, end: int) -> int:
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


def runs_head(runs: list[int], k: int) -> list[int]:
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
