"""Resumable, data-parallel samplers for step-based training.

Training runs on ``global_step``, not epochs, so every training sampler here is *infinite* and
*epoch-aware*: epochs roll over inside ``__iter__`` and the step loop never sees ``StopIteration``
or an empty epoch, also when a checkpoint was taken right after the last sample of an epoch.

Data-parallel split (Megatron's ``MegatronPretrainingRandomSampler`` does the same): every rank
computes the same *global* order of an epoch from ``(seed, epoch)``, truncates it to a multiple of
``dp_size`` and keeps ``order[dp_rank::dp_size]``. Ranks therefore see disjoint rows and the same
number of samples per epoch. The ``len(order) % dp_size`` samples cut at the end of an epoch are
not seen in that epoch: with ``random`` they are different rows every epoch; with ``sequential``
the last ``num_rows % dp_size`` rows are never seen.

State is ``{"epoch": e, "position": p}``: ``p`` samples of epoch ``e`` of *this rank's* share have
been yielded. It is a pure function of what was yielded, independent of ``num_workers``, so it
can be restored into a loader with a different worker count (see ``packsft.data.loader``).

Sampler contract (built-in and ``sampler: custom`` classes alike)::

    cls(data_source, dp_rank=..., dp_size=..., seed=..., **sampler_kwargs)

``data_source`` is the map-style dataset (built-ins also accept a row count). The class must
define ``__iter__`` (yield row indices forever), ``state_dict()`` (cheap, no side effects, returns a
new dict of plain Python values: torchdata calls it once per batch sent to a worker) and
``load_state_dict(state)``. The easy way is to subclass :class:`EpochSampler` and override
:meth:`EpochSampler.global_order`.
"""

from __future__ import annotations

import operator
from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np


def num_rows_of(data_source: Any) -> int:
    """Return the number of rows of a map-style dataset (``len``), or ``data_source`` itself if it is an int."""
    if isinstance(data_source, (int, np.integer)) and not isinstance(data_source, bool):
        return int(data_source)
    return len(data_source)


def epoch_rng(seed: int, epoch: int, salt: int = 0) -> np.random.Generator:
    """Return the numpy generator of one epoch, seeded from ``(seed, epoch, salt)``.

    A ``SeedSequence`` over the tuple keeps the streams of ``(seed, epoch + 1)`` and ``(seed + 1, epoch)``
    distinct, unlike ``seed + epoch``. Orders are reproducible for a given numpy release (NEP 19).
    """
    return np.random.default_rng(np.random.SeedSequence([int(seed), int(epoch), int(salt)]))


def _named(data_source: Any) -> str:
    """`` <path>`` of a dataset that has one (a packed file, a subset of one), for error messages; else ``""``."""
    path = getattr(data_source, "path", None)
    return f" {path}" if path else ""


