"""Stateful data loaders over packed rows, and their checkpoint state (independent of workers and, for the
global-order samplers, of the data-parallel layout).

``build_train_dataloader`` returns a torchdata ``StatefulDataLoader`` whose ``batch_sampler`` is a
:class:`~packsft.data.samplers.GlobalBatchSampler` around an :class:`~packsft.data.samplers.EpochSampler`
(built-in samplers, the mixture's, custom subclasses): every rank cuts the same global order into global
batches of ``global_batch_size`` rows and takes its share of each (``loader.balance`` decides which rows, see
:mod:`packsft.data.balance`). A custom sampler that is not an ``EpochSampler`` yields its rank's indices itself
(:class:`~packsft.data.samplers.ResumableBatchSampler`). Iterate with one iterator and one ``next()`` per
micro-batch; it never ends.

Checkpointing (``loader_state_dict`` / ``load_loader_state_dict``): the saved state is the
*batch sampler's own* state plus a versioned header, never torchdata's worker snapshot, so a state saved
with 2 workers loads into a loader with 0 workers and vice versa (torchdata's own state does not
allow that). With workers the main process samples ahead of what was yielded (prefetch), so the
sampler's state is read from torchdata's snapshot of the last *yielded* batch; the loader is built
with ``snapshot_every_n_steps=1`` so that snapshot is always current.

Portable between save and resume: ``num_workers``, ``persistent_workers``; with a global order and a state at a
global batch boundary (every trainer checkpoint), also ``dp_size``, ``dp_rank``, ``micro_batch_size``,
``global_batch_size`` and ``balance``: the next global batch holds the rows the saved run would have trained next.
Refused with ``ValueError``: a different dataset (``fingerprint`` attribute or row count), sampler class, ``seed``
or ``sampler_kwargs``; a layout change for a state inside a global batch or of a per-rank custom sampler; a state
of version 1 at another ``dp_size``.

Usage::

    cfg = DataLoaderConfig(sampler="random", seed=1234, micro_batch_size=1, num_workers=2)
    loader = build_train_dataloader(dataset, cfg, dp_rank=dp_rank, dp_size=dp_size, global_batch_size=64)
    if resuming:
        load_loader_state_dict(loader, checkpoint["dataloader"])
    batches = iter(loader)
    for step in range(start_step, train_steps):
        batch = next(batches)
        ...
        checkpoint["dataloader"] = loader_state_dict(loader)
"""

from __future__ import annotations

import json
import signal
from collections.abc import Callable
from typing import Any

import torch
from torchdata.stateful_dataloader import StatefulDataLoader

from packsft.data.balance import AttentionBalance
from packsft.data.loader_config import (
    DataLoaderConfig,
    class_path,
    kwargs_digest,
    plain_value,
    recordable_kwargs,
)
from packsft.data.samplers import (
    EpochSampler,
    EvalShardSampler,
    GlobalBatchSampler,
    ResumableBatchSampler,
)

STATE_VERSION = 2
LAYOUT_FIELDS = ("dp_rank", "dp_size", "micro_batch_size", "global_batch_size", "balance")
"""Header fields a global-order state may change at a global batch boundary."""
def _default_collate() -> Callable:
    """Import ``packsft.data.collate.collate_rows`` at call time (the module is built separately)."""
    from packsft.data.collate import collate_rows

    return collate_rows


