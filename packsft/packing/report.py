"""The packing report's picture: conversation lengths and row padding, as a PNG (matplotlib, no display)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from packsft.io import atomic_open


def plot_lengths(path: str | Path, lengths: Sequence[int], row_fill: Sequence[int], max_seq_len: int) -> None:
    """Write a two-panel PNG: conversation lengths, and padding per row.

    Left: histogram of tokens per conversation, clipped at ``2 * max_seq_len`` (longer ones are counted in
    the last bin and in the title), with ``max_seq_len`` drawn as a line. Right: padding tokens per row
    (``max_seq_len - fill``) on a log count axis, with the overall efficiency in the title.

    Args:
        path: PNG file to write (atomically).
        lengths: tokens per packed conversation (a sequence or numpy array of ints).
        row_fill: tokens used per row (sum of CP-padded conversation costs, at most ``max_seq_len``).
        max_seq_len: row capacity in tokens.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    lengths = np.asarray(lengths, dtype=np.int64)
    row_fill = np.asarray(row_fill, dtype=np.int64)
    cap = 2 * max_seq_len
    oversize = int((lengths > max_seq_len).sum())
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 3.8))
    a.hist(np.minimum(lengths, cap) if len(lengths) else [0], bins=64, range=(0, cap), color="#4c72b0")
    a.axvline(max_seq_len, color="#c44e52", linestyle="--", label=f"max_seq_len = {max_seq_len}")
    a.set(title=f"{len(lengths)} conversations, {oversize} longer than a row", xlabel="tokens per conversation "
          f"(last bin: >= {cap})", ylabel="conversations")
    a.legend()
    padding = max_seq_len - np.minimum(row_fill, max_seq_len) if len(row_fill) else [0]
    real = int(np.minimum(lengths, max_seq_len).sum())
    efficiency = 100.0 * real / (len(row_fill) * max_seq_len) if len(row_fill) else 0.0
    b.hist(padding, bins=50, color="#55a868", log=True)
    b.set(title=f"{len(row_fill)} rows, efficiency {efficiency:.2f} %", xlabel="padding tokens per row",
          ylabel="rows (log)")
    fig.tight_layout()
    with atomic_open(path, "wb") as f:
        fig.savefig(f, format="png", dpi=100)
    plt.close(fig)
