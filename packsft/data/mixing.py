"""Training mixtures: several packed files end to end, and a sampler that draws their rows by weight.

:class:`MixedDataset` concatenates named sources (one ``PackedSFTDataset`` per ``.jsonl.packed`` file, all packed
for the same tokenizer, prompt format, ``max_seq_len`` and CP size): index ``i`` maps to ``(source, row)`` like
``torch.utils.data.ConcatDataset``. :class:`WeightedMixingSampler` plans every epoch afresh: ``samples_per_epoch``
rows (default: all rows of all sources), of which source ``s`` gets ``round(w_s * samples_per_epoch)`` (largest
remainder, so the counts add up), drawn as whole shuffled passes over the source and then part of one more, all
shuffled together. With ``trained_tokens_per_row`` (``data.mixture_unit: trained_tokens``) the weights are shares of
trained tokens instead: source ``s`` gets rows in proportion to ``w_s / t_s``, ``t_s`` its mean trained tokens per row
(:func:`mean_trained_tokens`, from the packer's token cache). The plan is a pure function of ``(seed, epoch)`` and the
state is ``(epoch, position)``, so a resumed run continues exactly (``packsft.data.samplers``). Configuration and
examples: ``docs/data_loading.md``.
"""

from __future__ import annotations

import bisect
import hashlib
from collections.abc import Sequence
from typing import Any

import numpy as np

from packsft.data.samplers import EpochSampler, epoch_rng

WEIGHT_DIGITS = 12
"""Normalised weights are rounded to this many decimals, so ``[7, 3]`` and ``[0.7, 0.3]`` are the same plan."""


def normalize_weights(weights: Sequence[float], names: Sequence[str] | None = None,
                      files: Sequence[str] | None = None) -> list[float]:
    """Weights scaled to sum 1 and rounded to :data:`WEIGHT_DIGITS` decimals.

    Raises:
        ValueError: a weight that is not a positive finite number, or whose share rounds to 0 (naming its source
            when ``names`` is given, and its file with ``files``).
    """
    w = np.asarray(weights, dtype=np.float64)

    def where(bad: list[int]) -> str:
        return ", ".join((repr(names[i]) if names else str(i)) + (f" ({files[i]})" if files else "") for i in bad)

    bad = [i for i, x in enumerate(w) if not (np.isfinite(x) and x > 0)]
    if len(w) == 0 or bad:
        raise ValueError(f"weights must be positive finite numbers; got {list(weights)}"
                         + (f" (source {where(bad)})" if bad else ""))
    with np.errstate(over="ignore"):
        total = w.sum()
    if not np.isfinite(total):   # only the ratios count: [1e308, 1e308] is 1:1 (other weights keep their arithmetic)
        w = w / w.max()
        total = w.sum()
    shares = [round(float(x), WEIGHT_DIGITS) for x in w / total]
    if zero := [i for i, x in enumerate(shares) if x == 0]:
        raise ValueError(f"weights {list(weights)}: source {where(zero)} has a share under 1e-{WEIGHT_DIGITS} of "
                         "the total, 0 after normalising; raise its weight or drop it")
    return shares


class MixedDataset:
    """Map-style concatenation of named ``sources``; row ``i`` is ``sources[s][i - offsets[s]]``.

    Args:
        sources: ``{name: dataset}`` in order, at least two (each with ``__len__``/``__getitem__`` and optionally
            ``fingerprint``, ``path``, ``sidecar``), all opened for the same ``max_seq_len``, CP size and
            tokenizer: ``packsft.train.data.build_datasets`` opens each with the one data config and checks it
            against the file's sidecar, so rows of every source batch together.

    Attributes:
        names, datasets, source_sizes (rows per source), offsets (first global index of each source).
        source_fingerprints: ``{name: "<fingerprint>:<rows>"}``, checked by name on resume.
        fingerprint: sha256 over the names and source fingerprints.

    Raises:
        ValueError: an empty source (named with its file): the weighted sampler could draw no row of it.
    """

    def __init__(self, sources: dict[str, Any]) -> None:
        self.names, self.datasets = list(sources), list(sources.values())
        self.source_sizes = [len(d) for d in self.datasets]
        for name, d, size in zip(self.names, self.datasets, self.source_sizes):
            if size == 0:
                raise ValueError(f"training source {name!r} ({getattr(d, 'path', '?')}) has no rows")
        self.offsets = np.concatenate([[0], np.cumsum(self.source_sizes)[:-1]]).astype(int).tolist()
        self.source_fingerprints = {name: f"{getattr(d, 'fingerprint', None)}:{len(d)}"
                                    for name, d in zip(self.names, self.datasets)}
        text = "|".join(f"{n}={fp}" for n, fp in self.source_fingerprints.items())
        self.fingerprint = hashlib.sha256(text.encode()).hexdigest()
        self.sidecar = getattr(self.datasets[0], "sidecar", None)
        self.tokenizer = getattr(self.datasets[0], "tokenizer", None)

    def __len__(self) -> int:
        """Rows of all sources."""
        return sum(self.source_sizes)

    def locate(self, index: int) -> tuple[int, int]:
        """``(source, row)`` of global ``index`` in ``[0, len)`` (the loader's batch sampler checks every index)."""
        source = bisect.bisect_right(self.offsets, index) - 1
        return source, index - self.offsets[source]

    def __getitem__(self, index: int) -> dict[str, Any]:
        """Row ``index`` of the concatenation: the source dataset's row dict with ``source`` (int, the index of its
        source in ``names``) added."""
        source, row = self.locate(int(index))
        return {**self.datasets[source][row], "source": source}


