"""Checkpoints: Megatron ``dist_checkpointing`` for model + AdamW state, small files for everything else.

Layout of ``<checkpoint_dir>``::

    latest                      # text: the name of the newest complete checkpoint, e.g. "iter_0000020"
    iter_0000020/
      .metadata, __*_*.distcp   # torch_dist shards of {"model": ..., "optimizer": ...} (dist_checkpointing)
      common.pt, metadata.json  # dist_checkpointing common state (optimizer param_groups, common_step)
      train_state.json          # rank 0: step and counters, scheduler, config, layout (+ lora_base, init_from)
      dataloader_dp{d}.pt       # one per data-parallel rank d (written by its TP=CP=0 rank): loader_state_dict
      rng_rank{r}.pt            # one per global rank r: torch, numpy (as tensors), python (JSON text), CUDA RNG states

Atomicity: every rank writes into ``iter_XXXXXXX.tmp``; after a barrier rank 0 renames it to ``iter_XXXXXXX`` and
then rewrites ``latest`` through a temp file + ``os.replace``. A process killed during a save leaves a ``.tmp``
folder that is never read (:func:`remove_partial_checkpoints` deletes it when the next run starts) and ``latest``
still names the previous complete checkpoint. With ``keep_last`` rank 0 then prunes older complete checkpoints
(:func:`prune_checkpoints`).

LoRA runs started from a base folder (``lora.enabled`` with ``checkpoint.init_from``): ``"model"`` holds only the
adapter tensors (``adapters_only``) and ``train_state.json`` has ``"lora_base": {"path", "fingerprint"}``
(:func:`packsft.train.model_checkpoint.base_identity`); resume and export load that base first, after checking its
fingerprint (:func:`packsft.train.model_checkpoint.check_lora_base`). A LoRA run without ``init_from`` (random base)
stores the whole model, the base's only copy.

Space: :func:`check_checkpoint_dir` checks before step 1 that the folder is writable and has room for one checkpoint
(:func:`checkpoint_bytes_estimate`); a save that fails for lack of space raises :class:`CheckpointSpaceError`.

Resharding: model and optimizer tensors are stored with their global shapes (``GPTModel.sharded_state_dict`` and
``get_param_id_to_sharded_param_map`` + ``optim_state_to_sharding_state``), so TP and DP
sizes may change between save and resume. With ``optimizer.backend: megatron`` the optimizer part is Megatron's own
``MegatronOptimizer.sharded_state_dict(model_sharded_state_dict)`` (as Megatron-LM saves it); the distributed
optimizer uses its ``dp_reshardable`` format (:data:`DIST_OPTIM_METADATA`: each DP rank writes its own shard, no
gather), so the DP size may change but not TP (a TP change needs the torch backend or Megatron's
``fully_reshardable`` format). The two backends' optimizer formats are not interchangeable.
``torch.distributed.checkpoint`` on a plain ``state_dict`` is not used: it
is silently wrong under TP>1 (a TP shard has the same key on each rank and is deduplicated as if replicated).
The data order (``dataloader_dp*.pt``) only continues with the same DP size and data; the RNG files are restored
when one exists for this rank.

Trust: nothing read from a checkpoint runs code. packsft's own files are JSON or plain tensors/values read with
``torch.load(weights_only=True)``; the ``dist_checkpointing`` files are read by
:mod:`packsft.train.safe_checkpoint_read` (``.metadata`` with a restricted unpickler, ``.distcp`` items and
``common.pt`` with ``weights_only=True``). A file holding anything else is refused (:class:`CheckpointError`, naming
it), as is a checkpoint of the older format with a pickled ``train_state.pt``.
"""

from __future__ import annotations

import errno
import json
import os
import pickle
import random
import re
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.optimizer import (
    get_param_id_to_sharded_param_map,
    optim_state_to_sharding_state,
)

from packsft.io import atomic_open, replace_dir, unwritable_dir_reason, write_json_atomic
from packsft.model.gpt import unwrap_model
from packsft.train import process_guard
from packsft.train.model_checkpoint import (  # noqa: F401 - CheckpointError, CheckpointWriteError: this module's API
    CheckpointError,
    CheckpointWriteError,
    check_partial_load,
    checkpoint_write_error,
    is_adapter_key,
    load_dist_checkpoint,
)
from packsft.train.optim import optimizer_params
from packsft.train.safe_checkpoint_read import is_refused_global, refusal_reason, refused

