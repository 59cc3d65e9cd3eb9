"""Weighted mixing of several packed files: a concatenated dataset and a sampler that mixes by weight.

:class:`MixedDataset` puts several map-style datasets (e.g. one ``PackedSFTDataset`` per
``.jsonl.packed`` file, all with the same ``max_seq_len``) end to end: index ``i`` maps to
``(source, row)`` by offsets, like ``torch.utils.data.ConcatDataset``, and its ``fingerprint``
combines the sources' fingerprints and lengths, so a resume over changed files is refused.

:class:`WeightedMixingSampler` plans each epoch afresh: ``samples_per_epoch`` samples (default: all
rows of all sources), of which source ``s`` gets ``round(w_s * samples_per_epoch)`` with normalised
weights (largest remainder, so the counts add up exactly). A source smaller than its count is
repeated (whole shuffled passes, then part of one more); a larger one is subsampled without
replacement. The plan is shuffled together, so the sources interleave. A source whose count
rounds to zero is an error at start-up.

Library use (``tools/train.py`` reads one ``data.train_path`` and cannot build a ``MixedDataset`` yet, so this
sampler works with your own loop over ``build_train_dataloader(MixedDataset.from_files(paths, ...), cfg)``)::

    sampler: custom
    sampler_class_path: examples.samplers.mixing.WeightedMixingSampler
    sampler_kwargs: {weights: [0.7, 0.3], samples_per_epoch: 20000}

Resumable: an epoch's plan is a pure function of ``(seed, epoch)``; the state is ``(epoch, position)``.
"""

from __future__ import annotations

import bisect
import hashlib
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from packsft.data.samplers import EpochSampler, epoch_rng


class MixedDataset:
    """Map-style concatenation of ``datasets``; row ``i`` is ``datasets[s][i - offsets[s]]``.

    Attributes:
        source_sizes: rows per source. offsets: first global index of each source.
        fingerprint: sha256 over the sources' ``(fingerprint, len)``.

    Raises:
        ValueError: if there is no source or a source is empty.
    """

    def __init__(self, datasets: Sequence[Any]) -> None:
        if not datasets:
            raise ValueError("MixedDataset needs at least one source dataset")
        self.datasets = list(datasets)
        self.source_sizes = [len(d) for d in self.datasets]
        if 0 in self.source_sizes:
            raise ValueError(f"source {self.source_sizes.index(0)} is empty")
        self.offsets = np.concatenate([[0], np.cumsum(self.source_sizes)[:-1]]).tolist()
        parts = [f"{getattr(d, 'fingerprint', None)}:{len(d)}" for d in self.datasets]
        self.fingerprint = hashlib.sha256("|".join(parts).encode()).hexdigest()

    @classmethod
    def from_files(cls, paths: Sequence[str], dataset_factory: Callable | None = None, **kwargs: Any) -> MixedDataset:
        """Open one dataset per path with ``dataset_factory(path, **kwargs)`` (default ``PackedSFTDataset``)."""
        if dataset_factory is None:
            from packsft.data.dataset import PackedSFTDataset as dataset_factory
        return cls([dataset_factory(path, **kwargs) for path in paths])

    def __len__(self) -> int:
        """Return the total number of rows of all sources."""
        return sum(self.source_sizes)

    def locate(self, index: int) -> tuple[int, int]:
        """Return ``(source, row)`` of global ``index``; raises IndexError outside ``[0, len)``."""
        if not 0 <= index < len(self):
            raise IndexError(f"index {index} out of range for {len(self)} rows")
        source = bisect.bisect_right(self.offsets, index) - 1
        return source, index - self.offsets[source]

    def __getitem__(self, index: int) -> Any:
        """Return row ``index`` of the concatenation (whatever the source dataset returns)."""
        source, row = self.locate(int(index))
        return self.datasets[source][row]


def rows_per_source(weights: Sequence[float], samples_per_epoch: int) -> list[int]:
    """Split ``samples_per_epoch`` by normalised ``weights`` with the largest-remainder method.

    Example: weights ``[2, 1]`` and 10 samples give ``[7, 3]``.

    Raises:
        ValueError: if a weight is not positive or a source's count rounds to zero.
    """
    w = np.asarray(weights, dtype=np.float64)
    if len(w) == 0 or not np.isfinite(w).all() or (w <= 0).any():
        raise ValueError(f"weights must be positive finite numbers, got {list(weights)}")
    exact = w / w.sum() * samples_per_epoch
    counts = np.floor(exact).astype(np.int64)
    by_remainder = np.argsort(-(exact - counts), kind="stable")
    counts[by_remainder[: samples_per_epoch - counts.sum()]] += 1
    zero = [i for i, c in enumerate(counts) if c == 0]
    if zero:
        raise ValueError(
            f"sources {zero} (weights {[float(w[i]) for i in zero]}) get 0 of {samples_per_epoch} samples per "
            "epoch; raise their weight or samples_per_epoch, or drop them"
        )
    return counts.tolist()


def draw_rows(rng: np.random.Generator, size: int, count: int) -> np.ndarray:
    """Draw ``count`` row indices of a source of ``size`` rows: whole shuffled passes, then a partial one."""
    passes = [rng.permutation(size) for _ in range(count // size)]
    return np.concatenate([*passes, rng.permutation(size)[: count % size]]).astype(np.int64)


class WeightedMixingSampler(EpochSampler):
    """Mix the sources of a :class:`MixedDataset` by weight, with a fresh plan every epoch.

    Args:
        data_source: a :class:`MixedDataset` (anything with ``source_sizes`` and ``offsets``).
        dp_rank, dp_size, seed: as for every sampler (``packsft.data.samplers``).
        weights: one positive weight per source, normalised to sum 1.
        samples_per_epoch: length of an epoch in samples; default ``len(data_source)``.

    Raises:
        TypeError: if ``data_source`` has no sources. ValueError: see :func:`rows_per_source`.
    """

    def __init__(
        self,
        data_source: Any,
        dp_rank: int = 0,
        dp_size: int = 1,
        seed: int = 0,
        *,
        weights: Sequence[float],
        samples_per_epoch: int | None = None,
    ) -> None:
        super().__init__(data_source, dp_rank, dp_size, seed)
        if not hasattr(data_source, "source_sizes"):
            raise TypeError(f"WeightedMixingSampler needs a MixedDataset, got {type(data_source).__name__}")
        self.source_sizes, self.offsets = list(data_source.source_sizes), list(data_source.offsets)
        if len(weights) != len(self.source_sizes):
            raise ValueError(f"got {len(weights)} weights for {len(self.source_sizes)} sources")
        self.samples_per_epoch = samples_per_epoch or self.num_rows
        if self.samples_per_epoch < dp_size:
            raise ValueError(f"samples_per_epoch={self.samples_per_epoch} is below dp_size={dp_size}")
        self.counts = rows_per_source(weights, self.samples_per_epoch)

    def global_order(self, epoch: int) -> np.ndarray:
        """Return the epoch's plan: each source's drawn rows (as global indices), shuffled together."""
        rng = epoch_rng(self.seed, epoch)
        plan = [off + draw_rows(rng, size, n) for off, size, n in zip(self.offsets, self.source_sizes, self.counts)]
        return rng.permutation(np.concatenate(plan))
