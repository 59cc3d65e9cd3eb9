"""Resumable samplers for step-based training, and the batch samplers that cut their order into micro-batches.

Training runs on ``global_step``, not epochs, so every training sampler here is *infinite* and
*epoch-aware*: epochs roll over inside ``__iter__`` and the step loop never sees ``StopIteration``
or an empty epoch, also when a checkpoint was taken right after the last sample of an epoch.

Global order (:class:`EpochSampler` and its subclasses): the sampler yields the rows of every epoch in
``global_order(epoch)``, one epoch after another, the same on every rank and for every data-parallel size.
:class:`GlobalBatchSampler` cuts that stream into global batches of ``global_batch_size`` rows (a global batch
may span an epoch boundary; no row is dropped at an epoch end) and gives data-parallel rank ``r`` its fixed
share of each: rows ``r, r + dp_size, ...`` of the global batch, ``micro_batch_size`` at a time, or the
share a ``balance`` plan (:mod:`packsft.data.balance`) assigns it. Its state is the sampler's
``{"epoch", "position"}`` (rows of the epoch's global order consumed) at the start of the global batch in
progress, the ``global_batches`` consumed, and the ``micro_batch``es of the batch in progress this rank has
yielded: at a step boundary (``micro_batch == 0``) it means the same at any ``dp_size``,
``micro_batch_size`` and global batch size, so a run resumes on another layout exactly.

Sampler contract (built-in and ``sampler: custom`` classes alike)::

    cls(data_source, dp_rank=..., dp_size=..., seed=..., **sampler_kwargs)

``data_source`` is the map-style dataset (built-ins also accept a row count). The easy way is to subclass
:class:`EpochSampler` and override :meth:`EpochSampler.global_order`; any state besides ``epoch`` and
``position`` goes into ``state_dict`` next to them. A class that is not an ``EpochSampler`` must define
``__iter__`` (yield *this rank's* row indices forever), ``state_dict()`` (cheap, no side effects, returns a new
dict of plain Python values: torchdata calls it once per batch sent to a worker) and ``load_state_dict(state)``;
the loader groups its indices with :class:`ResumableBatchSampler`, and its state resumes only on the same
data-parallel layout.
"""

from __future__ import annotations

import operator
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np


def num_rows_of(data_source: Any, dp_size: int = 1, what: str = "dataset") -> int:
    """Return the number of rows of a map-style dataset (``len``), or ``data_source`` itself if it is an int.

    Raises:
        ValueError: fewer rows than ``dp_size`` (some rank would get none), naming the ``what`` and its file, or
            as the dataset names itself (its ``named``: the config key that chose it) with its ``too_few_rows``
            (what to do).
    """
    if isinstance(data_source, (int, np.integer)) and not isinstance(data_source, bool):
        num_rows = int(data_source)
    else:
        num_rows = len(data_source)
    if num_rows < dp_size:
        path = getattr(data_source, "path", None)  # a packed file, a subset of one
        named = getattr(data_source, "named", None) or f"the {what}{f' {path}' if path else ''}"
        fix = getattr(data_source, "too_few_rows", None)
        raise ValueError(f"{named} has {num_rows} row{'' if num_rows == 1 else 's'}, fewer than dp_size={dp_size}: "
                         f"some rank would get none{f'; {fix}' if fix else ''}")
    return num_rows


def epoch_rng(seed: int, epoch: int, salt: int = 0) -> np.random.Generator:
    """Return the numpy generator of one epoch, seeded from ``(seed, epoch, salt)``.

    A ``SeedSequence`` over the tuple keeps the streams of ``(seed, epoch + 1)`` and ``(seed + 1, epoch)``
    distinct, unlike ``seed + epoch``. Orders are reproducible for a given numpy release (NEP 19).
    """
    return np.random.default_rng(np.random.SeedSequence([int(seed), int(epoch), int(salt)]))


