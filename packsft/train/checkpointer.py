"""The run's checkpoints as the training loop sees them: what to start from, when to save, and the save.

:class:`Checkpointer` resumes the newest checkpoint (``checkpoint.resume``) or loads ``checkpoint.init_from``,
checks the checkpoint folder before step 1, answers :meth:`~Checkpointer.should_save` after each step and writes a
checkpoint of the model chunks, optimizer, schedule, loader and :class:`TrainState` (files and formats:
:mod:`packsft.train.checkpoint`, :mod:`packsft.train.checkpoint_files`).
"""

from __future__ import annotations

import contextlib
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from packsft.train import checkpoint as ckpt
from packsft.train import checkpoint_files as ckpt_files
from packsft.train.compat import (
    check_recorded_architecture,
    check_recorded_optimizer,
    check_recorded_vision,
    recorded_architecture,
)
from packsft.train.config import Config, config_to_yaml
from packsft.train.data import load_train_loader_state, train_loader_state
from packsft.train.model_checkpoint import base_identity, check_lora_base, load_megatron_checkpoint
from packsft.train.optim import apply_optimizer_settings, set_schedule_step

RESUME_FIX = ("a resumed run keeps the architecture it was trained with: set {key}={value}; for another "
              "architecture start a new run in a new logging.output_dir, with a checkpoint.dir that does not hold this "
              "checkpoint (the default is inside logging.output_dir) and no checkpoint.resume=<path>")


@dataclass
class TrainState:
    """Counters saved in checkpoints: optimizer steps done, rows consumed and tokens trained (global), and in a
    mixture the trained tokens of each source by name.

    Consumed tokens are not stored: every row is ``max_seq_len`` tokens, so they are ``consumed_samples * L``.
    """

    step: int = 0
    consumed_samples: int = 0
    trained_tokens: int = 0
    skipped_steps: int = 0
    source_trained_tokens: dict[str, int] = field(default_factory=dict)

    @classmethod
    def from_dict(cls, saved: dict[str, Any]) -> TrainState:
        """From a checkpoint's dict (checked by ``check_resume_state``); fields of older versions
        (``consumed_tokens``) are ignored, missing ones start at 0."""
        return cls(**{f.name: saved[f.name] for f in fields(cls) if f.name in saved})


@contextlib.contextmanager
def naming(checkpoint):
    """torch's ``CheckpointException`` (a ``BaseException``) raised while reading ``checkpoint`` gets its folder as
    ``err.checkpoint``, which ``tools/train.py`` names in its error line."""
    try:
        yield
    except CheckpointException as err:
        err.checkpoint = str(checkpoint)
        raise


