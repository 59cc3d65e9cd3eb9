"""The packing report (:class:`PackReport`, printed and written as JSON) and its picture: conversation lengths
(before the packer's cut and drop) and row padding, as a PNG (matplotlib, no display)."""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from packsft.io import atomic_open
from packsft.packing.config import PackWarning
from packsft.packing.sources import entry_where, position, where
from packsft.sidecar import efficiency


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
    split_conversations: int = 0
    pieces: int = 0
    rejected: list[dict[str, Any]] = field(default_factory=list)
    rejected_turns: list[dict[str, Any]] = field(default_factory=list)
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
            f"({sum(o['action'] == 'dropped' for o in self.oversize)} dropped"
            + (f", {self.split_conversations} split into {self.pieces} pieces)" if self.split_conversations
               else ")"),
            *([f"rejected turns      : {len(self.rejected_turns)} (longer than a row with the system message)"]
              if self.rejected_turns else []),
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
        for r in self.rejected_turns[:5]:
            lines.append(f"  rejected turn {entry_where(r)}: {r['reason']}")
        if len(self.rejected_turns) > 5:
            lines.append(f"  ... {len(self.rejected_turns) - 5} more rejected turns in the report")
        lines += [f"{k:<20}: {v}" for k, v in self.outputs.items()]
        return "\n".join(lines)


def plot_lengths(path: str | Path, fitting: Sequence[int], row_fill: Sequence[int], max_seq_len: int, *,
                 truncated: Sequence[int] = (), dropped: Sequence[int] = (), estimated: int = 0,
                 split: Sequence[int] = (), piece_tokens: int = 0) -> None:
    """Write a two-panel PNG: conversation lengths as tokenized, and padding per row.

    Left: stacked histogram of tokens per conversation before the packer's cut and drop: packed whole,
    truncated to ``max_seq_len`` in a row of its own, dropped (``--oversize drop``), split into pieces
    (``--oversize split``). The axis ends at
    ``2 * max_seq_len`` (longer ones are counted in the last bin; the longest is in the title);
    ``max_seq_len``, where the rows cut, is drawn as a line. Right: padding tokens per row
    (``max_seq_len - fill``) on a log count axis, with the overall efficiency in the title.

    Args:
        path: PNG file to write (atomically).
        fitting: tokens of each conversation packed whole (at most ``max_seq_len``; ints, sequence or array).
        row_fill: tokens used per row (sum of CP-padded conversation costs, at most ``max_seq_len``).
        max_seq_len: row capacity in tokens.
        truncated: tokens of each own-row conversation before the cut (its row keeps ``max_seq_len``).
        dropped: tokens of each dropped conversation.
        estimated: how many of ``truncated`` are estimates (too long to tokenize whole).
        split: tokens of each conversation split into pieces (whole).
        piece_tokens: the tokens of all those pieces (in the rows).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    groups = [np.asarray(g, dtype=np.int64) for g in (fitting, truncated, dropped, split)]
    row_fill = np.asarray(row_fill, dtype=np.int64)
    cap = 2 * max_seq_len
    total = sum(len(g) for g in groups)
    longest = max((int(g.max()) for g in groups if len(g)), default=0)
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 3.8))
    labels = ["packed whole", f"own row, truncated to {max_seq_len}"
              + (f" ({estimated} estimated)" if estimated else ""), "dropped", "split into pieces"]
    shown = [(np.minimum(g, cap), label, color) for g, label, color in
             zip(groups, labels, ("#4c72b0", "#dd8452", "#8c8c8c", "#8172b3")) if len(g)] \
        or [(np.zeros(1), labels[0], "#4c72b0")]
    a.hist([g for g, _, _ in shown], bins=64, range=(0, cap), stacked=True, label=[lb for _, lb, _ in shown],
           color=[c for _, _, c in shown])
    a.axvline(max_seq_len, color="#c44e52", linestyle="--", label=f"max_seq_len = {max_seq_len} (cut)")
    a.set(title=f"{total} conversations, {total - len(groups[0])} longer than a row (longest {longest})",
          xlabel=f"tokens per conversation as tokenized (last bin: >= {cap})", ylabel="conversations")
    a.legend(fontsize="small")
    padding = max_seq_len - np.minimum(row_fill, max_seq_len) if len(row_fill) else [0]
    real = int(groups[0].sum()) + len(groups[1]) * max_seq_len + piece_tokens
    efficiency = 100.0 * real / (len(row_fill) * max_seq_len) if len(row_fill) else 0.0
    b.hist(padding, bins=50, color="#55a868", log=True)
    b.set(title=f"{len(row_fill)} rows, efficiency {efficiency:.2f} %", xlabel="padding tokens per row",
          ylabel="rows (log)")
    fig.tight_layout()
    with atomic_open(path, "wb") as f:
        fig.savefig(f, format="png", dpi=100)
    plt.close(fig)
