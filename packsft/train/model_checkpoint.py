"""Model-only Megatron checkpoints: written by ``tools/convert_checkpoint.py import``, read by ``init_from``.

Layout of ``ckpt_dir``::

    .metadata, __*_*.distcp     # torch_dist shards of {"model": model.sharded_state_dict()} (dist_checkpointing)
    common.pt, metadata.json    # dist_checkpointing common state
    model_config.json           # ModelConfig fields (packsft.model.config.read_model_config)
    hf_config.json              # optional: the source HF config (packsft.model.hf_io.read_hf_config)

The weights sit under ``"model"`` with their global shapes, as in the trainer's checkpoints
(:mod:`packsft.train.checkpoint`), so :func:`load_megatron_checkpoint` reads either folder at any TP size.
Atomicity: all ranks write into ``.<name>.tmp`` beside ``ckpt_dir``; rank 0 then publishes it
(``packsft.io.replace_dir``).
"""

from __future__ import annotations

import json
import shutil
from dataclasses import asdict
from pathlib import Path

from packsft.io import replace_dir
from packsft.model.config import MODEL_CONFIG_FILE, ModelConfig
from packsft.model.hf_io import HF_CONFIG_FILE
from packsft.process_groups import barrier, global_rank
from packsft.train import process_guard


def save_megatron_checkpoint(model, cfg: ModelConfig, ckpt_dir: str | Path, hf_config=None) -> Path:
    """Write ``{"model": model.sharded_state_dict()}`` with ``dist_checkpointing`` (``torch_dist``), atomically.

    Collective over all ranks. Layout of ``ckpt_dir``: the ``dist_checkpointing`` files (resharding
    to any TP size on load), ``model_config.json`` (``ModelConfig`` fields) and, when given,
    ``hf_config.json`` (the original HF config, reused on export). On CPU it needs the cuda shim of
    ``packsft.model.cpu_compat`` and the calling script needs an ``if __name__ == "__main__"`` guard.
    """
    from megatron.core import dist_checkpointing

    ckpt_dir = Path(ckpt_dir)
    tmp = ckpt_dir.with_name(f".{ckpt_dir.name}.tmp")
    rank = global_rank()
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    barrier()
    process_guard.start_checkpoint_writer()     # its helper process dies with this one
    dist_checkpointing.save({"model": model.sharded_state_dict()}, str(tmp))
    barrier()
    if rank == 0:
        (tmp / MODEL_CONFIG_FILE).write_text(json.dumps(asdict(cfg), indent=2) + "\n")
        if hf_config is not None:
            base = hf_config.to_dict() if hasattr(hf_config, "to_dict") else dict(hf_config)
            (tmp / HF_CONFIG_FILE).write_text(json.dumps(base, indent=2, default=str) + "\n")
        replace_dir(tmp, ckpt_dir)
    barrier()
    return ckpt_dir


def load_megatron_checkpoint(model, ckpt_dir: str | Path, *, base_only: bool = False) -> None:
    """Load ``save_megatron_checkpoint``'s ``"model"`` entry into ``model`` (any TP size; strict).

    ``base_only``: ``model`` carries LoRA adapters (``packsft.model.lora``) that the checkpoint (an imported base
    model) lacks; every other tensor is loaded strictly and the adapters keep their initial values.

    Raises:
        RuntimeError: (``load_state_dict``) a model tensor other than an adapter was not loaded.
    """
    from megatron.core import dist_checkpointing

    sharded = model.sharded_state_dict()
    if base_only:
        sharded = {k: v for k, v in sharded.items() if ".lora_" not in k}
    loaded = dist_checkpointing.load({"model": sharded}, str(ckpt_dir))
    result = model.load_state_dict(loaded["model"], strict=not base_only)
    missing = [k for k in result.missing_keys if ".lora_" not in k] if base_only else []
    if missing or (base_only and result.unexpected_keys):
        raise RuntimeError(f"{ckpt_dir}: base checkpoint does not match the model: missing {missing}, "
                           f"unexpected {list(result.unexpected_keys)}")