def build_train_dataloader(
    dataset: Any,
    config: DataLoaderConfig,
    *,
    dp_rank: int = 0,
    dp_size: int = 1,
    global_batch_size: int | None = None,
    collate_fn: Callable | None = None,
) -> StatefulDataLoader:
    """Build the infinite training loader of one data-parallel rank.

    Args:
        dataset: a map-style dataset (``PackedSFTDataset`` or any with ``__len__``/``__getitem__``);
            its optional ``fingerprint`` str goes into the checkpoint header. Must be picklable when
            ``num_workers > 0`` (workers are spawned and re-import its module). ``balance: attention`` reads its
            rows' segment lengths (:func:`packsft.data.balance.segment_lengths_reader`).
        config: the :class:`DataLoaderConfig` (validated when it was built).
        dp_rank, dp_size: this rank and the data-parallel world size.
        global_batch_size: rows per global batch (the trainer's ``train.global_batch_size``), a multiple of
            ``dp_size * micro_batch_size``; default ``dp_size * micro_batch_size`` (one micro-batch per rank).
            Unused by a sampler that is not an ``EpochSampler``.
        collate_fn: turns a list of ``micro_batch_size`` rows into a batch; default
            ``packsft.data.collate.collate_rows`` (imported here, at call time).

    Returns:
        A ``StatefulDataLoader`` yielding ``collate_fn([dataset[i] for i in micro_batch])`` forever.

    Raises:
        ValueError: from the sampler (fewer rows than ``dp_size``, ...), or a ``global_batch_size`` that is not a
            multiple of ``dp_size * micro_batch_size``.
    """
    cls = config.sampler_class()
    kwargs = plain_value(config.sampler_kwargs)
    sampler = cls(dataset, dp_rank=dp_rank, dp_size=dp_size, seed=config.seed, **kwargs)
    b = config.micro_batch_size
    global_order = isinstance(sampler, EpochSampler)
    header = {
        "version": STATE_VERSION,
        "order": "global" if global_order else "rank",
        "dp_rank": dp_rank,
        "dp_size": dp_size,
        "num_rows": len(dataset),
        "dataset_fingerprint": getattr(dataset, "fingerprint", None),
        "sources": getattr(dataset, "source_fingerprints", None),        # a mixture's {name: fingerprint}
        "micro_batch_size": b,
        "global_batch_size": (global_batch_size or dp_size * b) if global_order else None,
        "balance": config.balance,
        "sampler": class_path(cls),
        "seed": config.seed,
        "sampler_kwargs_digest": kwargs_digest(kwargs),
        "sampler_kwargs": recordable_kwargs(kwargs),      # to name what changed; compared through the digest
    }
    if not global_order:
        return _make_loader(dataset, ResumableBatchSampler(sampler, b, header), config, collate_fn)
    plan = AttentionBalance(dataset) if config.balance == "attention" else None
    batch_sampler = GlobalBatchSampler(sampler, dp_rank=dp_rank, dp_size=dp_size, micro_batch_size=b,
                                       global_batch_size=header["global_batch_size"], header=header, plan=plan)
    return _make_loader(dataset, batch_sampler, config, collate_fn)


def build_eval_dataloader(
    dataset: Any,
    config: DataLoaderConfig,
    *,
    dp_rank: int = 0,
    dp_size: int = 1,
    collate_fn: Callable | None = None,
) -> StatefulDataLoader:
    """Build a finite evaluation loader: this rank's rows in file order, one pass per ``iter()``.

    Rows ``dp_rank, dp_rank + dp_size, ...`` of the first ``len(dataset) - len(dataset) % dp_size``
    rows, in micro-batches of ``config.micro_batch_size`` (the last may be smaller); every rank runs
    the same number of micro-batches. The sampler config is not used (evaluation is not sampled).

    Raises:
        ValueError: if the dataset has fewer rows than ``dp_size``.
    """
    batch_sampler = torch.utils.data.BatchSampler(
        EvalShardSampler(dataset, dp_rank=dp_rank, dp_size=dp_size), config.micro_batch_size, drop_last=False
    )
    return _make_loader(dataset, batch_sampler, config, collate_fn)


def _make_loader(dataset: Any, batch_sampler: Any, config: DataLoaderConfig, collate_fn: Callable | None):
    """Wrap ``batch_sampler`` in a ``StatefulDataLoader`` with the config's worker settings."""
    workers = config.num_workers
    if workers > 0:
        _end_workers_at_exit()
    return StatefulDataLoader(
        dataset,
        batch_sampler=batch_sampler,
        num_workers=workers,
        persistent_workers=config.persistent_workers and workers > 0,
        multiprocessing_context="spawn" if workers > 0 else None,
        collate_fn=collate_fn if collate_fn is not None else _default_collate(),
        generator=torch.Generator().manual_seed(config.seed),
        snapshot_every_n_steps=1,
        worker_init_fn=leave_stop_signals_to_the_trainer if workers > 0 else None,
    )


def leave_stop_signals_to_the_trainer(worker_id: int) -> None:
    """Loader worker initializer: ignore SIGTERM and SIGINT, so that only the trainer decides what a stop does.

    A terminal's Ctrl-C reaches every process of its group, torchrun sends its SIGTERM to each trainer's whole
    process group and Slurm signals every process of the job; the trainer then finishes its step and saves, which
    needs its workers alive (torch's own worker handler would end them: ``DataLoader worker ... killed by signal:
    Terminated``). They still end with the trainer: on its shutdown message, by torch's ``ManagerWatchdog`` once
    the trainer is gone (checked every ``MP_STATUS_CHECK_INTERVAL`` = 5 s) and by a SIGKILL to the group.
    """
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)


