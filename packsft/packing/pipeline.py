"""The pack pipeline: JSONL conversations -> ``.jsonl.packed`` rows + sidecar + report.

Flow (outputs and formats: ``docs/packing.md``, ``docs/formats.md``):

1. Stream every input line (never the whole file) to worker processes in bounded, ordered batches. Each
   worker parses and validates the record (:mod:`packsft.conversation`) and counts its tokens with
   :func:`packsft.prompt_formats.count_conversation_tokens`, the loader's own tokenization. Invalid lines
   are *rejected* into the report with file, line and reason (or abort with ``strict=True``).
2. The normalised conversation (system message first, carrying its ``tools``) is spooled to a temp file;
   only ``(cost, spool offset)`` stays in memory.
3. Conversations longer than ``max_seq_len`` follow the oversize policy: ``own-row`` (a row of their own,
   truncated by the loader, with a warning), ``drop`` (reported) or ``error`` (abort).
   Conversations with no trained token, own-row conversations whose truncation removes every trained token,
   and a template that trains no stop signal are *warned* about and counted in the report.
4. The packing algorithm (:mod:`packsft.packing.algorithms`) assigns conversations to rows using costs
   ``ceil(n / 2cp) * 2cp``; rows are written atomically as ``{"messages": [...]}`` lines, then the sidecar
   ``<output>.meta.json`` and the report.

Output is a deterministic function of the inputs and settings: batches come back in input order whatever
the number of workers, and no step depends on hash order.
"""

from __future__ import annotations

import dataclasses
import json
import multiprocessing as mp
import os
import random
import tempfile
import warnings
from collections import deque
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from tqdm import tqdm

from packsft import __version__
from packsft.conversation import ConversationError, iter_jsonl_lines, parse_record
from packsft.io import atomic_open, write_json_atomic
from packsft.layout import IGNORE_INDEX, check_max_seq_len, conversation_cost
from packsft.packing.algorithms import ALGORITHMS, lower_bound_rows, pack
from packsft.prompt_formats import (
    MEGATRON_PRESETS,
    TRAIN_ON,
    NonMegatronError,
    PromptFormatError,
    get_prompt_format,
    tokenize_conversation,
)
from packsft.sidecar import efficiency, sidecar_path, write_sidecar
from packsft.tokenizer import load_tokenizer, tokenizer_fingerprint

OVERSIZE_POLICIES = ("own-row", "drop", "error")
_BATCH = 64


