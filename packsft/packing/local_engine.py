"""``engine="local"``: shards counted in this process or in a pool of ``num_workers`` processes of this machine
(:class:`LocalEngine`), rows written by this process."""

from __future__ import annotations

import contextlib
import gc
import multiprocessing as mp
import os
import signal
import sys
from pathlib import Path

from packsft.packing.config import PackConfig, PackError
from packsft.packing.merge import Counted
from packsft.packing.rows import write_rows
from packsft.packing.shards import SHARD_BYTES_MIN, Shard
from packsft.packing.signals import STOP_SIGNALS, signals_held
from packsft.packing.sources import is_row_source
from packsft.packing.worker import count_shard, init_worker, worker_fingerprint
from packsft.prompt_formats import Tokenization
from packsft.token_cache import TokenCacheWriter


def _abort_workers(executor) -> None:
    """Stop an executor's worker processes now (a strict stop or an error: their work is not needed)."""
    for proc in list(getattr(executor, "_processes", {}).values()):
        if proc.is_alive():
            proc.terminate()
    executor.shutdown(wait=True, cancel_futures=True)


def dead_worker_message(cfg: PackConfig, shards: list[Shard], spool_dir: str, executor) -> str:
    """Which worker died and which shard it was reading (from the marker file each worker writes per shard).

    The pool ends the other workers with SIGTERM once one has died, so those are only counted, unless SIGTERM
    ended them all: then one of them was sent it from outside the packer, and each is named with its shard."""
    manager = getattr(executor, "_executor_manager_thread", None)
    if manager is not None:  # it joins the workers of a broken pool; polling them meanwhile races its waitpid
        manager.join(timeout=30)
    deaths, stopped = [], []  # stopped: the workers ended by SIGTERM
    for pid, proc in sorted((getattr(executor, "_processes", None) or {}).items()):
        code = proc.exitcode
        if code is None or code == 0:
            continue
        at = _worker_whereabouts(cfg, shards, spool_dir, pid)
        if code == -signal.SIGTERM:
            stopped.append(f"worker process {pid}{at}")
            continue
        how = (f"killed by {signal.Signals(-code).name}" if code < 0 and -code in signal.valid_signals()
               else f"exit code {code}")
        deaths.append(f"worker process {pid} died ({how}){at}")
    if stopped and deaths:
        deaths.append(f"{len(stopped)} worker process(es) ended by SIGTERM (the pool stops the others when one dies)")
    elif stopped:
        return ("SIGTERM from outside the packer ended a worker process (the pool then stops the others with it): "
                + "; ".join(stopped))
    what = "; ".join(deaths) or "a worker process died"
    return (f"{what}; SIGKILL is what the out-of-memory killer sends: use fewer --num-workers or more memory, "
            "or lower --max-conversation-bytes")


def _worker_whereabouts(cfg: PackConfig, shards: list[Shard], spool_dir: str, pid: int) -> str:
    """`` while reading shard K of FILE (bytes A-B)``, `` while idle, after shard K of FILE`` or `` before reading a
    shard``: what worker ``pid`` was doing, from its marker file."""
    try:
        with open(os.path.join(spool_dir, f"worker.{pid}")) as f:
            index, _, done = f.read().partition(" ")
        shard = shards[int(index)]
    except (OSError, ValueError, IndexError):
        return " before reading a shard"
    span = "all rows" if is_row_source(cfg.inputs[shard.file_idx]) else f"bytes {shard.start}-{shard.end}"
    return (f" while idle, after shard {shard.index} of {cfg.inputs[shard.file_idx]}" if done else
            f" while reading shard {shard.index} of {cfg.inputs[shard.file_idx]} ({span})")


def worker_start_method() -> str:
    """``fork`` on Linux: the workers inherit the packer's imports and loaded tokenizer, so none pays an
    interpreter start, the transformers import and a tokenizer load (about a second each), as the workers of
    ``datasets.map(num_proc=...)`` and PyTorch's ``DataLoader`` start. ``spawn`` elsewhere, and in a process
    connected to Ray (whose threads a forked child would inherit the state of)."""
    ray = sys.modules.get("ray")
    if sys.platform != "linux" or (ray is not None and getattr(ray, "is_initialized", lambda: False)()):
        return "spawn"
    return "fork"


