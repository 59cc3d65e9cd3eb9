"""``--engine ray``: the packer's read/tokenize/count stage and its row writing as Ray Data tasks.

Needs the ``packsft[ray]`` extra (``ray[data]``). The driver (the process running the packer) cuts the inputs
into the same shards as the local engine (:func:`packsft.packing.shards.plan_shards`) and maps
:func:`packsft.packing.worker.count_shard` over them with :mod:`ray.data`: an actor pool of ``num_workers``
tokenizer processes (default: one per CPU of the cluster), results kept in shard order. Each shard's
conversations go to a spool file of their own beside the output; only the per-shard numpy arrays (tokens,
spool offsets) and the rejected lines come back. The driver runs the same global packing, then maps row ranges
to tasks that write parts of the rows file and of the token cache from the spools; it concatenates the parts in
row order, hashing them. Rows, sidecar and token cache are byte-identical to the local engine's for the same
inputs and settings.

Every Ray node must see the inputs, the tokenizer and the output's folder at the same paths (a shared
filesystem): spools and parts are written in a temp folder beside the output. Ray's own docs:
https://docs.ray.io/en/latest/data/transforming-data.html (actor pools),
https://docs.ray.io/en/latest/cluster/vms/user-guides/community/slurm.html (a cluster on Slurm).
"""

from __future__ import annotations

import contextlib
import importlib
import json
import logging
import os
import socket
from pathlib import Path
from typing import Any

import numpy as np

import packsft
from packsft.extras import import_extra
from packsft.io import HashingWriter
from packsft.packing.config import PackConfig, PackError
from packsft.packing.merge import Counted
from packsft.packing.rows import row_groups, write_row_range
from packsft.packing.shards import Shard, ShardResult
from packsft.packing.worker import WORKER_HOOK_ENV, count_shard, worker_state
from packsft.token_cache import TokenCacheWriter

_RETRIES = 2
"""Restarts of a dead actor and retries of its task (Ray Data's default is unbounded: a task the OOM killer stops
every time would never end)."""
_PART_ROWS_MIN = 256
"""Fewest rows a row-writing task gets (fewer parts for small outputs)."""


def _import_ray():
    import_extra("ray.data", "ray", "--engine ray", ValueError)
    return importlib.import_module("ray")


@contextlib.contextmanager
def ray_session(address: str | None):
    """Connect to the Ray cluster at ``address`` (``ray.init``; ``None``: ``$RAY_ADDRESS``, else a local
    instance started here), or use the one this process already joined; shut down what was started here.

    The workers get ``TOKENIZERS_PARALLELISM=false`` and this packsft's folder on ``PYTHONPATH``.

    Raises:
        ValueError: Ray is not installed, or ``address`` cannot be reached (Ray's message).
    """
    ray = _import_ray()
    started = False
    if not ray.is_initialized():
        root = str(Path(packsft.__file__).resolve().parents[1])
        path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH", "")) if p)
        _check_reachable(address or os.environ.get("RAY_ADDRESS"))
        try:
            ray.init(address=address, logging_level=logging.WARNING, log_to_driver=True,
                     runtime_env={"env_vars": {"TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": path}})
        except Exception as e:  # ConnectionError, RuntimeError, or a local start that timed out (Exception)
            where = f"--ray-address {address}" if address else "starting a local Ray instance"
            raise ValueError(f"{where}: {str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__}") \
                from e
        started = True
    logging.getLogger("ray.data").setLevel(logging.WARNING)  # Ray Data's per-dataset INFO lines
    ctx = ray.data.DataContext.get_current()
    saved = (ctx.execution_options.preserve_order, ctx.enable_progress_bars)
    ctx.execution_options.preserve_order = True  # shard results and parts come back in order
    ctx.enable_progress_bars = False  # the packer's own bar counts bytes
    try:
        yield ray
    finally:
        ctx.execution_options.preserve_order, ctx.enable_progress_bars = saved
        if started:
            ray.shutdown()


def _check_reachable(address: str | None, timeout: float = 10.0) -> None:
    """Refuse a ``HOST:PORT`` cluster address nothing listens on (``ray.init`` would retry it forever).

    ``auto``, ``local`` and ``ray://`` addresses are left to ``ray.init`` (which fails on them by itself).

    Raises:
        ValueError: the host does not resolve or does not accept a TCP connection within ``timeout`` seconds.
    """
    if not address or address in ("auto", "local") or "://" in address:
        return
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"--ray-address {address}: expected HOST:PORT (the head's GCS port, 6379 by default), "
                         "auto, or ray://HOST:10001")
    try:
        socket.create_connection((host, int(port)), timeout=timeout).close()
    except OSError as e:
        raise ValueError(f"--ray-address {address}: no Ray head answers there ({e}); start one with "
                         f"`ray start --head --port={port}` or check the address") from e