class EpochSampler(ABC):
    """Infinite, epoch-aware, data-parallel sampler of row indices; subclass and define ``global_order``.

    Args:
        data_source: the map-style dataset or its number of rows.
        dp_rank: this rank's index in the data-parallel group, ``0 <= dp_rank < dp_size`` (the process group's).
        dp_size: number of data-parallel ranks.
        seed: seed of the per-epoch orders; the same on every rank.

    Raises:
        ValueError: fewer rows than ``dp_size``.
        TypeError: (Python's) a subclass that does not define ``global_order``.
    """

    def __init__(self, data_source: Any, dp_rank: int = 0, dp_size: int = 1, seed: int = 0) -> None:
        self.num_rows = num_rows_of(data_source)
        if self.num_rows < dp_size:
            raise ValueError(f"the dataset{_named(data_source)} has {self.num_rows} rows, fewer than "
                             f"dp_size={dp_size}: some rank would get none")
        self.dp_rank, self.dp_size, self.seed = dp_rank, dp_size, int(seed)
        self.epoch, self.position = 0, 0
        self._cached: tuple[int, list[int]] | None = None

    @abstractmethod
    def global_order(self, epoch: int) -> Sequence[int]:
        """Return the order of row indices of ``epoch``, identical on every rank. Subclasses define it."""

    def rank_order(self, epoch: int) -> list[int]:
        """Return this rank's share of ``global_order(epoch)``: truncated to a multiple of dp_size, strided.

        Raises:
            RuntimeError: if the share is empty (the global order is shorter than dp_size).
        """
        if self._cached is None or self._cached[0] != epoch:
            order = np.asarray(self.global_order(epoch), dtype=np.int64)
            usable = len(order) - len(order) % self.dp_size
            share = order[self.dp_rank : usable : self.dp_size].tolist()
            if not share:
                raise RuntimeError(
                    f"{type(self).__name__}: epoch {epoch} has {len(order)} samples, fewer than "
                    f"dp_size={self.dp_size}; an epoch must give every rank at least one sample"
                )
            self._cached = (epoch, share)
        return self._cached[1]

    def __iter__(self) -> Iterator[int]:
        """Yield row indices forever, continuing from ``(epoch, position)`` and rolling epochs over."""
        while True:
            order = self.rank_order(self.epoch)
            while self.position < len(order):
                self.position += 1
                yield order[self.position - 1]
            self.epoch, self.position = self.epoch + 1, 0

    def state_dict(self) -> dict[str, int]:
        """Return ``{"epoch", "position"}``: samples of this rank's share of ``epoch`` already yielded."""
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a state of :meth:`state_dict` (checked by the loader's header: same sampler, seed, dataset);
        the next yielded index is the one that followed."""
        self.epoch, self.position = int(state["epoch"]), int(state["position"])


class RandomSampler(EpochSampler):
    """Seeded random permutation of all rows, a fresh one every epoch (``sampler: random``)."""

    def global_order(self, epoch: int) -> np.ndarray:
        """Return ``permutation(num_rows)`` drawn from :func:`epoch_rng` ``(seed, epoch)``; int64 ``[num_rows]``."""
        return epoch_rng(self.seed, epoch).permutation(self.num_rows)


class SequentialSampler(EpochSampler):
    """Rows in file order every epoch (``sampler: sequential``); the seed is unused."""

    def global_order(self, epoch: int) -> range:
        """Return ``range(num_rows)``."""
        return range(self.num_rows)


BUILTIN_SAMPLERS: dict[str, type[EpochSampler]] = {"random": RandomSampler, "sequential": SequentialSampler}


class SamplerError(ValueError):
    """A sampler yielded something that is not a row index of its dataset (names the sampler and the value)."""


class ResumableBatchSampler:
    """Group an infinite sampler's indices into micro-batches; the loader's ``batch_sampler``.

    Yields lists of ``micro_batch_size`` row indices forever; a micro-batch may span an epoch boundary.
    Its state is the inner sampler's state, wrapped with a ``header`` (see ``packsft.data.loader``)
    describing what the state is valid for. With ``header["num_rows"]`` (the loader sets it) every index
    is checked here, in the main process, before any row is read: indices enter the dataset only
    through this class.

    Raises:
        RuntimeError: (while iterating) if the inner sampler stops: samplers must roll epochs over.
        SamplerError: (while iterating) the sampler yielded a value that is not an integer in
            ``[0, num_rows)`` (named with the sampler's class path, ``header["sampler"]``).
    """

    def __init__(self, sampler: Any, micro_batch_size: int, header: dict[str, Any] | None = None) -> None:
        self.sampler, self.micro_batch_size = sampler, micro_batch_size
        self.header = dict(header or {})

    def __iter__(self) -> Iterator[list[int]]:
        """Yield micro-batches (lists of ``micro_batch_size`` row indices) forever."""
        it = iter(self.sampler)
        num_rows = self.header.get("num_rows")
        while True:
            batch = []
            for _ in range(self.micro_batch_size):
                try:
                    index = next(it)
                except StopIteration:
                    raise RuntimeError(
                        f"sampler {type(self.sampler).__name__} stopped; training samplers must be infinite "
                        "and roll epochs over inside __iter__ (subclass packsft.data.samplers.EpochSampler)"
                    ) from None
                if num_rows is not None:
                    self._check_index(index, num_rows)
                batch.append(index)
            yield batch

    def _check_index(self, index: Any, num_rows: int) -> None:
        try:
            value = operator.index(index)
        except TypeError:
            value = None
        if value is None or not 0 <= value < num_rows:
            name = self.header.get("sampler") or type(self.sampler).__name__
            raise SamplerError(f"sampler {name} yielded {index!r}, not a row index of the training data "
                               f"(0 to {num_rows - 1}: {num_rows} rows); a sampler must yield integers in "
                               "range(len(data_source))")

    def state_dict(self) -> dict[str, Any]:
        """Return ``{"sampler": inner sampler state}`` (a new dict; called once per batch by torchdata)."""
        return {"sampler": self.sampler.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the inner sampler from ``state["sampler"]``."""
        self.sampler.load_state_dict(state["sampler"])


class EvalShardSampler:
    """Finite sampler for evaluation: rows in order, this rank's share ``range(dp_rank, usable, dp_size)``.

    ``usable = num_rows - num_rows % dp_size`` so that every rank runs the same number of micro-batches
    (collectives in the eval step stay matched); the last ``num_skipped_rows`` rows are not evaluated.
    """

    def __init__(self, data_source: Any, dp_rank: int = 0, dp_size: int = 1) -> None:
        num_rows = num_rows_of(data_source)
        if num_rows < dp_size:
            raise ValueError(f"the eval dataset{_named(data_source)} has {num_rows} rows, fewer than dp_size={dp_size}")
        self.num_skipped_rows = num_rows % dp_size
        self.rows = range(dp_rank, num_rows - self.num_skipped_rows, dp_size)

    def __iter__(self) -> Iterator[int]:
        """Yield this rank's row indices once, in order."""
        return iter(self.rows)

    def __len__(self) -> int:
        """Return the number of rows this rank evaluates."""
        return len(self.rows)