@contextlib.contextmanager
def _frozen_gc(active: bool = True):
    """With ``active``, the garbage collector's objects frozen (:func:`gc.freeze`) for the block: its collections
    then leave them alone. While forking: a forked worker's collections leave the objects it inherits alone,
    instead of going through them all and writing to (so copying) the pages holding them (the workers' first
    shard took about 0.04 s longer without, 2-core machine). While counting in this process: each full
    collection went through the imports' and the tokenizer's objects (about 65,000; 25-30 ms each, one per
    2,000 two-turn conversations). Nothing is done when the caller has frozen objects already:
    :func:`gc.unfreeze` would release theirs too."""
    if not active or gc.get_freeze_count():
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


class LocalEngine:
    """The local :class:`packsft.packing.engine.Engine` of a run with settings ``cfg``."""

    def __init__(self, cfg: PackConfig):
        self.cfg = cfg

    def session(self):
        """Nothing to connect to."""
        return contextlib.nullcontext()

    def count(self, shards: list[Shard], spool_dir: str, tokenization: Tokenization | None = None,
              fingerprint: list[str] | None = None):
        """Yield :class:`packsft.packing.shards.ShardResult` in shard order; with workers, ``num_workers`` processes
        read shards in parallel (forked workers use ``tokenization``, the packer's, resolved). One JSONL shard in all,
        or by default JSONL inputs of at most 256 KiB in all, are read in this process: one worker would do the same
        work after its start.

        Args:
            fingerprint: a list, to which the tokenizer's fingerprint is appended when worker processes read the
                shards: one of them takes it, as a task before the shards (in this process it would hold the GIL
                for its whole serialization, and the thread that hands the workers their shards would wait for it).
                Otherwise (no workers, small inputs read in this process) the list stays empty.

        Raises:
            PackError: a worker process died (e.g. SIGKILL from the out-of-memory killer), naming its shard.
        """
        cfg = self.cfg
        # one JSONL shard, or by default JSONL inputs of at most a shard's bytes in all: a worker would only add
        # its start
        small = not any(is_row_source(cfg.inputs[s.file_idx]) for s in shards) and (
            len(shards) == 1 or (cfg.shard_bytes is None and sum(s.end - s.start for s in shards) <= SHARD_BYTES_MIN))
        if cfg.num_workers == 0 or small:
            init_worker(cfg, spool_dir, False, tokenization)  # closed by packsft.packing.worker.close_worker
            with _frozen_gc():  # the imports' and the tokenizer's objects, which every full collection went through
                for shard in shards:
                    yield count_shard(shard)
            return
        from concurrent.futures import ProcessPoolExecutor
        from concurrent.futures.process import BrokenProcessPool

        method = worker_start_method()  # a forked pool starts all its workers at once: no more than there are shards
        executor = ProcessPoolExecutor(max(1, min(cfg.num_workers, len(shards))),
                                       mp_context=mp.get_context(method), initializer=init_worker,
                                       initargs=(cfg, spool_dir, True, tokenization if method == "fork" else None))
        done = False
        try:
            # The pool forks its workers at the first submit. A SIGTERM/SIGINT handled meanwhile would raise inside
            # the at-fork hooks, where Python ignores the exception (the run went on and exited 0), or between two
            # forks, leaving a worker the pool does not know of (the packer hung waiting for it at exit): it is held
            # until the pool is consistent, then raised here, and the `finally` stops the workers.
            with signals_held(STOP_SIGNALS), _frozen_gc(method == "fork"):
                taken = executor.submit(worker_fingerprint) if fingerprint is not None else None
                futures = [executor.submit(count_shard, s) for s in shards]

            def result_of(future):
                try:
                    return future.result()
                except BrokenProcessPool as e:
                    raise PackError(dead_worker_message(cfg, shards, spool_dir, executor)) from e

            for future in futures:
                yield result_of(future)
            if taken is not None:
                fingerprint.append(result_of(taken))
            done = True
        finally:
            if done:
                executor.shutdown(wait=True)
            else:
                _abort_workers(executor)

    def write_rows(self, order, starts, counted: Counted, tmp: Path, spool_dir: str,
                   cache: TokenCacheWriter | None) -> tuple[int, str]:
        """All rows into ``tmp`` in this process (:func:`packsft.packing.rows.write_rows`)."""
        import numpy as np

        return write_rows(order, starts, counted, tmp, np, cache, self.cfg.max_seq_len)