def _pool_size(ray, num_workers: int) -> int:
    return num_workers if num_workers > 0 else max(1, int(ray.cluster_resources().get("CPU", 1)))


def _map_actors(ray, items: list[dict], cls, args: tuple, pool: int, **remote):
    """``items`` (one block each) mapped through an actor pool of ``cls(*args)``, at most ``pool`` actors of one
    CPU; a dead actor is restarted and its task retried :data:`_RETRIES` times."""
    import warnings

    with warnings.catch_warnings():  # max_restarts / max_task_retries: Ray < 2.64 takes them as remote args
        warnings.filterwarnings("ignore", message=".*ray_remote_args.*deprecated")
        return ray.data.from_items(items, override_num_blocks=len(items)).map_batches(
            cls, fn_constructor_args=args, batch_size=1, num_cpus=1,
            compute=ray.data.ActorPoolStrategy(size=min(pool, len(items))), max_restarts=_RETRIES,
            max_task_retries=_RETRIES, **remote)


def _check_visible(folder: str) -> None:
    if not os.path.isdir(folder):
        raise PackError(f"{folder} is not visible on Ray node {socket.gethostname()}: the output's folder (and the "
                        "inputs and tokenizer) must be on a filesystem every Ray node mounts at the same path")


_NO_RESULT = {"error": "", "meta": "", "num_tokens": b"", "offset": b"", "size": b"", "token_offset": b""}
"""The columns of one :class:`_ShardCounter` row; a failed shard's row sets only ``error``."""


class _ShardCounter:
    """A Ray Data actor: :func:`~packsft.packing.worker.count_shard` for one shard per batch, spooled to
    files of that shard (``spool.shardN``, ``tokens.shardN``)."""

    def __init__(self, cfg, spool_dir: str):
        self.error = ""
        self.state = None
        try:
            _check_visible(spool_dir)
        except PackError as e:  # sent back with the first shard (an actor's constructor error is lost)
            self.error = f"PackError: {e}"
            return
        self.state = worker_state(cfg, spool_dir, True)  # in_worker: the WORKER_HOOK_ENV test hook acts here too

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        out: dict[str, list] = {}
        for index, file_idx, start, end in zip(*(batch[k].tolist() for k in ("index", "file_idx", "start", "end"))):
            row = {"error": self.error}
            if not self.error:
                try:
                    self.state.spool_name = f"shard{index}"
                    row = _encode(count_shard(Shard(index, file_idx, start, end), self.state))
                except (ValueError, OSError, PackError) as e:  # sent back as data: Ray keeps only its text
                    row = {"error": f"{'ValueError' if isinstance(e, ValueError) else 'PackError'}: {e}"}
            for key, value in {**_NO_RESULT, **row}.items():
                out.setdefault(key, []).append(value)
        return {k: np.array(v, dtype=object) for k, v in out.items()}


def _encode(r) -> dict[str, Any]:
    """A :class:`~packsft.packing.shards.ShardResult` as Arrow-friendly columns (bytes and a JSON string)."""
    meta = {"shard": [r.shard.index, r.shard.file_idx, r.shard.start, r.shard.end], "lines": r.lines,
            "conversations": r.conversations, "spool": r.spool, "token_spool": r.token_spool,
            "rejected": r.rejected, "warnings": r.warnings, "oversize": r.oversize, "nbytes": r.nbytes,
            "trained_fitting": r.trained_fitting, "split": r.split, "rejected_turns": r.rejected_turns}
    return {"meta": json.dumps(meta), "num_tokens": r.num_tokens.astype("<i4").tobytes(),
            "offset": r.offset.astype("<i8").tobytes(), "size": r.size.astype("<i8").tobytes(),
            "token_offset": b"" if r.token_offset is None else r.token_offset.astype("<i8").tobytes()}


def _decode(row: dict[str, Any]) -> ShardResult:
    meta = json.loads(row["meta"])
    cached = meta["token_spool"] is not None
    return ShardResult(Shard(*meta["shard"]), meta["lines"], meta["conversations"], meta["spool"],
                       np.frombuffer(row["num_tokens"], "<i4"), np.frombuffer(row["offset"], "<i8"),
                       np.frombuffer(row["size"], "<i8"), [tuple(x) for x in meta["rejected"]],
                       [tuple(x) for x in meta["warnings"]], [tuple(x) for x in meta["oversize"]], meta["nbytes"],
                       meta["token_spool"], np.frombuffer(row["token_offset"], "<i8") if cached else None,
                       meta["trained_fitting"], [tuple(x) for x in meta["split"]],
                       [tuple(x) for x in meta["rejected_turns"]])


