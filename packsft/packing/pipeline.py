"""The pack pipeline: JSONL conversations -> ``.jsonl.packed`` rows + sidecar + report (:func:`run_pack`, which
alone picks the engine and runs the stages in order).

Flow (outputs and formats: ``docs/packing.md``, ``docs/formats.md``):

1. The inputs are cut into line-aligned byte ranges (:mod:`packsft.packing.shards`, independent of the worker
   count). Each shard is read (:func:`~packsft.packing.shards.read_shard`), parsed, validated
   (:mod:`packsft.conversation`) and tokenized with :func:`packsft.prompt_formats.tokenize_conversation`, the
   loader's own tokenization, by :func:`packsft.packing.worker.count_shard`: in ``num_workers`` processes (a
   ``ProcessPoolExecutor``, :mod:`packsft.packing.local_engine`) or in this one. Invalid
   lines are *rejected* into the report with file, line (or row) and reason (or abort with ``strict=True``); line
   numbers are counted per shard and made absolute by the main process (:mod:`packsft.packing.merge`).
2. The normalised conversation (system message first, carrying its ``tools``) is appended to the worker's
   spool file; a shard comes back as numpy arrays (tokens, spool offset and size per conversation) and the
   few rejected, warned and oversize lines, so the main process holds no object per conversation.
   Lines over ``max_conversation_bytes`` are rejected unparsed. A worker that dies fails the run
   (:class:`~packsft.packing.config.PackError` naming its shard).
3. Conversations longer than ``max_seq_len`` follow the oversize policy: ``own-row`` (a row of their own, cut
   by the worker to :func:`~packsft.packing.truncation.own_row_window` tokens before counting, truncated to
   ``max_seq_len`` by the loader, with a warning), ``drop`` (reported), ``error`` (abort) or ``split`` (cut by
   the worker between turns into pieces that fit, each counted and stored as a conversation:
   :mod:`packsft.packing.split`).
   Conversations with no trained token, own-row conversations whose truncation removes every trained token,
   and a template that trains no stop signal are *warned* about and counted in the report.
4. The packing algorithm (:mod:`packsft.packing.algorithms`) assigns conversations to rows using costs
   ``ceil(n / 2cp) * 2cp``; rows (``{"messages": [...]}`` lines, hashed as written: :mod:`packsft.packing.rows`),
   sidecar ``<output>.meta.json`` (with the rows' size and hash), report and histogram go to temp names, then
   are renamed over the outputs as one unit (a roll-forward journal) with SIGTERM held off, the sidecar last
   (:mod:`packsft.packing.publish`).
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

import json
import os
import shutil
import signal
import tempfile
from dataclasses import asdict
from pathlib import Path
from typing import Any

from packsft import __version__
from packsft.io import journal_path, stale_temps, temp_path
from packsft.layout import conversation_cost
from packsft.packing.algorithms import lower_bound_rows, pack_order
from packsft.packing.config import PackConfig, PackError, check_writable, output_paths
from packsft.packing.engine import Engine
from packsft.packing.local_engine import LocalEngine
from packsft.packing.merge import count_all, nothing_to_pack, nothing_trained
from packsft.packing.publish import OutputLock, finish_publish, publish, stage
from packsft.packing.report import PackReport
from packsft.packing.rows import shuffled_rows, token_cache_writer
from packsft.packing.shards import plan_shards
from packsft.packing.signals import STOPS, hold_sigterm, restore_handler, signals_held
from packsft.packing.sources import is_row_source, source_identity
from packsft.packing.worker import close_worker
from packsft.prompt_formats import MEGATRON_PRESETS
from packsft.record_formats import adapter_identity
from packsft.sidecar import cache_settings_blake2b, rows_file_fields, sidecar_text, tokenization_fields
from packsft.token_cache import cache_paths


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
    STOPS.clear()
    held, previous, previous_int = hold_sigterm()
    try:
        engine = _engine(cfg)
        with engine.session():
            if held:
                hold_sigterm()  # a session may install its own (ray.init: sys.exit(15), and a C-level one)
            return _run_pack(cfg, engine)
    finally:
        if held:
            restore_handler(signal.SIGTERM, previous)
        if previous_int is not None:
            restore_handler(signal.SIGINT, previous_int)


def _run_pack(cfg: PackConfig, engine: Engine) -> PackReport:
    import numpy as np

    tokenization = cfg.tokenization.resolve()
    tok, fmt = tokenization.tokenizer, tokenization.fmt
    report = PackReport(settings={k: v for k, v in asdict(cfg).items() if k not in ("progress",)},
                        working_dir=os.getcwd())
    if fmt.missing_stop_signal(tok):
        report.warn("no_stop_signal", f"{fmt.template_name} writes nothing after an assistant turn's content and "
                    "--no-append-eos is set: no end-of-turn or EOS token is trained, so the model will not learn "
                    "to stop")
    out_dir = Path(cfg.output).resolve().parent
    paths = output_paths(cfg)
    check_writable(paths)
    spool_name = cfg.output + ".spool"
    with OutputLock(cfg.output):
        journal = journal_path(cfg.output)
        finish_publish(journal)  # a run killed while publishing: its set is complete, finish the renames
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
                try:
                    fingerprint: list[str] = []  # the sidecar's, when a worker process took it
                    shards = plan_shards(cfg.inputs, cfg.shard_bytes)
                    counted = count_all(cfg, engine.count(shards, spool_dir, tokenization, fingerprint), report)
                finally:
                    close_worker()  # this process's spools, when it counted shards itself
                L, cp = cfg.max_seq_len, cfg.context_parallel_size
                if not len(counted.num_tokens):
                    raise PackError(nothing_to_pack(cfg, report))
                if not counted.trained:
                    raise PackError(nothing_trained(cfg, report, len(counted.num_tokens)))
                costs = np.minimum(conversation_cost(counted.num_tokens.astype(np.int64), cp), L)
                order, starts = pack_order(costs, L, cfg.algorithm)
                report.lower_bound_rows = lower_bound_rows(costs, L)
                if cfg.shuffle_rows:
                    order, starts = shuffled_rows(order, starts, cfg.seed, np)
                report.rows = len(starts)
                stage("tokenized")
                cache = token_cache_writer(cfg, report.rows, counted, temps, np)
                try:
                    size, digest = engine.write_rows(order, starts, counted, temps["rows"], spool_dir, cache)
                    cache_fields = cache.finish(digest) if cache is not None else None
                finally:
                    if cache is not None:
                        cache.close()
            finally:
                with signals_held():  # a stop signal inside rmtree would leave the folder half removed
                    shutil.rmtree(spool_dir, ignore_errors=True)
            stage("rows_written")
            lengths = counted.num_tokens
            report.packed_conversations = len(lengths)
            report.real_tokens = int(np.minimum(lengths, L).sum())
            report.padding_tokens = report.rows * L - report.real_tokens
            row_fill = np.add.reduceat(costs[order], starts) if report.rows else costs[:0]
            _write_outputs(cfg, tokenization, report, lengths, row_fill, paths, temps, size, digest, cache_fields,
                           fingerprint[0] if fingerprint else None, counted.uncut, counted)
        finally:
            with signals_held():
                for tmp in temps.values():
                    tmp.unlink(missing_ok=True)
    return report


def _write_outputs(cfg, tokenization, report: PackReport, lengths, row_fill, paths, temps, size, digest,
                   cache_fields=None, fingerprint: str | None = None, uncut=(), counted=None) -> None:
    """Write the sidecar, the report and the histogram to temp names and publish the set (``fingerprint``: the
    tokenizer's, when already taken; ``uncut``: :attr:`packsft.packing.merge.Counted.uncut`, the oversize
    conversations' lengths before the cut, which the histogram shows; ``counted``: the
    :class:`~packsft.packing.merge.Counted`, whose split conversations the histogram shows whole)."""
    report.outputs = dict(paths)
    report.rows_file = {"size": size, "blake2b": digest}
    sidecar = {
        "packsft_version": __version__,
        "inputs": list(cfg.inputs),
        **({"split": cfg.split} if cfg.split is not None else {}),
        **_input_identity(cfg),
        "record_format": cfg.record_format,
        "megatron_lm_compatible": (None if tokenization.fmt.name not in MEGATRON_PRESETS
                                   else "non_megatron" not in report.warning_counts()),
        **(adapter_identity(cfg.adapter) if cfg.adapter else {}),
        **tokenization_fields(tokenization, fingerprint),
        "max_seq_len": cfg.max_seq_len,
        "context_parallel_size": cfg.context_parallel_size,
        "sequence_parallel_size": cfg.sequence_parallel_size,
        "algorithm": cfg.algorithm,
        "seed": cfg.seed,
        "shuffle_rows": cfg.shuffle_rows,
        "default_system_prompt": cfg.default_system_prompt,
        "oversize": cfg.oversize,
        "counts": {"input_conversations": report.input_conversations, "packed_conversations": len(lengths),
                   "rejected": len(report.rejected), "oversize": len(report.oversize),
                   **({"split_conversations": report.split_conversations, "pieces": report.pieces,
                       "rejected_turns": len(report.rejected_turns)} if cfg.oversize == "split" else {}),
                   "warnings": report.warning_counts(), "rows": report.rows,
                   "real_tokens": report.real_tokens, "padding_tokens": report.padding_tokens},
        **rows_file_fields(size, digest),
        **({"token_cache": cache_fields} if cache_fields else {}),
    }
    if cache_fields:
        cache_fields["settings_blake2b"] = cache_settings_blake2b(sidecar)
    temps["sidecar"] = temp_path(paths["sidecar"])
    temps["sidecar"].write_text(sidecar_text(sidecar), encoding="utf-8")
    stage("sidecar_written")
    temps["report"] = temp_path(paths["report"])
    temps["report"].write_text(json.dumps(report.to_dict(), indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    if "histogram" in paths:
        from packsft.packing.report import plot_lengths  # looked up at each run (a test wraps it)

        temps["histogram"] = temp_path(paths["histogram"])
        over = [n for n, _ in uncut]
        pieces = counted.pieces_mask() if counted is not None and counted.split else None
        whole = lengths if pieces is None else lengths[~pieces]
        split = counted.split_tokens if pieces is not None else ()
        plot_lengths(temps["histogram"], whole[whole <= cfg.max_seq_len], row_fill, cfg.max_seq_len,
                     truncated=over if cfg.oversize == "own-row" else (),
                     dropped=over if cfg.oversize == "drop" else (), estimated=sum(not e for _, e in uncut),
                     split=split, piece_tokens=int(lengths[pieces].sum()) if pieces is not None else 0)
    for key in ("sidecar", "report"):
        with open(temps[key], "rb+") as f:
            os.fsync(f.fileno())
    stage("report_written")
    publish(paths, temps)


def _input_identity(cfg: PackConfig) -> dict[str, Any]:
    """``{"input_identity": {input: source_identity}}`` for the row-source inputs (none for JSONL only)."""
    found = {p: source_identity(p, cfg.split) for p in cfg.inputs if is_row_source(p)}
    return {"input_identity": found} if found else {}


def _engine(cfg: PackConfig) -> Engine:
    """The engine ``cfg.engine`` names."""
    if cfg.engine == "ray":
        from packsft.packing.ray_engine import RayEngine

        return RayEngine(cfg)
    return LocalEngine(cfg)