_END_AT_EXIT = False


def _end_workers_at_exit() -> None:
    """Have the loader workers still alive at this process's exit killed (once per process).

    ``multiprocessing``'s own exit handler SIGTERMs its daemonic children, loader workers included, and then joins
    them: workers that ignore SIGTERM (:func:`leave_stop_signals_to_the_trainer`) would keep a trainer that ends on
    an error (their iterator never shut down) waiting forever. This handler, registered later, runs before it and
    SIGKILLs them (torch's SIGCHLD handler, which would take that for a worker failure, is removed first).
    """
    global _END_AT_EXIT
    if _END_AT_EXIT:
        return
    import atexit
    import multiprocessing

    def end() -> None:
        workers = [child for child in multiprocessing.active_children() if child.daemon]
        if workers and hasattr(signal, "SIGCHLD"):
            # torch's SIGCHLD handler would report each killed worker as a failure ("DataLoader worker ... is
            # killed by signal: Killed") in the middle of the exit
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        for child in workers:
            child.kill()
            child.join()

    atexit.register(end)
    _END_AT_EXIT = True


def loader_state_dict(dataloader: StatefulDataLoader) -> dict[str, Any]:
    """Return the resumable state of a training loader: its header plus ``sampler_state``.

    ``sampler_state`` is the batch sampler's state as of the last micro-batch *yielded*: read live
    before the first ``iter()`` or with 0 workers, and from torchdata's per-step snapshot with workers
    (``_snapshot._main_snapshot._index_sampler_state``; the main process has sampled ahead). Plain
    Python values only (JSON/``torch.save`` friendly). ``dataloader`` is one of :func:`build_train_dataloader`.
    """
    batch_sampler = dataloader.batch_sampler
    if dataloader._iterator is None:  # never iterated (or just loaded): the live state is exact
        sampler_state = batch_sampler.state_dict()
    else:
        state = dataloader.state_dict()
        if "_snapshot" in state:
            assert state["_steps_since_snapshot"] == 0, "the loader is built with snapshot_every_n_steps=1"
            sampler_state = state["_snapshot"]["_main_snapshot"]["_index_sampler_state"]
        else:
            sampler_state = state["_index_sampler_state"]
    return {**batch_sampler.header, "sampler_state": sampler_state}


def check_loader_state(expected: dict[str, Any], state: dict[str, Any]) -> None:
    """Refuse a state that would not continue the same order on this loader (a foreign state differs in every
    header field).

    A global-order state at a global batch boundary (``sampler_state["micro_batch"] == 0``) may have another
    layout (:data:`LAYOUT_FIELDS`); any other state must have this loader's.

    Raises:
        ValueError: listing every header field that differs (``version``, ``order``, ``dp_rank``, ``dp_size``,
            ``num_rows``, ``dataset_fingerprint``, ``micro_batch_size``, ``global_batch_size``, ``balance``,
            ``sampler``, ``seed``, each changed ``sampler_kwargs.<key>`` (``sampler_kwargs_digest`` for a state that
            does not record them), each training source changed, new or gone, or a mixture that is now one file),
            with the checkpoint's and the current value.
    """
    inside = (state.get("sampler_state") or {}).get("micro_batch") or 0
    free = LAYOUT_FIELDS if expected.get("order") == "global" == state.get("order") and not inside else ()
    diffs = [
        f"{key}: checkpoint {state.get(key)!r}, now {value!r}"
        for key, value in expected.items()
        if state.get(key) != value and key not in ("sources", "dataset_fingerprint", "sampler_kwargs", *free)
    ]
    was, kwargs = state.get("sampler_kwargs"), expected.get("sampler_kwargs")
    digest = next((i for i, d in enumerate(diffs) if d.startswith("sampler_kwargs_digest:")), None)
    if digest is not None and isinstance(was, dict) and isinstance(kwargs, dict):  # name the keys, not the hashes
        named = [f"sampler_kwargs.{k}: checkpoint {was.get(k)!r}, now {kwargs.get(k)!r}"
                 for k in sorted({*was, *kwargs}) if json.dumps(was.get(k)) != json.dumps(kwargs.get(k))]
        diffs[digest:digest + 1] = named or diffs[digest:digest + 1]  # (1 and 1.0: the digest's own line)
    saved, now = state.get("sources") or {}, expected.get("sources") or {}
    if bool(saved) != bool(now):  # a mixture became one file, or one file a mixture
        diffs.append(f"training sources: checkpoint {list(saved) if saved else 'one file'}, "
                     f"now {list(now) if now else 'one file'}")
    elif saved:
        changed = [n for n in now if n in saved and saved[n] != now[n]]
        diffs += [f"training source {n!r} changed (its packed file differs from the checkpoint's)" for n in changed]
        diffs += [f"training source {n!r} is new" for n in now if n not in saved]
        diffs += [f"training source {n!r} is gone" for n in saved if n not in now]
        if set(saved) == set(now) and list(saved) != list(now):  # (the weights then differ in order too)
            diffs.append(f"training sources are in another order: checkpoint {list(saved)}, now {list(now)}")
    elif state.get("dataset_fingerprint") != expected.get("dataset_fingerprint"):
        diffs.append(f"dataset_fingerprint: checkpoint {state.get('dataset_fingerprint')!r}, "
                     f"now {expected.get('dataset_fingerprint')!r}")
    if diffs:
        where = (f" (the state is inside a global batch, {inside} micro-batch(es) of it trained on this rank: only "
                 "the same layout continues it)" if inside and expected.get("order") == "global" else "")
        raise ValueError(
            "cannot resume the data loader exactly; the checkpoint was written for a different setup "
            "(dataset, sampler, seed and sampler_kwargs must stay the same; num_workers may change, and dp_size, "
            "micro_batch_size, global_batch_size and balance at a global batch boundary, except for a custom "
            "sampler that yields each rank's rows itself): " + "; ".join(diffs) + where + ". To keep the weights "
            "and optimizer but restart the data order, resume with checkpoint.restore_data_order=false; to start "
            "over, train in a new logging.output_dir"
        )