def _task_error(e: Exception, cfg=None, shards=None, spool_dir: str | None = None) -> Exception:
    """A PackError with the first line of a failed Ray task's error (Ray does not keep the original one) and,
    for a counting task, the shard its dead worker was reading (from the marker file each worker writes)."""
    import re

    first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    at = ""
    pid = re.search(r"\bpid[:=] ?(\d+)", str(e))
    if pid and shards is not None:
        try:
            with open(os.path.join(spool_dir, f"worker.{pid.group(1)}")) as f:
                shard = shards[int(f.read())]
            span = "all rows" if shard.end == shard.start else f"bytes {shard.start}-{shard.end}"
            at = f" while reading shard {shard.index} of {cfg.inputs[shard.file_idx]} ({span})"
        except (OSError, ValueError, IndexError):
            pass
    return PackError(f"a Ray task of the packer failed{at} ({type(e).__name__}: {first}; a dead worker is retried "
                     f"{_RETRIES} times): a worker killed each time is most often the out-of-memory killer (use "
                     "fewer --num-workers per node, more memory, or a lower --max-conversation-bytes); one that "
                     "could not start is explained in Ray's log lines above")


def _task_rows(ds, cfg=None, shards=None, spool_dir: str | None = None):
    """The rows of the Ray dataset ``ds``, with what a task caught and sent back raised again on the driver
    (``"ValueError: ..."`` / ``"PackError: ..."``) and a failed task as :func:`_task_error` (``cfg``, ``shards``,
    ``spool_dir``: a counting task's, to name the shard its dead worker was reading).

    Raises:
        ValueError, PackError: a task's own error; PackError: a failed task.
    """
    import ray

    try:
        for row in ds.iter_rows():
            if row["error"]:
                kind, _, message = row["error"].partition(": ")
                raise ValueError(message) if kind == "ValueError" else PackError(message)
            yield row
    except ray.exceptions.RayError as e:  # e.g. a worker killed (the OOM killer), a node lost
        raise _task_error(e, cfg, shards, spool_dir) from e


def shard_results(cfg, shards, spool_dir: str):
    """Yield each shard's :class:`~packsft.packing.shards.ShardResult` in shard order, counted by Ray Data
    actors (``cfg.num_workers`` of them, default one per cluster CPU).

    Raises:
        PackError: a task failed (naming Ray's error), or the spool folder is not visible on a node.
        ValueError: a task's own settings error (e.g. a row source that cannot be read).
    """
    import ray

    items = [{"index": s.index, "file_idx": s.file_idx, "start": s.start, "end": s.end} for s in shards]
    hook = {"runtime_env": {"env_vars": {WORKER_HOOK_ENV: os.environ[WORKER_HOOK_ENV]}}} \
        if os.environ.get(WORKER_HOOK_ENV) else {}
    ds = _map_actors(ray, items, _ShardCounter, (cfg, spool_dir), _pool_size(ray, cfg.num_workers), **hook)
    for row in _task_rows(ds, cfg, shards, spool_dir):
        yield _decode(row)


class _RowWriter:
    """A Ray Data actor: writes one part (a row range) of the rows file and token cache from the spools."""

    def __init__(self, arrays: dict[str, Any], spools: list[str], token_spools: list[str] | None, spool_dir: str,
                 max_seq_len: int):
        _check_visible(spool_dir)
        self.counted = Counted([])
        self.counted.spools, self.counted.token_spools = spools, token_spools
        for key in ("num_tokens", "offset", "size", "spool", "token_offset"):
            setattr(self.counted, key, arrays[key])
        self.order, self.starts = arrays["order"], arrays["starts"]
        self.spool_dir, self.max_seq_len = spool_dir, max_seq_len

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        written, errors = [], []
        for part, r0, r1 in zip(*(batch[k].tolist() for k in ("part", "r0", "r1"))):
            try:
                self._write(part, r0, r1)
                errors.append("")
            except OSError as e:  # sent back as data: Ray keeps only its text
                errors.append(f"PackError: writing rows {r0}-{r1 - 1}: {e}")
            written.append(part)
        return {"part": np.array(written, dtype=np.int64), "error": np.array(errors, dtype=object)}

    def _write(self, part: int, r0: int, r1: int) -> None:
        rows_path, tokens_path = _part_paths(self.spool_dir, part)
        with contextlib.ExitStack() as stack:
            files = [stack.enter_context(open(rows_path, "wb"))]
            tokens_out = None
            if self.counted.token_spools is not None:
                files.append(stack.enter_context(open(tokens_path, "wb")))
                tokens_out = lambda data, *_, f=files[1]: f.write(data)  # noqa: E731
            write_row_range(self.order, self.starts, self.counted, r0, r1, files[0], tokens_out, np,
                             self.max_seq_len)
            for f in files:  # closed before the driver reads them: visible on every host
                f.flush()
                os.fsync(f.fileno())