class Checkpointer:
    """Resume, ``init_from`` and saves of one run, for the trainer's model chunks, optimizer, schedule and loader.

    Attributes:
        resumed_from: the checkpoint folder resumed (str), or None.
        initialized_from: ``checkpoint.init_from`` when its weights started the run, or None.
        lora_base: ``{"path", "fingerprint"}`` of the base an adapters-only LoRA run trains on, or None.
        last_checkpoint: the folder of the last save, or None.
    """

    def __init__(self, cfg: Config, ctx, model, gpts: list, optimizer, scheduler, train_loader) -> None:
        self.cfg, self.ctx = cfg, ctx
        self.model, self.gpts, self.optimizer, self.scheduler, self.loader = (model, gpts, optimizer, scheduler,
                                                                              train_loader)
        self.resumed_from: str | None = None
        self.initialized_from: str | None = None
        self.lora_base: dict[str, str] | None = None
        self.last_checkpoint: Path | None = None
        self._need_bytes: int | None = None

    def should_save(self, step: int) -> bool:
        """Whether ``checkpoint.save_interval`` falls on ``step``."""
        interval = self.cfg.checkpoint.save_interval
        return bool(interval) and step % interval == 0

    def start(self) -> TrainState:
        """The state to start from: the resumed checkpoint's (model, optimizer, schedule, loader and RNG loaded), or
        a fresh one (with ``checkpoint.init_from``'s weights loaded); then the checkpoint folder checked for the saves
        to come (:meth:`check_dir`)."""
        state = self._resume()
        self._need_bytes = self.check_dir()
        return state

    def _resume(self) -> TrainState:
        cfg, ctx = self.cfg, self.ctx
        path = ckpt_files.find_resume_checkpoint(cfg.checkpoint_dir, cfg.checkpoint.resume)
        init_from = cfg.checkpoint.init_from
        if path is None:
            if init_from:   # fresh optimizer; the model fields were checked by load_config
                if cfg.lora.enabled:        # checkpoints will hold the adapters and this identity
                    self.lora_base = base_identity(init_from)
                self.load_base(init_from)
                self.initialized_from = init_from
            return TrainState()
        saved = ckpt_files.load_train_state(path)
        ckpt_files.check_resume_state(saved, path, tuple(f.name for f in fields(TrainState)
                                                             if f.name != "source_trained_tokens"))
        latest = path.parent / ckpt_files.LATEST
        if cfg.checkpoint.resume == "auto" and not latest.is_file() and ctx.rank == 0:
            print(f"note: {path.parent} has no {latest.name} (a save was stopped before writing it); resuming its "
                  f"newest complete checkpoint, {path.name}", flush=True)
        newer = [p.name for p in ckpt_files.complete_checkpoints(cfg.checkpoint_dir)
                 if ckpt_files.step_of(p) > saved["state"]["step"]]
        if newer and ctx.rank == 0:
            print(f"note: {cfg.checkpoint_dir} holds checkpoints past step {saved['state']['step']} ("
                  f"{', '.join(newer)}), which this run does not continue: each is replaced when this run saves its "
                  "step", flush=True)
        recorded_sections = recorded_architecture(saved, path)
        check_recorded_architecture(cfg.model, cfg.lora if cfg.lora.enabled else None, recorded_sections, path,
                                    fix=RESUME_FIX)
        check_recorded_vision(cfg.vision, recorded_sections, path, fix=RESUME_FIX)
        check_recorded_optimizer(cfg.optimizer, recorded_sections, path, cfg.parallel)
        recorded = saved.get(ckpt_files.LORA_BASE)
        if recorded is not None:    # a LoRA run's (lora.enabled was compared above)
            base_dir = check_lora_base(recorded, init_from, path)
            self.load_base(base_dir)
            self.lora_base = {"path": str(Path(base_dir).resolve()), "fingerprint": recorded["fingerprint"]}
        with naming(path):
            ckpt.load_model_and_optimizer(path, self.model, self.optimizer, adapters_only=recorded is not None)
        state = TrainState.from_dict(saved["state"])
        for section, key, then in (   # settings a resume may change, and what changes with them
                ("train", "global_batch_size", f"the data continues after the {state.consumed_samples} rows consumed, "
                 f"{cfg.train.global_batch_size} a step from now on"),
                ("loss", "normalization", f"the logged loss and the weight of each token in the gradients change "
                 f"from step {state.step + 1} on")):
            was, now = recorded_sections[section].get(key), getattr(getattr(cfg, section), key)
            if was is not None and was != now and ctx.rank == 0:
                print(f"note: {section}.{key} is {now}, checkpoint {path} was trained with {was}: {then}", flush=True)
        set_schedule_step(self.scheduler, saved["scheduler"]["last_epoch"])
        apply_optimizer_settings(self.optimizer, cfg.optimizer)    # the config's, as lr: not the saved
        def own_files() -> None:    # this rank's files: its loader state and RNG states
            if cfg.checkpoint.restore_data_order:
                # a rank the checkpoint had not (a larger DP size) reads rank 0's: a global order's state at a step
                # boundary is the same on every rank (load_loader_state_dict refuses a per-rank one)
                own = (path / f"dataloader_dp{ctx.dp_rank}.pt").exists()
                load_train_loader_state(self.loader, ckpt.load_loader_state(path, ctx.dp_rank if own else 0))
            same_ranks = (saved.get("layout") or {}).get("world_size") == ctx.world_size
            ckpt.load_rng_state(path, ctx.rank, required=same_ranks)

        read_on_every_rank(own_files, ctx, path)
        if not cfg.checkpoint.restore_data_order and ctx.rank == 0:
            print(f"note: checkpoint.restore_data_order=false: the data order starts again from its first rows "
                  f"(epoch 0), which the {state.consumed_samples} rows consumed up to step {state.step} "
                  "may include: they are trained again", flush=True)
        self.resumed_from = str(path)
        return state

    def load_base(self, base_dir) -> None:
        """Load an imported model folder into every chunk (LoRA: all but the adapters); refresh fp32 masters."""
        with naming(base_dir):          # global layer names: each stage's chunks load their layers, in one load
            load_megatron_checkpoint(self.gpts, base_dir, base_only=self.cfg.lora.enabled)
        self.optimizer.reload_model_params()     # fp32 master weights are copies made before the load

    def check_dir(self) -> int | None:
        """Before step 1: ``checkpoint.dir`` writable with room for one checkpoint; return the size estimate (None
        when the run saves nothing)."""
        c = self.cfg.checkpoint
        if not (c.save_interval or c.save_at_end or self.cfg.train.save_on_sigterm):
            return None
        if self.ctx.rank == 0:       # no save of this run has started: every .tmp is a killed save's
            for partial in ckpt_files.remove_partial_checkpoints(self.cfg.checkpoint_dir):
                print(f"removed {partial}: a checkpoint save that was interrupted (never published)", flush=True)
        saved = [p for n, p in self.gpts[0].named_parameters() if self.lora_base is None or ".lora_" in n]
        need = ckpt.checkpoint_bytes_estimate(saved, tp_size=self.ctx.tensor_model_parallel_size)
        ckpt_files.check_checkpoint_dir(self.cfg.checkpoint_dir, need)
        return need

    def save(self, state: TrainState, layout: dict[str, int | None]) -> Path:
        """Write the checkpoint of ``state.step`` (collective) and return its folder."""
        ctx = self.ctx
        train_state = {"state": asdict(state), "scheduler": self.scheduler.state_dict(),
                       "config": config_to_yaml(self.cfg), "layout": layout}
        if self.lora_base is not None:
            train_state[ckpt_files.LORA_BASE] = self.lora_base
        if self.cfg.checkpoint.init_from:   # absolute: the config's path may be relative to the training folder
            train_state[ckpt_files.INIT_FROM] = str(Path(self.cfg.checkpoint.init_from).resolve())
        first_of_dp = dist.get_rank(ctx.tp_group) == 0 and ctx.cp_rank == 0 and ctx.pp_rank == 0
        self.last_checkpoint = ckpt.save_checkpoint(
            self.cfg.checkpoint_dir, state.step, self.model, self.optimizer, train_state=train_state,
            loader_state=train_loader_state(self.loader), dp_rank=ctx.dp_rank, write_loader_state=first_of_dp,
            keep_last=self.cfg.checkpoint.keep_last, need_bytes=self._need_bytes,
            adapters_only=self.lora_base is not None)
        return self.last_checkpoint


def read_on_every_rank(read, ctx, path: Path) -> None:
    """Run ``read`` (this rank's own files of checkpoint ``path``; ``ctx``: the ``DistributedContext``), then agree:
    when it fails on any rank, every rank stops (an all-reduce of the failure), the failing ones with their own error.

    Raises:
        ValueError, OSError: this rank's ``read`` failed (a refused or damaged file); or another rank's did,
            named by its rank.
    """
    error = None
    try:
        read()
    except (ValueError, OSError) as err:
        error = err
    failed = torch.tensor([ctx.rank + 1 if error is not None else 0], device=ctx.device)
    if ctx.world_size > 1:
        dist.all_reduce(failed, op=dist.ReduceOp.MAX)
    if error is not None:
        raise error
    if failed.item():
        raise ValueError(f"checkpoint {path}: rank {int(failed.item()) - 1} could not read its files (its error "
                         "line names the file); no rank resumes")