def upgrade_loader_state(state: dict[str, Any], batch_sampler: Any) -> dict[str, Any]:
    """A version-1 state (each rank's position in its strided share of the epoch's order) as a version-2 one for
    ``batch_sampler``; any other state unchanged.

    With a global order the share's position ``p`` of epoch ``e`` becomes position ``p * dp_size`` of the
    epoch's global order (the rows every rank trained), or epoch ``e + 1`` when the share was used up (version 1
    skipped the last ``len % dp_size`` rows of an epoch). The next rows are those the saved run would have
    trained next, at the same ``dp_size``.

    Raises:
        ValueError: a version-1 state of a global order at another ``dp_size`` (named).
    """
    if state.get("version") != 1:
        return state
    header = batch_sampler.header
    upgraded = {**state, "version": STATE_VERSION, "order": header["order"],
                "global_batch_size": header["global_batch_size"], "balance": "none"}
    if header["order"] != "global":
        return upgraded
    if state.get("dp_size") != header["dp_size"]:
        raise ValueError(f"cannot resume the data loader exactly: its state was saved by an earlier packsft "
                         f"(loader state version 1: each rank's own position), which resumes only at its "
                         f"dp_size {state.get('dp_size')}, now {header['dp_size']}; resume at data-parallel size "
                         f"{state.get('dp_size')} once and save (its checkpoints then resume at any size), or resume "
                         "with checkpoint.restore_data_order=false to restart the data order")
    saved = state["sampler_state"]["sampler"]
    dp, epoch = int(state["dp_size"]), int(saved["epoch"])
    length = len(batch_sampler.sampler.epoch_order(epoch))
    rows = int(saved["position"]) * dp
    epoch, rows = (epoch + 1, 0) if rows >= length - length % dp else (epoch, rows)
    upgraded["sampler_state"] = {"sampler": {**saved, "epoch": epoch, "position": rows}, "global_batches": 0,
                                 "micro_batch": 0}
    return upgraded


def load_loader_state_dict(dataloader: StatefulDataLoader, state: dict[str, Any]) -> None:
    """Restore a state of :func:`loader_state_dict`; the next micro-batch is the one that followed.

    Any worker count works; a global-order state at a global batch boundary loads at any data-parallel layout.
    A version-1 state of the same dataset and sampler is upgraded first (:func:`upgrade_loader_state`). Drops the
    loader's current iterator, so call ``iter(dataloader)`` after.

    Raises:
        ValueError: see :func:`check_loader_state` and :func:`upgrade_loader_state`.
    """
    batch_sampler = dataloader.batch_sampler
    if state.get("sampler") == batch_sampler.header["sampler"]:     # (another sampler's is refused below)
        state = upgrade_loader_state(state, batch_sampler)
    check_loader_state(batch_sampler.header, state)
    batch_sampler.load_state_dict(state["sampler_state"])
    dataloader.load_state_dict({})  # forget any iterator (and its prefetched indices)