def mean_trained_tokens(dataset: Any, name: str = "") -> float:
    """Mean trained tokens per row of a training source (a ``PackedSFTDataset``, or a ``RowSubset`` of one), from the
    per-row targets of its token cache (:meth:`packsft.token_cache.TokenCache.trained_tokens_per_row`).

    Raises:
        ValueError: the source reads no token cache (its rows would all have to be re-tokenized), naming it and
            why; or it has no trained token.
    """
    indices = getattr(dataset, "indices", None)
    base = getattr(dataset, "base", dataset)
    cache = getattr(base, "token_cache", None)
    if cache is None:
        raise ValueError(f"data.mixture_unit=trained_tokens: training source {name!r} ({getattr(base, 'path', '?')}) "
                         f"has no token cache to count its trained tokens from "
                         f"({getattr(base, 'token_cache_status', 'not a packed file')}); re-pack it with packsft's "
                         "packer (it writes the cache by default) or use data.mixture_unit=rows")
    per_row = cache.trained_tokens_per_row(base.prompt_format.pad_token_id)
    if indices is not None:
        per_row = per_row[np.asarray(indices, dtype=np.int64)]
    mean = float(per_row.mean()) if len(per_row) else 0.0
    if mean <= 0:
        raise ValueError(f"data.mixture_unit=trained_tokens: training source {name!r} ({base.path}) has no trained "
                         "token: no share of trained tokens can come from it")
    return mean


def rows_per_source(weights: Sequence[float], samples_per_epoch: int, names: Sequence[str] | None = None,
                    files: Sequence[str] | None = None) -> list[int]:
    """Split ``samples_per_epoch`` by normalised ``weights`` with the largest-remainder method.

    Example: weights ``[2, 1]`` and 10 samples give ``[7, 3]``.

    Raises:
        ValueError: a weight that is not positive, or a source whose count rounds to zero (named, with its file).
    """
    w = np.asarray(normalize_weights(weights, names, files), dtype=np.float64)
    exact = w / w.sum() * samples_per_epoch
    counts = np.floor(exact).astype(np.int64)
    by_remainder = np.argsort(-(exact - counts), kind="stable")
    counts[by_remainder[: samples_per_epoch - counts.sum()]] += 1
    zero = [i for i, c in enumerate(counts) if c == 0]
    if zero:
        which = ", ".join(f"{names[i]!r}" + (f" ({files[i]})" if files else "") if names else str(i) for i in zero)
        raise ValueError(f"training source {which} (weight {[float(w[i]) for i in zero]} after normalising) gets 0 "
                         f"of {samples_per_epoch} rows per epoch; raise its weight or samples_per_epoch, or drop it")
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
        weights: one positive weight per source; normalised (:func:`normalize_weights`).
        samples_per_epoch: length of an epoch in rows (``data.samples_per_epoch``, > 0); default ``len(data_source)``.
            An epoch may be shorter than a global batch (global batches span epochs).
        trained_tokens_per_row: ``None`` (default): the weights are shares of rows. Else each source's mean trained
            tokens per row (one per weight, > 0, :func:`mean_trained_tokens`): the weights are shares of trained
            tokens, and source ``s`` gets rows in proportion to ``weights[s] / trained_tokens_per_row[s]``.

    The trainer builds it for a mixture with one weight per source (``Trainer._train_loader_config``).

    Raises:
        ValueError: see :func:`rows_per_source`.
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
        trained_tokens_per_row: Sequence[float] | None = None,
    ) -> None:
        super().__init__(data_source, dp_rank, dp_size, seed)
        self.source_sizes, self.offsets = list(data_source.source_sizes), list(data_source.offsets)
        self.samples_per_epoch = self.num_rows if samples_per_epoch is None else samples_per_epoch
        names = getattr(data_source, "names", None)
        files = [str(getattr(d, "path", "?")) for d in getattr(data_source, "datasets", [])] or None
        if trained_tokens_per_row is not None:
            weights = [w / t for w, t in zip(normalize_weights(weights, names, files),
                                             normalize_weights(trained_tokens_per_row, names, files))]
        self.counts = rows_per_source(weights, self.samples_per_epoch, names, files)

    def global_order(self, epoch: int) -> np.ndarray:
        """The epoch's plan: each source's drawn rows (as global indices), shuffled together."""
        rng = epoch_rng(self.seed, epoch)
        plan = [off + draw_rows(rng, size, n) for off, size, n in zip(self.offsets, self.source_sizes, self.counts)]
        return rng.permutation(np.concatenate(plan))