@dataclass
class PackConfig:
    """Settings of one packing run (the CLI's flags).

    Attributes:
        inputs: input JSONL files, read in order.
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
        algorithm: ``next-fit`` or ``best-fit-decreasing``.
        oversize: ``own-row``, ``drop`` or ``error`` for conversations longer than ``max_seq_len``.
        seed: seeds the row order when ``shuffle_rows`` is set; recorded in the sidecar.
        shuffle_rows: write rows in a seeded random order instead of creation order.
        num_workers: tokenizer processes (0 = in this process).
        input_key, output_key: prompt/response records instead of ``messages``.
        default_system_prompt: system content given to conversations without one.
        strict: abort at the first invalid record instead of reporting it.
        allow_non_megatron: keep (warned, kind ``non_megatron``) a conversation that a Megatron preset can
            tokenize but Megatron-LM's ``SFTTokenizer`` refuses, instead of rejecting it; the file is then
            packsft-only (sidecar ``megatron_lm_compatible: false``).
        report: JSON report path (default ``<output>.report.json``).
        histogram: PNG path (default ``<output>.lengths.png``); ``""`` disables it.
        progress: show a tqdm progress bar.
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
    algorithm: str = "best-fit-decreasing"
    oversize: str = "own-row"
    seed: int = 1234
    shuffle_rows: bool = False
    num_workers: int = 0
    input_key: str | None = None
    output_key: str | None = None
    default_system_prompt: str = ""
    strict: bool = False
    allow_non_megatron: bool = False
    report: str | None = None
    histogram: str | None = None
    progress: bool = True

    def validate(self) -> None:
        """Raise ``ValueError`` naming the bad setting."""
        if not self.inputs:
            raise ValueError("at least one --input is required")
        for p in self.inputs:
            if not Path(p).is_file():
                raise ValueError(f"--input {p}: no such file")
        check_max_seq_len(self.max_seq_len, self.context_parallel_size, self.sequence_parallel_size)
        if self.algorithm not in ALGORITHMS:
            raise ValueError(f"--algorithm {self.algorithm!r}: choose one of {', '.join(ALGORITHMS)}")
        if self.oversize not in OVERSIZE_POLICIES:
            raise ValueError(f"--oversize {self.oversize!r}: choose one of {', '.join(OVERSIZE_POLICIES)}")
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
    _W.update(cfg=cfg, tok=tok, fmt=fmt, lenient=dataclasses.replace(fmt, allow_non_megatron=True))


def _process_batch(batch: list[tuple[int, int, str | None, str | None]]) -> list[tuple]:
    """Parse, validate and count one batch of lines: ``(file_idx, line, text, decode_error)`` each.

    Returns:
        ``(file_idx, line, (num_tokens, trained, trained_in_row, non_megatron), row_messages_json, None)``
        for a good line (``trained``: tokens the model is trained to predict; ``trained_in_row``: those of them
        within the first ``max_seq_len`` tokens, what an own-row truncation keeps; ``non_megatron``: why
        Megatron-LM would refuse a line kept with ``allow_non_megatron``, else ``None``), or
        ``(file_idx, line, None, None, reason)`` for a rejected one.
    """
    cfg, tok, fmt = _W["cfg"], _W["tok"], _W["fmt"]
    out = []
    for file_idx, line, text, decode_error in batch:
        path = cfg.inputs[file_idx]
        try:
            if decode_error:
                raise ConversationError(path, line, "", decode_error)
            try:
                record = json.loads(text)
            except json.JSONDecodeError as e:
                raise ConversationError(path, line, "", f"not valid JSON: {e.msg} (column {e.colno})") from e
            conv = parse_record(record, path, line, input_key=cfg.input_key, output_key=cfg.output_key,
                                default_system_prompt=cfg.default_system_prompt)
            non_megatron = None
            try:
                tokens, targets = tokenize_conversation(conv.messages, tok, fmt, conv.tools,
                                                        conv.chat_template_kwargs)
            except NonMegatronError as e:
                if not cfg.allow_non_megatron:
                    raise
                non_megatron = str(e)
                tokens, targets = tokenize_conversation(conv.messages, tok, _W["lenient"], conv.tools,
                                                        conv.chat_template_kwargs)
            trained = [t != IGNORE_INDEX for t in targets[1:]]
            counts = (len(tokens), sum(trained), sum(trained[: cfg.max_seq_len - 1]), non_megatron)
            out.append((file_idx, line, counts, json.dumps(conv.to_row_messages(), ensure_ascii=False), None))
        except ConversationError as e:
            out.append((file_idx, line, None, None, f"{e.field + ': ' if e.field else ''}{e.reason}"))
        except PromptFormatError as e:
            out.append((file_idx, line, None, None, f"{cfg.prompt_format}: {e}"))
    return out


# ---------------------------------------------------------------- main side
def _batches(cfg: PackConfig):
    batch = []
    for file_idx, path in enumerate(cfg.inputs):
        for line, text, err in iter_jsonl_lines(path):
            batch.append((file_idx, line, text, err))
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
        """Record a warning; the first 5 of each kind are also issued as :class:`PackWarning`."""
        self.warnings.append({"kind": kind, "input": input, "line": line, "message": message})
        seen = sum(w["kind"] == kind for w in self.warnings)
        if seen <= 5:
            more = " (further ones of this kind are only listed in the report)" if seen == 5 else ""
            warnings.warn((f"{input}:{line}: {message}" if input else message) + more, PackWarning, stacklevel=3)

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
        for w in self.warnings[:5]:
            where = f"{w['input']}:{w['line']}: " if w.get("input") else ""
            lines.append(f"  warning {where}{w['message']}")
        if len(self.warnings) > 5:
            lines.append(f"  ... {len(self.warnings) - 5} more warnings in the report")
        for r in self.rejected[:5]:
            lines.append(f"  rejected {r['input']}:{r['line']}: {r['reason']}")
        if len(self.rejected) > 5:
            lines.append(f"  ... {len(self.rejected) - 5} more rejected lines in the report")
        lines += [f"{k:<20}: {v}" for k, v in self.outputs.items()]
        return "\n".join(lines)


def _count_all(cfg: PackConfig, spool, report: PackReport) -> list[_Counted]:
    counted: list[_Counted] = []
    bar = tqdm(desc="tokenizing", unit="conv", disable=not cfg.progress, mininterval=1.0)
    for file_idx, line, counts, msgs_json, reason in _ordered_results(cfg):
        bar.update(1)
        report.input_conversations += 1
        stats = report.per_input.setdefault(cfg.inputs[file_idx], {"conversations": 0, "rejected": 0})
        stats["conversations"] += 1
        if reason is not None:
            stats["rejected"] += 1
            if cfg.strict:
                raise PackError(f"{cfg.inputs[file_idx]}:{line}: {reason} (strict mode)")
            report.rejected.append({"input": cfg.inputs[file_idx], "line": line, "reason": reason})
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
        counted.append(_Counted(file_idx, line, n, spool.tell(), len(data), trained_in_row if trained else 1))
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
        where = f"{cfg.inputs[c.file_idx]}:{c.line}"
        if cfg.oversize == "error":
            raise PackError(f"{where}: conversation has {c.num_tokens} tokens (cost {cost}) > max_seq_len "
                            f"{cfg.max_seq_len}; use --oversize own-row or drop, or a larger --max-seq-length")
        action = "dropped" if cfg.oversize == "drop" else "own row, truncated by the loader"
        report.oversize.append({"input": cfg.inputs[c.file_idx], "line": c.line, "tokens": c.num_tokens,
                                "action": action})
        if cfg.oversize == "own-row":
            kept.append(c)
            if c.trained_in_row == 0:
                report.warn("truncation_removes_training",
                            f"conversation has {c.num_tokens} tokens; truncated to max_seq_len {cfg.max_seq_len} "
                            "in its own row it keeps no trained token (its assistant turns all lie beyond the "
                            "cut); use --oversize drop or a larger --max-seq-length", cfg.inputs[c.file_idx],
                            c.line)
    return kept


def _write_rows(cfg: PackConfig, rows: list[list[int]], kept: list[_Counted], spool) -> None:
    with atomic_open(cfg.output, "wb") as out:
        for row in rows:
            parts = []
            for i in row:
                spool.seek(kept[i].offset)
                parts.append(spool.read(kept[i].size)[1:-1])  # strip the list brackets
            out.write(b'{"messages": [' + b", ".join(parts) + b"]}\n")


def run_pack(cfg: PackConfig) -> PackReport:
    """Run the whole pipeline for ``cfg`` and return its report (also written to disk).

    Writes ``cfg.output`` (rows), ``cfg.output + ".meta.json"`` (sidecar), the JSON report and the length
    histogram PNG, each atomically.

    Raises:
        ValueError: invalid settings (see :meth:`PackConfig.validate`), unusable tokenizer or prompt format.
        PackError: strict mode met an invalid record, or ``oversize="error"`` met a long conversation.
    """
    cfg.validate()
    tok = load_tokenizer(cfg.tokenizer)
    fmt = _prompt_format(cfg, tok)
    report = PackReport(settings={k: v for k, v in asdict(cfg).items() if k not in ("progress",)})
    if fmt.missing_stop_signal(tok):
        report.warn("no_stop_signal", f"{fmt.template_name} writes nothing after an assistant turn's content and "
                    "--no-append-eos is set: no end-of-turn or EOS token is trained, so the model will not learn "
                    "to stop")
    out_dir = Path(cfg.output).resolve().parent
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryFile(dir=out_dir) as spool:
        counted = _count_all(cfg, spool, report)
        kept = _apply_oversize(cfg, counted, report)
        L, cp = cfg.max_seq_len, cfg.context_parallel_size
        costs = [min(conversation_cost(c.num_tokens, cp), L) for c in kept]
        if not kept:
            raise PackError(f"no conversation to pack: {report.input_conversations} input line(s), "
                            f"{len(report.rejected)} rejected, {len(report.oversize)} oversize "
                            f"({', '.join(cfg.inputs)}); see the reasons with --strict")
        rows = pack(costs, L, cfg.algorithm)
        if cfg.shuffle_rows:
            random.Random(cfg.seed).shuffle(rows)
        _write_rows(cfg, rows, kept, spool)
    lengths = [c.num_tokens for c in kept]
    report.packed_conversations = len(kept)
    report.rows = len(rows)
    report.real_tokens = sum(min(n, L) for n in lengths)
    report.padding_tokens = report.rows * L - report.real_tokens
    report.lower_bound_rows = lower_bound_rows(costs, L) if costs else 0
    _write_outputs(cfg, fmt, tok, report, lengths, rows, costs)
    return report


def _write_outputs(cfg, fmt, tok, report: PackReport, lengths, rows, costs) -> None:
    report_path = cfg.report or cfg.output + ".report.json"
    histogram = cfg.histogram if cfg.histogram is not None else cfg.output + ".lengths.png"
    report.outputs = {"rows": cfg.output, "sidecar": str(sidecar_path(cfg.output)), "report": report_path}
    if histogram:
        from packsft.packing.report import plot_lengths

        plot_lengths(histogram, lengths, [sum(costs[i] for i in r) for r in rows], cfg.max_seq_len)
        report.outputs["histogram"] = histogram
    sidecar = {
        "packsft_version": __version__,
        "inputs": list(cfg.inputs),
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
        "megatron_lm_compatible": (None if fmt.name not in MEGATRON_PRESETS
                                   else "non_megatron" not in report.warning_counts()),
        "counts": {"input_conversations": report.input_conversations, "packed_conversations": len(lengths),
                   "rejected": len(report.rejected), "oversize": len(report.oversize),
                   "warnings": report.warning_counts(), "rows": report.rows,
                   "real_tokens": report.real_tokens, "padding_tokens": report.padding_tokens},
    }
    write_sidecar(cfg.output, sidecar)
    write_json_atomic(report_path, report.to_dict())
