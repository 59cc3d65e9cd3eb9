"""The packing report's picture: conversation lengths and row fill, as a PNG (matplotlib, no display)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from packsft.io import atomic_open


def plot_lengths(path: str | Path, lengths: Sequence[int], row_fill: Sequence[int], max_seq_len: int) -> None:
    """Write a two-panel PNG: histogram of conversation lengths and of row fill, both in tokens.

    Args:
        path: PNG file to write (atomically).
        lengths: tokens per packed conversation.
        row_fill: tokens used per row (sum of CP-padded conversation costs).
        max_seq_len: row capacity in tokens, drawn as a vertical line.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.6))
    a.hist(lengths or [0], bins=60, color="#4c72b0")
    a.axvline(max_seq_len, color="#c44e52", linestyle="--", label=f"max_seq_len = {max_seq_len}")
    a.set(title=f"{len(lengths)} conversations", xlabel="tokens per conversation", ylabel="count")
    a.legend()
    fill = [100.0 * f / max_seq_len for f in row_fill] or [0.0]
    b.hist(fill, bins=50, color="#55a868")
    b.set(title=f"{len(row_fill)} rows", xlabel="row fill (% of max_seq_len)", ylabel="rows")
    fig.tight_layout()
    with atomic_open(path, "wb") as f:
        fig.savefig(f, format="png", dpi=100)
    plt.close(fig)