class EpochSampler(ABC):
    """Infinite, epoch-aware sampler of the global order of rows; subclass and define ``global_order``.

    Iterating yields ``global_order(0)``, then ``global_order(1)``, ... forever, whatever ``dp_rank`` and
    ``dp_size`` (the loader's :class:`GlobalBatchSampler` gives each rank its share).

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
        self.num_rows = num_rows_of(data_source, dp_size)
        self.dp_rank, self.dp_size, self.seed = dp_rank, dp_size, int(seed)
        self.epoch, self.position = 0, 0
        self._cached: tuple[int, list[int]] | None = None

    @abstractmethod
    def global_order(self, epoch: int) -> Sequence[int]:
        """Return the order of row indices of ``epoch``, identical on every rank. Subclasses define it."""

    def epoch_order(self, epoch: int) -> list[int]:
        """``global_order(epoch)`` as a list (the last epoch's is cached).

        Raises:
            RuntimeError: the epoch's order is empty.
        """
        if self._cached is None or self._cached[0] != epoch:
            order = np.asarray(self.global_order(epoch), dtype=np.int64).tolist()
            if not order:
                raise RuntimeError(f"{type(self).__name__}: epoch {epoch} has no sample; an epoch must hold "
                                   "at least one row")
            self._cached = (epoch, order)
        return self._cached[1]

    def __iter__(self) -> Iterator[int]:
        """Yield row indices of the global order forever, continuing from ``(epoch, position)``."""
        while True:
            order = self.epoch_order(self.epoch)
            while self.position < len(order):
                self.position += 1
                yield order[self.position - 1]
            self.epoch, self.position = self.epoch + 1, 0

    def state_dict(self) -> dict[str, int]:
        """Return ``{"epoch", "position"}``: samples of ``global_order(epoch)`` already yielded."""
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


def check_index(index: Any, num_rows: int, name: str) -> int:
    """``index`` as an int when it is an integer in ``[0, num_rows)``.

    Raises:
        SamplerError: otherwise, naming the sampler ``name`` and the value.
    """
    try:
        value = operator.index(index)
    except TypeError:
        value = None
    if value is None or not 0 <= value < num_rows:
        raise SamplerError(f"sampler {name} yielded {index!r}, not a row index of the training data "
                           f"(0 to {num_rows - 1}: {num_rows} rows); a sampler must yield integers in "
                           "range(len(data_source))")
    return value


def _next_index(it: Iterator[Any], sampler: Any) -> Any:
    try:
        return next(it)
    except StopIteration:
        raise RuntimeError(
            f"sampler {type(sampler).__name__} stopped; training samplers must be infinite "
            "and roll epochs over inside __iter__ (subclass packsft.data.samplers.EpochSampler)"
        ) from None


class ResumableBatchSampler:
    """Group a per-rank sampler's indices into micro-batches: the loader's ``batch_sampler`` for a custom sampler
    that is not an :class:`EpochSampler` (it yields this rank's indices itself).

    Yields lists of ``micro_batch_size`` row indices forever; a micro-batch may span an epoch boundary.
    Its state is the inner sampler's state, wrapped with a ``header`` (see ``packsft.data.loader``)
    describing what the state is valid for. With ``header["num_rows"]`` (the loader sets it) every index
    is checked here, in the main process, before any row is read: indices enter the dataset only
    through this class or :class:`GlobalBatchSampler`.

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
        name = self.header.get("sampler") or type(self.sampler).__name__
        while True:
            batch = []
            for _ in range(self.micro_batch_size):
                index = _next_index(it, self.sampler)
                if num_rows is not None:
                    check_index(index, num_rows, name)
                batch.append(index)
            yield batch

    def state_dict(self) -> dict[str, Any]:
        """Return ``{"sampler": inner sampler state}`` (a new dict; called once per batch by torchdata)."""
        return {"sampler": self.sampler.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the inner sampler from ``state["sampler"]``."""
        self.sampler.load_state_dict(state["sampler"])


Plan = Callable[[list[int], int, int], list[list[list[int]]]]
"""``plan(global_batch, dp_size, micro_batch_size)``: for each rank, its micro-batches (lists of the global batch's
row indices); every row of the global batch exactly once (:class:`packsft.data.balance.AttentionBalance`)."""


class GlobalBatchSampler:
    """This rank's micro-batches of the global batches cut from an :class:`EpochSampler`'s global order.

    Each global batch is the next ``global_batch_size`` rows of the sampler's stream. Rank ``r`` trains rows
    ``r, r + dp_size, r + 2 dp_size, ...`` of it, ``micro_batch_size`` per micro-batch, ``global_batch_size /
    (dp_size * micro_batch_size)`` micro-batches per global batch; with ``plan``, the micro-batches the plan
    gives rank ``r`` (a function of the global batch alone: the same on every rank, no communication).

    Args:
        sampler: an :class:`EpochSampler` (its stream does not depend on ``dp_size``).
        dp_rank, dp_size: this rank and the data-parallel size.
        micro_batch_size: rows per micro-batch.
        global_batch_size: rows per global batch, a positive multiple of ``dp_size * micro_batch_size`` (the
            training config checks it against the world size, ``packsft.train.config``).
        header: the loader's state header (``num_rows`` enables the index check, ``sampler`` names the class).
        plan: see :data:`Plan`; ``None``: the strided split above.

    Raises:
        RuntimeError, SamplerError: (while iterating) as :class:`ResumableBatchSampler`.
    """

    def __init__(self, sampler: EpochSampler, *, dp_rank: int, dp_size: int, micro_batch_size: int,
                 global_batch_size: int, header: dict[str, Any] | None = None, plan: Plan | None = None) -> None:
        self.sampler, self.plan = sampler, plan
        self.dp_rank, self.dp_size, self.micro_batch_size = dp_rank, dp_size, micro_batch_size
        self.global_batch_size = global_batch_size
        self.micro_batches = global_batch_size // (dp_size * micro_batch_size)
        self.header = dict(header or {})
        self._start = dict(sampler.state_dict())    # the sampler's state where the batch in progress starts
        self._global_batches, self._micro_batch = 0, 0

    def rank_micro_batches(self, batch: list[int]) -> list[list[int]]:
        """This rank's micro-batches of one global batch (row indices)."""
        if self.plan is not None:
            return self.plan(batch, self.dp_size, self.micro_batch_size)[self.dp_rank]
        mine, b = batch[self.dp_rank::self.dp_size], self.micro_batch_size
        return [mine[m * b:(m + 1) * b] for m in range(self.micro_batches)]

    def global_batches(self) -> Iterator[list[int]]:
        """The global batches from the current state on (row indices, checked), forever; moves the sampler."""
        it = iter(self.sampler)
        num_rows = self.header.get("num_rows")
        name = self.header.get("sampler") or type(self.sampler).__name__
        while True:
            batch = [_next_index(it, self.sampler) for _ in range(self.global_batch_size)]
            yield batch if num_rows is None else [check_index(i, num_rows, name) for i in batch]

    def __iter__(self) -> Iterator[list[int]]:
        """Yield this rank's micro-batches forever, continuing from the state."""
        batches = self.global_batches()
        while True:
            self._start = dict(self.sampler.state_dict())
            micro = self.rank_micro_batches(next(batches))
            for m in range(self._micro_batch, self.micro_batches):
                self._micro_batch = m + 1
                yield micro[m]
            self._global_batches, self._micro_batch = self._global_batches + 1, 0

    def state_dict(self) -> dict[str, Any]:
        """``{"sampler", "global_batches", "micro_batch"}`` as of the last micro-batch yielded (a new dict)."""
        if self._micro_batch == self.micro_batches:    # the global batch is done: the state after it
            return {"sampler": self.sampler.state_dict(), "global_batches": self._global_batches + 1,
                    "micro_batch": 0}
        return {"sampler": dict(self._start), "global_batches": self._global_batches,
                "micro_batch": self._micro_batch}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from :meth:`state_dict`'s ``state``: the next micro-batch is the one that followed."""
        self.sampler.load_state_dict(state["sampler"])
        self._start = dict(self.sampler.state_dict())
        self._global_batches = int(state.get("global_batches", 0))
        self._micro_batch = int(state.get("micro_batch", 0))


class EvalShardSampler:
    """Finite sampler for evaluation: rows in order, this rank's share ``range(dp_rank, usable, dp_size)``.

    ``usable = num_rows - num_rows % dp_size`` so that every rank runs the same number of micro-batches
    (collectives in the eval step stay matched); the last ``num_skipped_rows`` rows are not evaluated.
    """

    def __init__(self, data_source: Any, dp_rank: int = 0, dp_size: int = 1) -> None:
        num_rows = num_rows_of(data_source, dp_size, "eval dataset")
        self.num_skipped_rows = num_rows % dp_size
        self.rows = range(dp_rank, num_rows - self.num_skipped_rows, dp_size)

    def __iter__(self) -> Iterator[int]:
        """Yield this rank's row indices once, in order."""
        return iter(self.rows)

    def __len__(self) -> int:
        """Return the number of rows this rank evaluates."""
        return len(self.rows)
