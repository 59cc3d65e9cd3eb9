"""Checkpoints: Megatron ``dist_checkpointing`` for model + AdamW state, small files for everything else.

Folder layout, atomic publishing, ``latest``, retention and the free-space check: :mod:`packsft.train.checkpoint_files`
(no torch). This module writes and reads the tensors: the ``dist_checkpointing`` shards of model and optimizer, the
loader state per data-parallel rank and the RNG states per rank (:func:`save_checkpoint`,
:func:`load_model_and_optimizer`, :func:`load_loader_state`, :func:`load_rng_state`).

LoRA runs started from a base folder (``lora.enabled`` with ``checkpoint.init_from``): ``"model"`` holds only the
adapter tensors (``adapters_only``) and ``train_state.json`` has ``"lora_base": {"path", "fingerprint"}``
(:func:`packsft.train.model_checkpoint.base_identity`); resume and export load that base first, after checking its
fingerprint (:func:`packsft.train.model_checkpoint.check_lora_base`). A LoRA run without ``init_from`` (random base)
stores the whole model, the base's only copy.

Space: :func:`checkpoint_bytes_estimate` is what ``checkpoint_files.check_checkpoint_dir`` needs free before step 1;
a save that fails for lack of space raises ``checkpoint_files.CheckpointSpaceError``.

Resharding: model tensors are stored with their global shapes (``GPTModel.sharded_state_dict``) and the optimizer
part is Megatron's own ``MegatronOptimizer.sharded_state_dict(model_sharded_state_dict)`` (as Megatron-LM saves it),
so TP and DP sizes may change between save and resume; the distributed optimizer uses its ``dp_reshardable`` format
(:data:`DIST_OPTIM_METADATA`: each DP rank writes its own shard, no gather), so the DP size may change but not TP
(Megatron's ``fully_reshardable`` format would allow it). ``torch.distributed.checkpoint`` on a plain
``state_dict`` is not used: it
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

import json
import pickle
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing

from packsft.io import write_json_atomic
from packsft.model.gpt import unwrap_model
from packsft.train import process_guard
from packsft.train.checkpoint_files import (
    TRAIN_STATE,
    CheckpointError,
    checkpoint_name,
    publish_checkpoint,
    space_error,
)
from packsft.train.model_checkpoint import (  # noqa: F401 - CheckpointWriteError: this module's API
    CheckpointWriteError,
    check_partial_load,
    is_adapter_key,
    load_dist_checkpoint,
    naming_write_errors,
)
from packsft.train.safe_checkpoint_read import refusal_reason, refusing_code

DIST_OPTIM_METADATA = {"distrib_optim_sharding_type": "dp_reshardable"}
"""``metadata`` of ``DistributedOptimizer.sharded_state_dict`` (Megatron-LM's default for ``torch_dist``)."""


def _load_plain(file: Path) -> Any:
    """``torch.load(file, weights_only=True)``: tensors and plain Python values only; nothing in the file runs.

    Raises:
        CheckpointError: the file holds other objects (a pickled class, function or ``__reduce__`` payload), is not a
            file, or is unreadable (truncated, damaged, no pickle at all).
    """
    if not file.is_file():
        raise CheckpointError(f"{file}: not a file; the checkpoint is damaged: resume another one "
                              "(checkpoint.resume=<its iter_* folder>)")
    try:
        with refusing_code(file):
            return torch.load(file, map_location="cpu", weights_only=True)
    except (RuntimeError, EOFError, OSError, UnicodeDecodeError, pickle.UnpicklingError) as err:  # a truncated zip
        # ("PytorchStreamReader failed ..."), an empty file, flipped bytes, bytes that are no pickle
        raise CheckpointError(f"{file}: unreadable (not a file torch.load reads: {refusal_reason(err)}): the file is "
                              "truncated or damaged; resume from another checkpoint (checkpoint.resume=<its iter_* "
                              "folder>)") from None


def checkpoint_bytes_estimate(params, *, tp_size: int = 1) -> int:
    """Bytes one checkpoint takes: model weights plus fp32 Adam moments, and fp32 master weights of non-fp32 ones.

    ``params``: this rank's parameters. Under TP the local count is multiplied by ``tp_size`` (an upper bound:
    replicated norm weights are counted once per TP rank); data-parallel replicas are written once.
    """
    per_param = sum(p.numel() * (p.element_size() + 8 + (4 if p.dtype != torch.float32 else 0)) for p in params)
    return per_param * tp_size


def _fill_missing_megatron_adam_state(optimizer) -> None:
    """Give the torch Adam(W) inside a fresh Megatron optimizer zero state (``step`` 0 and moments).

    Without TransformerEngine/Apex, Megatron wraps ``torch.optim.AdamW``, whose state (and ``step``) appears at the
    first step; ``DistributedOptimizer.sharded_state_dict(is_loading=True)`` asserts one common ``step`` in it. TE's
    FusedAdam keeps ``step`` in its param groups and is left alone.
    """
    for chained in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(chained, "optimizer", None)
        if isinstance(inner, torch.optim.Adam | torch.optim.AdamW):
            for p in [p for group in inner.param_groups for p in group["params"]]:
                if not inner.state[p]:
                    inner.state[p] = {"step": torch.zeros((), dtype=torch.float32),
                                      "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
                                      "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format)}


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

    The optimizer part: ``optimizer.sharded_state_dict(model_state, is_loading, metadata=...)``.

    Raises:
        ValueError: (from Megatron) an optimizer parameter without a matching model sharded tensor.
    """
    if is_loading:
        _fill_missing_megatron_adam_state(optimizer)
    model_state = _model_sharded_state_dict(model, adapters_only)
    return {"model": model_state, "optimizer": optimizer.sharded_state_dict(
        model_state, is_loading=is_loading, metadata=DIST_OPTIM_METADATA)}


def _rng_state() -> dict[str, Any]:
    """This process's RNG states as tensors and plain values (``torch.load(weights_only=True)``-safe).

    ``python``: ``random.getstate()`` as JSON text; ``numpy``: the MT19937 key (int64 [624]) plus
    ``[pos, has_gauss, cached_gaussian]``; ``torch`` (uint8), ``cuda`` and ``cuda_tracker`` (name -> uint8 tensor).
    """
    _, key, pos, has_gauss, cached = np.random.get_state()     # the legacy global RNG: always MT19937
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
        model: Megatron DDP-wrapped ``GPTModel`` (or a list of chunks). optimizer: the Megatron optimizer of
            :func:`packsft.train.optim.build_megatron_optimizer`.
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
    with naming_write_errors(tmp, lambda err: space_error(err, ckpt_dir, tmp, need_bytes)):
        dist_checkpointing.save(sharded_train_state(model, optimizer, adapters_only=adapters_only), str(tmp))
        torch.save(_rng_state(), tmp / f"rng_rank{rank}.pt")
        if write_loader_state:
            torch.save(loader_state, tmp / f"dataloader_dp{dp_rank}.pt")
        if rank == 0:
            write_json_atomic(tmp / TRAIN_STATE, train_state)
    dist.barrier()
    if rank == 0:
        publish_checkpoint(ckpt_dir, tmp, final, keep_last)
    dist.barrier()
    return final


def load_model_and_optimizer(path: str | Path, model, optimizer, *, adapters_only: bool = False) -> None:
    """Load model weights and optimizer state from ``path`` into this rank's shards.

    Any saved DP size (same TP/CP with the distributed optimizer; any TP/DP without it).
    ``adapters_only``: an adapters-only LoRA checkpoint; the base weights must already be loaded.

    Raises:
        CheckpointError: a damaged ``common.pt`` or ``metadata.json``.
        megatron ``CheckpointingException``: a tensor of the model is missing from the checkpoint or has another
            global shape (a different architecture).
    """
    loaded = load_dist_checkpoint(sharded_train_state(model, optimizer, is_loading=True, adapters_only=adapters_only),
                                  path)
    _load_model_state(model, loaded["model"], adapters_only)
    with torch.no_grad():       # fp32 distributed-optimizer master shards are views of the (leaf) parameters
        optimizer.load_state_dict(loaded["optimizer"])
    _restore_megatron_adam_step(optimizer)


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