LATEST = "latest"
TRAIN_STATE = "train_state.json"
OLD_TRAIN_STATE = "train_state.pt"
"""The pickled train state of checkpoints written before ``train_state.json``; such checkpoints are refused."""
COMMON_STEP = "common_step"
LORA_BASE = "lora_base"
"""``train_state.json`` key of an adapters-only LoRA checkpoint: the base's ``{"path", "fingerprint"}``."""
INIT_FROM = "init_from"
"""``train_state.json`` key: the absolute path of ``checkpoint.init_from`` (export reads its ``hf_config.json``)."""
DIST_OPTIM_METADATA = {"distrib_optim_sharding_type": "dp_reshardable"}
"""``metadata`` of ``DistributedOptimizer.sharded_state_dict`` (Megatron-LM's default for ``torch_dist``)."""


def _load_plain(file: Path) -> Any:
    """``torch.load(file, weights_only=True)``: tensors and plain Python values only; nothing in the file runs.

    Raises:
        CheckpointError: the file holds other objects (a pickled class, function or ``__reduce__`` payload), is not a
            file, or is unreadable (truncated, damaged).
    """
    if not file.is_file():
        raise CheckpointError(f"{file}: not a file; the checkpoint is damaged: resume another one "
                              "(checkpoint.resume=<its iter_* folder>)")
    try:
        return torch.load(file, map_location="cpu", weights_only=True)
    except (RuntimeError, EOFError, OSError, UnicodeDecodeError) as err:  # a truncated zip ("PytorchStreamReader
        # failed ..."), an empty file, a folder in its place, flipped bytes
        reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise CheckpointError(f"{file}: unreadable ({reason}): the file is truncated or damaged; resume from another "
                              "checkpoint (checkpoint.resume=<its iter_* folder>)") from None
    except pickle.UnpicklingError as err:
        reason = refusal_reason(err)
        if not is_refused_global(err):         # not a refused class or function: bytes that are no pickle at all
            raise CheckpointError(f"{file}: unreadable (not a file torch.load reads: {reason}): the file is damaged; "
                                  "resume from another checkpoint (checkpoint.resume=<its iter_* folder>)") from None
        raise refused(file, "it holds objects other than tensors and plain values (torch.load(weights_only=True): "
                            f"{reason})") from None


class CheckpointDirError(ValueError):
    """``checkpoint.dir`` cannot take a checkpoint: not writable, or too little free space (found before step 1)."""


class CheckpointSpaceError(OSError):
    """A checkpoint write failed for lack of space (``errno.ENOSPC``/``EDQUOT``, possibly wrapped by a dependency)."""


def checkpoint_bytes_estimate(params, *, tp_size: int = 1, megatron_optimizer: bool = False) -> int:
    """Bytes one checkpoint takes: model weights plus fp32 Adam moments (and fp32 master weights for Megatron).

    ``params``: this rank's parameters. Under TP the local count is multiplied by ``tp_size`` (an upper bound:
    replicated norm weights are counted once per TP rank); data-parallel replicas are written once.
    """
    numel = sum(p.numel() for p in params) * tp_size
    weights = sum(p.numel() * p.element_size() for p in params) * tp_size
    return weights + numel * (12 if megatron_optimizer else 8)


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


def check_checkpoint_dir(ckpt_dir: str | Path, need_bytes: int) -> None:
    """Create ``ckpt_dir`` if needed, write and remove a probe file, and check its free space.

    Raises:
        CheckpointDirError: the folder cannot be created or written, or has less than ``need_bytes`` free (the
            message gives both sizes).
    """
    ckpt_dir = Path(ckpt_dir)
    reason = unwritable_dir_reason(ckpt_dir)            # a file in its path: e.g. logging.output_dir naming a file
    if reason is not None:
        raise CheckpointDirError(f"checkpoint.dir {ckpt_dir} is not writable ({reason}); set "
                                 "checkpoint.dir to a writable folder (checked before step 1)")
    free = shutil.disk_usage(ckpt_dir).free
    if free < need_bytes:
        raise CheckpointDirError(
            f"checkpoint.dir {ckpt_dir} has {_gib(free)} free but one checkpoint needs about {_gib(need_bytes)} "
            "(weights + optimizer state); free space or set checkpoint.dir to a larger disk "
            "(checkpoint.keep_last prunes old checkpoints)")


