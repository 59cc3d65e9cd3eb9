"""Merging the shard results in the main process: counts, rejections and warnings into the report (exact line
numbers), the accepted conversations into numpy arrays (:class:`Counted`), and the oversize policy applied."""

from __future__ import annotations

import re
from collections.abc import Iterable

from packsft.layout import conversation_cost
from packsft.packing.config import PackConfig, PackError
from packsft.packing.report import PackReport
from packsft.packing.shards import ShardResult
from packsft.packing.sources import count_word, entry_where, input_bytes, position, where


class Counted:
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
        split: ``(index, pieces)`` of each conversation ``--oversize split`` cut (its pieces are conversations
            ``index .. index + pieces - 1``), in input order.
        split_tokens: the tokens of each of those conversations, whole (for the histogram).
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
        self.trained = sum(r.trained_fitting for r in results)  # set by count_all with the oversize ones kept
        self.uncut: list[tuple[int, bool]] = []  # set by count_all
        self.split: list[tuple[int, int]] = []  # set by count_all
        self.split_tokens: list[int] = []

    def pieces_mask(self):
        """Boolean ``[n]``: the conversations that are pieces of a split one."""
        import numpy as np

        mask = np.zeros(len(self.num_tokens), bool)
        for index, pieces in self.split:
            mask[index : index + pieces] = True
        return mask

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


def _shard_progress(bar, result: ShardResult, conversations: int) -> None:
    """Advance the progress bar by a merged shard (its byte range, or a row source's records' JSON bytes) and show
    the ``conversations`` read so far."""
    shard = result.shard
    bar.set_postfix_str(f"{conversations} conversations", refresh=False)  # drawn by the update
    bar.update(shard.end - shard.start if shard.end > shard.start else result.nbytes)


def count_all(cfg: PackConfig, results: Iterable[ShardResult], report: PackReport) -> Counted:
    """Merge every shard's result (in shard order, as an engine's ``count`` yields them); fill the report's counts,
    rejections and warnings (exact line numbers)."""
    import numpy as np

    total = input_bytes(cfg.inputs)
    if cfg.progress:
        from tqdm import tqdm

        bar = tqdm(desc="reading", total=total, unit="B", unit_scale=True, mininterval=1.0)
    else:  # a disabled tqdm still starts its monitor thread and a multiprocessing lock (about 10 ms)
        bar = _NoBar()
    merged: list[ShardResult] = []
    lines_before = {}  # file_idx -> lines of that file in the shards before
    oversize: list[tuple] = []  # (global index, file_idx, absolute line, tokens, cut, uncut, exact, nbytes,
    #                              trained, in row)
    split: list[tuple] = []  # (global index, pieces, file_idx, absolute line, tokens)
    turns: list[tuple] = []  # (file_idx, absolute line, tokens, reason) of the rejected turns
    base = 0
    try:  # closed on an error too, so that the bar is not redrawn after the error line
        for r in results:
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
            split += [(base + i, k, r.shard.file_idx, before + line, n) for i, k, line, n, _ in r.split]
            turns += [(r.shard.file_idx, before + line, n, reason) for line, n, reason in r.rejected_turns]
            base += len(r.num_tokens)
            r.rejected, r.warnings, r.oversize, r.split, r.rejected_turns = [], [], [], [], []
            merged.append(r)
    finally:
        bar.close()
    counted = Counted(merged)
    del merged
    _report_split(cfg, counted, split, turns, report)
    _apply_oversize(cfg, counted, oversize, report, np)
    counted.uncut = [(uncut, exact) for *_, uncut, exact, _, _, _ in oversize]
    counted.trained += 0 if cfg.oversize == "drop" else sum(1 for o in oversize if o[-1])
    return counted


def _report_split(cfg: PackConfig, counted: Counted, split: list[tuple], turns: list[tuple],
                  report: PackReport) -> None:
    """Report the conversations ``--oversize split`` cut (``action: split`` with their ``pieces``; ``dropped``
    when none is left: nothing trained, or every trained turn rejected) and the turns it rejected."""
    for index, pieces, file_idx, line, n in split:
        path = cfg.inputs[file_idx]
        report.oversize.append({"input": path, **position(path, line), "tokens": n,
                                "action": "split" if pieces else "dropped", "pieces": pieces})
        counted.split.append((index, pieces))
        counted.split_tokens.append(n)
    report.split_conversations = sum(1 for _, pieces, *_ in split if pieces)
    report.pieces = sum(pieces for _, pieces, *_ in split)
    for file_idx, line, n, reason in turns:
        path = cfg.inputs[file_idx]
        report.rejected_turns.append({"input": path, **position(path, line), "tokens": n, "reason": reason})


def _apply_oversize(cfg: PackConfig, counted: Counted, oversize: list[tuple], report: PackReport, np) -> None:
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


def nothing_trained(cfg: PackConfig, report: PackReport, conversations: int) -> str:
    """The error of a run whose rows would hold no trained token: the counts and the first warnings."""
    kinds = ("no_trained_token", "truncation_removes_training")
    counts = report.warning_counts()
    lines = [f"nothing to train: none of the {conversations} conversations to pack keeps a trained token in its "
             f"row (warnings: {counts.get(kinds[0], 0)} {kinds[0]}, {counts.get(kinds[1], 0)} {kinds[1]} at "
             f"max_seq_len {cfg.max_seq_len}); check --train-on, 'weight: 0', --prompt-format, or use a larger "
             "--max-seq-length"]
    lines += [f"  {w['kind']} {entry_where(w)}: {w['message']}" for w in report.warnings if w["kind"] in kinds][:5]
    return "\n".join(lines)


def nothing_to_pack(cfg: PackConfig, report: PackReport, kinds: int = 8) -> str:
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