def _part_paths(spool_dir: str, part: int) -> tuple[str, str]:
    return os.path.join(spool_dir, f"rows.part{part}"), os.path.join(spool_dir, f"tokens.part{part}")


def _parts(starts, conversations: int, pieces: int) -> list[tuple[int, int]]:
    """Row ranges ``(r0, r1)`` of about equal conversation counts, at least :data:`_PART_ROWS_MIN` rows each."""
    rows = len(starts)
    pieces = max(1, min(pieces, rows // _PART_ROWS_MIN))
    cuts = np.searchsorted(starts, np.linspace(0, conversations, pieces + 1)[1:-1]).tolist()
    bounds = sorted({0, rows, *(c for c in cuts if 0 < c < rows)})
    return list(zip(bounds, bounds[1:]))


def write_rows(cfg, order, starts, counted, tmp: Path, spool_dir: str, cache=None) -> tuple[int, str]:
    """Write all rows into ``tmp`` and their tokens into ``cache`` (a
    :class:`~packsft.token_cache.TokenCacheWriter`) through Ray Data tasks writing parts; return the rows'
    size in bytes and BLAKE2b-160 hex, as :func:`packsft.packing.rows.write_rows` does.

    Raises:
        PackError: a task failed.
    """
    import ray

    ends = np.append(starts[1:], len(order))
    pool = _pool_size(ray, cfg.num_workers)
    parts = _parts(starts, len(order), 4 * pool)
    arrays = {"order": order, "starts": starts, "num_tokens": counted.num_tokens, "offset": counted.offset,
              "size": counted.size, "spool": counted.spool, "token_offset": counted.token_offset}
    items = [{"part": k, "r0": r0, "r1": r1} for k, (r0, r1) in enumerate(parts)]
    ds = _map_actors(ray, items, _RowWriter, (arrays, counted.spools, counted.token_spools if cache is not None
                                              else None, spool_dir, cfg.max_seq_len), pool)
    with open(tmp, "wb") as f:
        out = HashingWriter(f)
        for row in _task_rows(ds):
            part = int(row["part"])
            r0, r1 = parts[part]
            rows_path, tokens_path = _part_paths(spool_dir, part)
            with open(rows_path, "rb") as src:
                while chunk := src.read(1 << 22):
                    out.write(chunk)
            os.unlink(rows_path)
            if cache is not None:
                with open(tokens_path, "rb") as src:  # read by row groups: a part can be GBs
                    for ra, rb in row_groups(starts, r0, r1, len(order), 1 << 16, np):
                        lo, hi = int(starts[ra]), int(ends[rb - 1])
                        ntok = counted.num_tokens[order[lo:hi]]
                        data = src.read(8 * int(np.minimum(ntok, cfg.max_seq_len).sum()))
                        cache.add_rows(data, ntok, np.diff(np.append(starts[ra:rb], hi)))
                os.unlink(tokens_path)
        f.flush()
        os.fsync(f.fileno())
    return out.size, out.hexdigest()


class RayEngine:
    """The Ray :class:`packsft.packing.engine.Engine` of a run with settings ``cfg``."""

    def __init__(self, cfg: PackConfig):
        self.cfg = cfg

    def session(self):
        """The cluster connection (:func:`ray_session` at ``cfg.ray_address``)."""
        return ray_session(self.cfg.ray_address)

    def count(self, shards: list[Shard], spool_dir: str, tokenization=None, fingerprint: list[str] | None = None):
        """:func:`shard_results`; ``tokenization`` and ``fingerprint`` are not used (each actor resolves the run's
        tokenization, loading the tokenizer once)."""
        return shard_results(self.cfg, shards, spool_dir)

    def write_rows(self, order, starts, counted: Counted, tmp: Path, spool_dir: str,
                   cache: TokenCacheWriter | None) -> tuple[int, str]:
        """:func:`write_rows`."""
        return write_rows(self.cfg, order, starts, counted, tmp, spool_dir, cache)