_NO_SPACE_TEXT = ("no space left on device", "disk quota exceeded", "unexpected pos")


def _out_of_space(err: BaseException) -> BaseException | None:
    """The error in ``err``'s chain (causes, contexts, torch DCP's per-rank ``failures``) that says the disk is full.

    ``unexpected pos`` is what torch's zip writer reports when a ``torch.save`` hits a full disk.
    """
    seen, todo = set(), [err]
    while todo:
        e = todo.pop()
        if id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            return e
        if any(t in str(e).lower() for t in _NO_SPACE_TEXT):
            return e
        failures = getattr(e, "failures", None)
        if isinstance(failures, dict):
            for value in failures.values():
                todo += [v for v in (value if isinstance(value, tuple) else (value,)) if isinstance(v, BaseException)]
        todo += [c for c in (e.__cause__, e.__context__) if c is not None]
        todo += [a for a in getattr(e, "args", ()) if isinstance(a, BaseException)]
    return None


def _is_megatron_optimizer(optimizer) -> bool:
    from megatron.core.optimizer import MegatronOptimizer

    return isinstance(optimizer, MegatronOptimizer)


def checkpoint_name(step: int) -> str:
    """Folder name of the checkpoint after optimizer step ``step``: ``iter_0000020``."""
    return f"iter_{step:07d}"


