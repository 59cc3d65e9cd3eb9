"""The packing report's picture: conversation lengths (before the packer's cut and drop) and row padding, as a PNG
(matplotlib, no display)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from packsft.io import atomic_open


def plot_lengths(path: str | Path, fitting: Sequence[int], row_fill: Sequence[int], max_seq_len: int, *,
                 truncated: Sequence[int] = (), dropped: Sequence[int] = (), estimated: int = 0) -> None:
    """Write a two-panel PNG: conversation lengths as tokenized, and padding per row.

    Left: stacked histogram of tokens per conversation before the packer's cut and drop: packed whole,
    truncated to ``max_seq_len`` in a row of its own, dropped (``--oversize drop``). The axis ends at
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
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    groups = [np.asarray(g, dtype=np.int64) for g in (fitting, truncated, dropped)]
    row_fill = np.asarray(row_fill, dtype=np.int64)
    cap = 2 * max_seq_len
    total = sum(len(g) for g in groups)
    longest = max((int(g.max()) for g in groups if len(g)), default=0)
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 3.8))
    labels = ["packed whole", f"own row, truncated to {max_seq_len}"
              + (f" ({estimated} estimated)" if estimated else ""), "dropped"]
    shown = [(np.minimum(g, cap), label, color) for g, label, color in
             zip(groups, labels, ("#4c72b0", "#dd8452", "#8c8c8c")) if len(g)] or [(np.zeros(1), labels[0], "#4c72b0")]
    a.hist([g for g, _, _ in shown], bins=64, range=(0, cap), stacked=True, label=[lb for _, lb, _ in shown],
           color=[c for _, _, c in shown])
    a.axvline(max_seq_len, color="#c44e52", linestyle="--", label=f"max_seq_len = {max_seq_len} (cut)")
    a.set(title=f"{total} conversations, {len(groups[1]) + len(groups[2])} longer than a row (longest {longest})",
          xlabel=f"tokens per conversation as tokenized (last bin: >= {cap})", ylabel="conversations")
    a.legend(fontsize="small")
    padding = max_seq_len - np.minimum(row_fill, max_seq_len) if len(row_fill) else [0]
    real = int(groups[0].sum()) + len(groups[1]) * max_seq_len
    efficiency = 100.0 * real / (len(row_fill) * max_seq_len) if len(row_fill) else 0.0
    b.hist(padding, bins=50, color="#55a868", log=True)
    b.set(title=f"{len(row_fill)} rows, efficiency {efficiency:.2f} %", xlabel="padding tokens per row",
          ylabel="rows (log)")
    fig.tight_layout()
    with atomic_open(path, "wb") as f:
        fig.savefig(f, format="png", dpi=100)
    plt.close(fig)