def _fill_missing_adam_state(optimizer: torch.optim.Optimizer) -> None:
    """Give every parameter AdamW state (zeros, step 0) so a load template has a tensor for each entry."""
    for p in optimizer_params(optimizer):
        if not optimizer.state[p]:
            optimizer.state[p] = {"step": torch.zeros((), dtype=torch.float32),
                                  "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
                                  "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format)}


def _fill_missing_megatron_adam_state(optimizer) -> None:
    """Give the torch Adam(W) inside a fresh Megatron optimizer zero state (``step`` 0 and moments).

    Without TransformerEngine/Apex, Megatron wraps ``torch.optim.AdamW``, whose state (and ``step``) appears at the
    first step; ``DistributedOptimizer.sharded_state_dict(is_loading=True)`` asserts one common ``step`` in it. TE's
    FusedAdam keeps ``step`` in its param groups and is left alone.
    """
    for chained in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(chained, "optimizer", None)
        if isinstance(inner, torch.optim.Adam | torch.optim.AdamW):
            _fill_missing_adam_state(inner)


def _restore_megatron_adam_step(optimizer) -> None:
    """Put each param group's saved ``step`` back into the per-parameter state of a torch Adam(W) inside Megatron.

    Megatron stores the (common) Adam step in ``param_groups[i]["step"]``; its torch-Adam load path (no TE/Apex)
    leaves the per-parameter ``step`` tensors at the template's 0, which would restart Adam's bias correction.
    """
    for chained in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(chained, "optimizer", None)
        if not isinstance(inner, torch.optim.Adam | torch.optim.AdamW):
            continue
        for group in inner.param_groups:
            if "step" in group:
                for p in group["params"]:
                    if "step" in inner.state[p]:
                        inner.state[p]["step"] = torch.tensor(float(group["step"]), dtype=torch.float32)


def _model_sharded_state_dict(model, adapters_only: bool = False) -> dict[str, Any]:
    """``GPTModel.sharded_state_dict()`` of ``model``, or ``{"chunk<i>": ...}`` for a list of model chunks (virtual
    pipeline stages; their tensors carry global layer names, so any pipeline layout reads them).
    ``adapters_only``: only the LoRA adapter tensors."""
    if isinstance(model, list):
        return {f"chunk{i}": _model_sharded_state_dict(m, adapters_only) for i, m in enumerate(model)}
    state = unwrap_model(model).sharded_state_dict()
    return {k: v for k, v in state.items() if is_adapter_key(k)} if adapters_only else state


def _load_model_state(model, state: dict[str, Any], adapters_only: bool = False) -> None:
    """``load_state_dict`` of what :func:`_model_sharded_state_dict` described, chunk by chunk for a list.

    Raises:
        RuntimeError: strict mismatch; with ``adapters_only``, an adapter tensor was not loaded.
    """
    if isinstance(model, list):
        for i, m in enumerate(model):
            _load_model_state(m, state[f"chunk{i}"], adapters_only)
        return
    result = unwrap_model(model).load_state_dict(state, strict=not adapters_only)
    if adapters_only:
        check_partial_load(result, adapters_only=True, what="LoRA adapter checkpoint")


def sharded_train_state(model: torch.nn.Module, optimizer, *, is_loading: bool = False,
                        adapters_only: bool = False) -> dict[str, Any]:
    """``{"model": sharded model state, "optimizer": optimizer state with sharding metadata}`` for dist_checkpointing.

    ``adapters_only``: ``"model"`` holds only the LoRA adapters (the optimizer holds nothing else either).

    torch AdamW: its per-parameter ``step`` tensors are equal, so they are stored once as ``state["common_step"]``
    (float). Megatron optimizer: ``optimizer.sharded_state_dict(model_state, is_loading, metadata=...)``.

    Raises:
        ValueError: (from Megatron) an optimizer parameter without a matching model sharded tensor.
    """
    if _is_megatron_optimizer(optimizer):
        if is_loading:
            _fill_missing_megatron_adam_state(optimizer)
        model_state = _model_sharded_state_dict(model, adapters_only)
        return {"model": model_state, "optimizer": optimizer.sharded_state_dict(
            model_state, is_loading=is_loading, metadata=DIST_OPTIM_METADATA)}
    _fill_missing_adam_state(optimizer)
    model_state = _model_sharded_state_dict(model, adapters_only)
    optim_state = optimizer.state_dict()
    id_map = get_param_id_to_sharded_param_map(model_state, optimizer_params(optimizer))
    step = float(next(iter(optim_state["state"].values()))["step"]) if optim_state["state"] else 0.0
    optim_state_to_sharding_state(optim_state, id_map, exclude_keys=("step",))
    optim_state["state"][COMMON_STEP] = step
    return {"model": model_state, "optimizer": optim_state}


def _rng_state() -> dict[str, Any]:
    """This process's RNG states as tensors and plain values (``torch.load(weights_only=True)``-safe).

    ``python``: ``random.getstate()`` as JSON text; ``numpy``: the MT19937 key (int64 [624]) plus
    ``[pos, has_gauss, cached_gaussian]``; ``torch`` (uint8), ``cuda`` and ``cuda_tracker`` (name -> uint8 tensor).
    """
    kind, key, pos, has_gauss, cached = np.random.get_state()
    if kind != "MT19937":
        raise ValueError(f"numpy's global RNG is {kind!r}, not MT19937; cannot checkpoint it")
    state = {"python": json.dumps(random.getstate()), "numpy_key": torch.from_numpy(key.astype(np.int64)),
             "numpy": [int(pos), int(has_gauss), float(cached)], "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        from megatron.core.tensor_parallel import get_cuda_rng_tracker

        state["cuda"] = torch.cuda.get_rng_state()
        state["cuda_tracker"] = get_cuda_rng_tracker().get_states()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    version, internal, gauss = json.loads(state["python"])
    random.setstate((version, tuple(internal), gauss))
    pos, has_gauss, cached = state["numpy"]
    np.random.set_state(("MT19937", state["numpy_key"].numpy().astype(np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if torch.cuda.is_available() and "cuda" in state:
        from megatron.core.tensor_parallel import get_cuda_rng_tracker

        torch.cuda.set_rng_state(state["cuda"])
        get_cuda_rng_tracker().set_states(state["cuda_tracker"])


def save_checkpoint(ckpt_dir: str | Path, step: int, model, optimizer, *, train_state: dict[str, Any],
                    loader_state: dict[str, Any] | None, dp_rank: int, write_loader_state: bool,
                    keep_last: int = 0, need_bytes: int | None = None, adapters_only: bool = False) -> Path:
    """Write the checkpoint of ``step`` atomically (see the module docstring); collective over all ranks.

    Args:
        ckpt_dir: checkpoint folder (created if missing; must be shared by all ranks).
        step: optimizer steps done.
        model: ``GPTModel`` or its DDP wrapper. optimizer: the AdamW of :func:`packsft.train.optim.build_optimizer`
            or the Megatron optimizer of :func:`packsft.train.optim.build_megatron_optimizer`.
        train_state: rank 0's ``train_state.json`` content (JSON values: step, counters, scheduler, config, layout).
        loader_state: ``packsft.data.loader.loader_state_dict`` of this rank's training loader.
        dp_rank: this rank's data-parallel index. write_loader_state: True on the one rank per DP index (TP=CP=0).
        keep_last: after publishing, keep only this many complete checkpoints (0: all; :func:`prune_checkpoints`).
        need_bytes: the size estimate quoted when the disk is full.
        adapters_only: store only the LoRA adapters of the model (``train_state`` then records ``lora_base``).

    Returns:
        The final ``iter_XXXXXXX`` path.

    Raises:
        CheckpointSpaceError: a write failed for lack of space; ``latest`` and earlier checkpoints are intact.
        CheckpointWriteError: a ``dist_checkpointing`` writer process failed or died (its error named); ditto.
    """
    ckpt_dir = Path(ckpt_dir)
    final, tmp = ckpt_dir / checkpoint_name(step), ckpt_dir / f"{checkpoint_name(step)}.tmp"
    rank = dist.get_rank()
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    dist.barrier()
    process_guard.start_checkpoint_writer()
    try:
        dist_checkpointing.save(sharded_train_state(model, optimizer, adapters_only=adapters_only), str(tmp))
        torch.save(_rng_state(), tmp / f"rng_rank{rank}.pt")
        if write_loader_state:
            torch.save(loader_state, tmp / f"dataloader_dp{dp_rank}.pt")
        if rank == 0:
            write_json_atomic(tmp / TRAIN_STATE, train_state)
    except BaseException as err:   # torch DCP's CheckpointException is a BaseException
        cause = None if isinstance(err, KeyboardInterrupt | SystemExit) else _out_of_space(err)
        if cause is not None:
            raise _space_error(ckpt_dir, tmp, need_bytes, cause) from err
        failed = checkpoint_write_error(err, tmp)
        if failed is None:
            raise
        raise failed from err
    dist.barrier()
    if rank == 0:
        _publish(ckpt_dir, tmp, final, keep_last)
    dist.barrier()
    return final


def _space_error(ckpt_dir: Path, tmp: Path, need_bytes: int | None, cause: BaseException) -> CheckpointSpaceError:
    latest = ckpt_dir / LATEST
    kept = f"{latest.read_text().strip()} (latest) is intact" if latest.is_file() else "no earlier checkpoint exists"
    need = f"one checkpoint needs about {_gib(need_bytes)}, " if need_bytes else ""
    try:
        free = f"{_gib(shutil.disk_usage(ckpt_dir).free)} free"
    except OSError:
        free = "free space unknown"
    reason = str(cause).strip().splitlines()[0][:200] if str(cause).strip() else type(cause).__name__
    return CheckpointSpaceError(
        errno.ENOSPC, f"no space left for checkpoint {tmp} ({reason}): {need}{free} on {ckpt_dir}; free space or "
        f"set checkpoint.dir to a larger disk (checkpoint.keep_last prunes old checkpoints), then resume; {kept}; "
        f"the partial {tmp.name} can be deleted")


def _publish(ckpt_dir: Path, tmp: Path, final: Path, keep_last: int = 0) -> None:
    """Rename ``tmp`` to ``final`` (replacing an older folder of that name), point ``latest`` at it, then prune."""
    replace_dir(tmp, final)
    with atomic_open(ckpt_dir / LATEST) as f:
        f.write(final.name + "\n")
    if keep_last:
        prune_checkpoints(ckpt_dir, keep_last)


_CHECKPOINT_NAME = re.compile(r"iter_(\d{7,})")
_DELETING = ".deleting"


def prune_checkpoints(ckpt_dir: str | Path, keep_last: int) -> list[Path]:
    """Delete all but the ``keep_last`` highest-step complete checkpoints up to the one ``latest`` names (never it;
    those past it, of a run a resume from an earlier checkpoint does not continue, are left to be replaced).

    Complete: an ``iter_XXXXXXX`` folder with ``train_state.json`` (``.tmp`` folders and other files are left alone).
    Each folder is first renamed to a hidden ``.iter_XXXXXXX.deleting`` (atomic), then removed, so no reader sees
    a half-deleted checkpoint; leftovers of a killed prune are removed by the next one.

    Returns:
        The checkpoints removed.
    """
    ckpt_dir = Path(ckpt_dir)
    latest = ckpt_dir / LATEST
    pinned = latest.read_text().strip() if latest.is_file() else None
    complete = complete_checkpoints(ckpt_dir)
    if pinned is not None and step_of(pinned) is not None:   # past `latest`: a run this one does not continue,
        complete = [p for p in complete if step_of(p) <= step_of(pinned)]  # replaced as its steps are saved again
    keep = {p.name for p in complete[-keep_last:]} | {pinned}
    removed = []
    for path in complete:
        if path.name not in keep:
            trash = ckpt_dir / f".{path.name}{_DELETING}"
            shutil.rmtree(trash, ignore_errors=True)
            os.replace(path, trash)
            removed.append(path)
    for trash in ckpt_dir.glob(f".iter_*{_DELETING}"):
        shutil.rmtree(trash, ignore_errors=True)
    return removed


def remove_partial_checkpoints(ckpt_dir: str | Path) -> list[Path]:
    """Delete the ``iter_XXXXXXX.tmp`` folders of saves that were killed (never published: ``latest`` and every
    complete checkpoint are untouched); call on one rank, before any save of this run.

    Returns:
        The folders removed.
    """
    ckpt_dir = Path(ckpt_dir)
    if not ckpt_dir.is_dir():
        return []
    partial = sorted(p for p in ckpt_dir.iterdir() if p.is_dir() and p.suffix == ".tmp"
                     and _CHECKPOINT_NAME.fullmatch(p.stem))
    for path in partial:
        shutil.rmtree(path, ignore_errors=True)
    return partial


def complete_checkpoints(ckpt_dir: str | Path) -> list[Path]:
    """The published ``iter_XXXXXXX`` folders of ``ckpt_dir`` that hold ``train_state.json``, lowest step first."""
    ckpt_dir = Path(ckpt_dir)
    if not ckpt_dir.is_dir():
        return []
    return sorted((p for p in ckpt_dir.iterdir() if step_of(p) is not None and (p / TRAIN_STATE).is_file()),
                  key=step_of)


def find_resume_checkpoint(ckpt_dir: str | Path, resume: str) -> Path | None:
    """Resolve ``checkpoint.resume``: ``none`` -> None; else a path, or for ``auto`` the checkpoint ``latest`` names
    in ``ckpt_dir`` (without ``latest``: the highest-step complete checkpoint, as a save killed between publishing
    its folder and writing ``latest`` leaves; None when there is none).

    Raises:
        FileNotFoundError: ``latest`` names a missing folder, or an explicit path has no ``train_state.json``.
        CheckpointError: ``latest`` is not a file naming an ``iter_XXXXXXX`` folder, or the checkpoint has the old
            pickled ``train_state.pt`` (:func:`check_checkpoint_format`).
    """
    if resume == "none":
        return None
    if resume == "auto":
        latest = Path(ckpt_dir) / LATEST
        if not (latest.exists() or latest.is_symlink()):
            complete = complete_checkpoints(ckpt_dir)
            return complete[-1] if complete else None
        try:
            name = latest.read_text(encoding="utf-8").strip() if latest.is_file() else None
            shown = f"holds {name!r}" if name is not None else "is not a file"
        except (OSError, UnicodeDecodeError) as err:
            name, shown = None, f"cannot be read as text ({err})"
        if name is None or not _CHECKPOINT_NAME.fullmatch(name):
            raise CheckpointError(f"{latest} should be a file naming the newest checkpoint of {ckpt_dir} (e.g. "
                                  f"iter_0000100), but {shown}; "
                                  "resume a checkpoint with checkpoint.resume=<path>, or remove it to resume the "
                                  "newest complete checkpoint")
        path = Path(ckpt_dir) / name
    else:
        path = Path(resume)
    check_checkpoint_format(path)
    if not (path / TRAIN_STATE).is_file():
        raise FileNotFoundError(f"checkpoint {path} (checkpoint.resume={resume!r}) is missing or incomplete: "
                                f"no {TRAIN_STATE}")
    return path


def step_of(path: str | Path) -> int | None:
    """The step of a checkpoint folder named ``iter_XXXXXXX``, else None."""
    m = _CHECKPOINT_NAME.fullmatch(Path(path).name)
    return int(m.group(1)) if m else None


def check_fresh_start(resume: str, output_dir: str | Path, ckpt_dir: str | Path) -> None:
    """With ``checkpoint.resume=none``, refuse a run folder that holds an earlier run.

    An earlier run: a ``"kind": "train"`` record in ``<output_dir>/metrics.jsonl``, ``<ckpt_dir>/latest``, or a
    complete checkpoint in ``<ckpt_dir>``.
    Starting over there would append a second run to ``metrics.jsonl`` (and its plot) and mix checkpoints.

    Raises:
        CheckpointDirError: naming what was found and the ways out.
    """
    if resume != "none":
        return
    metrics, latest = Path(output_dir) / "metrics.jsonl", Path(ckpt_dir) / LATEST
    found = []
    if metrics.is_file():
        with open(metrics, encoding="utf-8", errors="replace") as f:
            if any('"kind": "train"' in line for line in f):
                found.append(f"{metrics} has training records")
    if latest.is_file():
        found.append(f"{latest} names {latest.read_text(encoding='utf-8', errors='replace').strip()!r}")
    elif complete := complete_checkpoints(ckpt_dir):
        found.append(f"{ckpt_dir} holds {', '.join(p.name for p in complete)}")
    if found:
        raise CheckpointDirError(
            f"checkpoint.resume=none but the run folder holds an earlier run ({'; '.join(found)}); starting over "
            "there would mix two runs in metrics.jsonl and the checkpoints. Set logging.output_dir (and "
            "checkpoint.dir) to a new folder, remove the old run, or resume it (checkpoint.resume=auto)")


def check_checkpoint_format(path: str | Path) -> None:
    """Refuse a checkpoint of the old format (a pickled ``train_state.pt``, no ``train_state.json``).

    Raises:
        CheckpointError: saying why (pickled files can run code when loaded) and what to do instead.
    """
    path = Path(path)
    if (path / OLD_TRAIN_STATE).is_file() and not (path / TRAIN_STATE).is_file():
        raise CheckpointError(
            f"checkpoint {path} has the old format (a pickled {OLD_TRAIN_STATE}, RNG and loader files that can run "
            f"code when loaded); packsft no longer reads it. Start over (checkpoint.resume=none in a new "
            "logging.output_dir), or keep its weights: tools/convert_checkpoint.py export --megatron "
            f"{path} --config <run>/config.yaml, then import that folder and train with checkpoint.init_from")


def load_model_and_optimizer(path: str | Path, model, optimizer, *, adapters_only: bool = False) -> None:
    """Load model weights and optimizer state from ``path`` into this rank's shards.

    Any saved TP/DP layout for the torch backend; any DP size for the Megatron optimizer (same TP/CP).
    ``adapters_only``: an adapters-only LoRA checkpoint; the base weights must already be loaded.

    Raises:
        CheckpointError: a damaged ``common.pt`` or ``metadata.json``.
        megatron ``CheckpointingException``: a tensor of the model is missing from the checkpoint or has another
            global shape (a different architecture).
    """
    loaded = load_dist_checkpoint(sharded_train_state(model, optimizer, is_loading=True, adapters_only=adapters_only),
                                  path)
    _load_model_state(model, loaded["model"], adapters_only)
    if _is_megatron_optimizer(optimizer):
        with torch.no_grad():       # fp32 distributed-optimizer master shards are views of the (leaf) parameters
            optimizer.load_state_dict(loaded["optimizer"])
        _restore_megatron_adam_step(optimizer)
        return
    optim_state = loaded["optimizer"]
    step = optim_state["state"].pop(COMMON_STEP)
    for param_state in optim_state["state"].values():
        param_state["step"] = torch.tensor(float(step), dtype=torch.float32)
    optimizer.load_state_dict(optim_state)


def load_train_state(path: str | Path) -> dict[str, Any]:
    """``train_state.json`` of a checkpoint (``state`` counters, ``scheduler``, ``config`` YAML text, ``layout``).

    Raises:
        CheckpointError: an old-format checkpoint, or the file is not a JSON object.
    """
    check_checkpoint_format(path)
    file = Path(path) / TRAIN_STATE
    try:
        saved = json.loads(file.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise CheckpointError(f"{file}: not valid JSON ({err}); the checkpoint is damaged") from None
    if not isinstance(saved, dict) or not isinstance(saved.get("state"), dict):
        raise CheckpointError(f"{file}: not a packsft train state (a JSON object with a 'state' object)")
    return saved


def check_resume_state(saved: dict[str, Any], path: str | Path, counters: tuple[str, ...]) -> None:
    """Refuse a train state (:func:`load_train_state`) a resume cannot continue from: ``state.step`` or
    ``state.consumed_samples`` missing, one of ``counters`` in ``state`` or ``scheduler.last_epoch`` not an integer
    >= 0, a step other than the ``iter_XXXXXXX`` folder's, or a ``layout`` that is not an object.

    Raises:
        CheckpointError: naming the file and the field.
    """
    file = Path(path) / TRAIN_STATE
    scheduler = saved.get("scheduler")
    values = {f"state.{k}": saved["state"][k] for k in counters if k in saved["state"]}
    wrong = [f"state.{k} is missing" for k in ("step", "consumed_samples") if k not in saved["state"]]
    if isinstance(scheduler, dict):
        values["scheduler.last_epoch"] = scheduler.get("last_epoch")
    else:
        wrong.append("scheduler is missing" if scheduler is None else f"scheduler is {json.dumps(scheduler)}")
    wrong += [f"{k} is {json.dumps(v)}, not an integer >= 0" for k, v in values.items()
              if isinstance(v, bool) or not isinstance(v, int) or v < 0]
    step = step_of(path)
    if step is not None and saved["state"].get("step") not in (None, step) and not wrong:
        wrong.append(f"state.step is {saved['state']['step']} in the checkpoint of step {step}")
    if not isinstance(saved.get("layout", {}), dict):
        wrong.append(f"layout is {json.dumps(saved['layout'])}, not an object")
    if wrong:
        raise CheckpointError(f"{file}: not a packsft train state ({'; '.join(wrong)}); the checkpoint is damaged: "
                              "resume an earlier one with checkpoint.resume=<path>")


def load_loader_state(path: str | Path, dp_rank: int) -> dict[str, Any]:
    """The loader state saved for data-parallel rank ``dp_rank``.

    Raises:
        FileNotFoundError: no ``dataloader_dp{dp_rank}.pt`` (the checkpoint had fewer data-parallel ranks); the
            message says to set ``checkpoint.restore_data_order=false``.
        CheckpointError: the file holds more than tensors and plain values.
    """
    file = Path(path) / f"dataloader_dp{dp_rank}.pt"
    if not file.exists():
        raise FileNotFoundError(f"{file} does not exist: the checkpoint was written with another data-parallel size; "
                                "resume with checkpoint.restore_data_order=false to restart the data order")
    return _load_plain(file)


def load_rng_state(path: str | Path, rank: int, required: bool = False) -> bool:
    """Restore this rank's RNG states if ``rng_rank{rank}.pt`` exists; return whether it did.

    Args:
        required: the checkpoint was saved by as many ranks as this run has, so the file must be there (without
            it the resume would silently not be exact: dropout masks, ...).

    Raises:
        CheckpointError: the file holds more than tensors and plain values, lacks a state, is unreadable, or is
            missing while ``required``.
    """
    file = Path(path) / f"rng_rank{rank}.pt"
    if not file.exists():
        if required:
            raise CheckpointError(f"{file}: missing, though the checkpoint was saved by as many ranks as this run "
                                  "has: the folder is incomplete; resume from another checkpoint "
                                  "(checkpoint.resume=<its iter_* folder>)")
        return False
    state = _load_plain(file)
    try:
        _set_rng_state(state)
    except (KeyError, TypeError, ValueError, AttributeError) as err:
        raise CheckpointError(f"{file}: not a packsft RNG state ({type(err).__name__}: {err})") from None
    return True
