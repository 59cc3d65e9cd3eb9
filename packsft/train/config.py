"""Typed training configuration: dataclass schema + YAML file + dotted CLI overrides (OmegaConf).

``load_config("configs/tiny_cpu.yaml", ["optimizer.lr=1e-3", "train.train_steps=50"])`` merges, in order, the
schema defaults, the YAML file and the overrides, then builds the dataclasses with ``OmegaConf.to_object``, which
runs every section's ``__post_init__`` validation (``ModelConfig`` and ``DataLoaderConfig`` included) and finally the
cross-section checks of :class:`Config`. A misspelt key, a wrong type or an invalid value raises ``ValueError``
naming the dotted key and the value. Checks that need the world size (``global_batch_size`` vs data-parallel size)
are in :func:`check_parallel_layout`, called by the trainer after ``init_distributed``.

Sections (every field is documented in ``docs/training.md``): ``model`` (:class:`~packsft.model.config.ModelConfig`),
``data``, ``loader`` (:class:`~packsft.data.loader.DataLoaderConfig`), ``loss``, ``optimizer``, ``scheduler``,
``parallel``, ``train``, ``checkpoint``, ``logging``, ``validation``, ``lora``
(:class:`~packsft.model.lora.LoraConfig`).
"""

from __future__ import annotations

import math
import os
import sys
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path

import yaml
from omegaconf import MISSING, DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from packsft.data.loader import DataLoaderConfig
from packsft.io import missing_file, read_json_object
from packsft.layout import cp_granularity, row_granularity
from packsft.model.config import (
    MODEL_CONFIG_FILE,
    ModelConfig,
    check_field_names,
    config_from_dict,
    yaml_model_section,
)
from packsft.model.lora import LoraConfig

DECAY_STYLES = ("cosine", "linear", "constant")
VERIFY_HASH = ("auto", "full")
INIT_FROM_FREE_MODEL_KEYS = ("max_position_embeddings", "init_method_std", "recompute_granularity",
                             "recompute_method", "recompute_num_layers", "recompute_modules", "bias_activation_fusion")
"""``model`` keys that may differ from an ``init_from`` checkpoint's ``model_config.json`` (they shape no weight),
and from a checkpoint resumed or exported."""
INIT_ONLY_FREE_MODEL_KEYS = ("params_dtype",)
"""``model`` keys that may also differ from ``init_from``'s (a base imported in bf16 trains in fp32: the weights are
cast on load), but not on resume, whose optimizer state is that of the recorded dtype."""
AUTOCAST_DTYPES = ("bfloat16", "float16")
OPTIMIZER_BACKENDS = ("torch", "megatron")
RENAMED_KEYS = {
    "loader.dataloader_num_workers": "loader.num_workers",
    "loader.dataloader_persistent_workers": "loader.persistent_workers",
    "data.override_pad_token": "data.pad_token",
}
"""Old dotted keys still accepted (with a ``FutureWarning``) under their new names."""


def _positive(section: str, obj, *names: str, allow_zero: bool = False) -> None:
    """Raise ``ValueError`` naming ``section.name`` for each field that is not a finite number > 0 (or >= 0).

    ``None`` and OmegaConf's ``MISSING`` (a schema default still to be filled by the YAML) are skipped.
    """
    for name in names:
        value = getattr(obj, name)
        if value is None or value == MISSING:
            continue
        if isinstance(value, float) and not math.isfinite(value):  # NaN passes every comparison below
            raise ValueError(f"{section}.{name} must be a finite number, got {value!r}")
        if (value < 0) if allow_zero else (value <= 0):
            bound = ">= 0" if allow_zero else "> 0"
            raise ValueError(f"{section}.{name} must be {bound}, got {value!r}")


@dataclass
class TrainSourceConfig:
    """One packed training file of ``data.train`` (a mixture when there are several)."""

    path: str = MISSING
    """The ``.jsonl.packed`` file (with its sidecar)."""
    name: str | None = None
    """Name in logs, checkpoints and errors; default: the file name without ``.jsonl.packed``."""
    weight: float = 1.0
    """Share of the training rows drawn from this source, normalised over the sources (``[7, 3]`` is ``[0.7, 0.3]``)."""
    split_validation_size: float = 0.0
    """Fraction in [0, 1) of this source's rows held out as the validation set ``<name>`` (seeded by
    ``loader.seed``)."""


@dataclass
class ValidationSourceConfig:
    """One named validation file of ``data.validation``."""

    path: str = MISSING
    name: str | None = None
    """Logged as ``val_loss/<name>``; default: the file name without ``.jsonl.packed``."""


def _source_name(name: str | None, path: str) -> str:
    return name or Path(path).name.removesuffix(".packed").removesuffix(".jsonl")


@dataclass
class DataConfig:
    """Packed input files and how to tokenize them (must match the packer's settings, checked via the sidecar)."""

    train: list[TrainSourceConfig] = field(default_factory=list)
    """Training sources ``[{name, path, weight, split_validation_size}]``; several make a weighted mixture."""
    train_path: str | None = None
    """A single training file: the same as ``train: [{path: ...}]``."""
    tokenizer: str = MISSING
    """Local tokenizer folder or ``tokenizer.json`` (the one the file was packed with)."""
    max_seq_len: int = MISSING
    """Tokens per packed row ``L``; a multiple of ``2 * parallel.context_parallel_size`` when CP > 1."""
    prompt_format: str = "chat-template"
    """``chat-template``, ``identity``, ``nemotron-nano-v2``, ``nemotron-h-aligned`` or ``passthrough``."""
    chat_template: str | None = None
    """Jinja string or file for ``chat-template`` (default: the tokenizer's)."""
    pad_token: str | None = None
    """Pad token override, as given to the packer."""
    require_sidecar: bool = False
    """Refuse a packed file without ``<file>.meta.json`` instead of warning."""
    verify_hash: str = "auto"
    """How the packed files (rows, token cache) are checked against their sidecar at start: ``auto`` hashes a file
    of at most 256 MiB whole and checks a larger one only by size (a token cache file also by the BLAKE2b of its
    first and last MiB); ``full`` hashes every file whole (about 1 GB/s)."""
    validation: list[ValidationSourceConfig] = field(default_factory=list)
    """Named validation files ``[{name, path}]``, each evaluated and logged on its own."""
    validation_path: str | None = None
    """A single validation file: the same as ``validation: [{name: validation, path: ...}]``."""
    split_validation_size: float = 0.0
    """With ``train_path``: fraction in [0, 1) of its rows held out for validation (seeded by ``loader.seed``)."""
    samples_per_epoch: int | None = None
    """Rows per epoch of a mixture (default: all rows of all sources); each source gets its weight's share."""

    def __post_init__(self) -> None:
        """Raise ``ValueError`` naming the field for invalid values."""
        _positive("data", self, "max_seq_len", "samples_per_epoch")
        if self.verify_hash not in VERIFY_HASH:
            raise ValueError(f"data.verify_hash must be one of {VERIFY_HASH}, got {self.verify_hash!r}")
        if self.samples_per_epoch is not None and (self.train_path or len(self.train) == 1):  # it was ignored
            raise ValueError(f"data.samples_per_epoch ({self.samples_per_epoch}) sets the epoch of a mixture of "
                             "several data.train sources; with one source an epoch is all its rows")
        if not 0.0 <= self.split_validation_size < 1.0:
            raise ValueError(f"data.split_validation_size must be in [0, 1), got {self.split_validation_size!r}")
        if self.validation_path and self.split_validation_size > 0:
            raise ValueError("set either data.validation_path or data.split_validation_size, not both "
                             f"(got {self.validation_path!r} and {self.split_validation_size})")
        if self.train and self.train_path:
            raise ValueError("set either data.train (a list of {name, path, weight}) or data.train_path, not both")
        if self.train and self.split_validation_size > 0:
            raise ValueError("data.split_validation_size goes with data.train_path; with data.train give each "
                             "source its own split_validation_size")
        if self.validation and self.validation_path:
            raise ValueError("set either data.validation (a list of {name, path}) or data.validation_path, not both")
        for i, source in enumerate(self.train):
            if not source.weight > 0:
                raise ValueError(f"data.train[{i}].weight must be > 0, got {source.weight!r}")
            if not 0.0 <= source.split_validation_size < 1.0:
                raise ValueError(f"data.train[{i}].split_validation_size must be in [0, 1), got "
                                 f"{source.split_validation_size!r}")
        for kind, names in (("data.train", [n for n, *_ in self.train_sources()]),   # not validation_sources(),
                            ("data.validation", [_source_name(v.name, v.path) for v in self.validation])):  # a dict
            dupes = sorted({n for n in names if names.count(n) > 1})
            if dupes:
                raise ValueError(f"{kind}: names must be unique, {dupes} appear twice (set name: per entry)")

    def train_sources(self) -> list[tuple[str, str, float, float]]:
        """``(name, path, weight, split_validation_size)`` of every training source."""
        if self.train_path:
            return [(_source_name(None, self.train_path), self.train_path, 1.0, self.split_validation_size)]
        return [(_source_name(s.name, s.path), s.path, float(s.weight), s.split_validation_size) for s in self.train]

    def validation_sources(self) -> dict[str, str]:
        """``{name: path}`` of the validation files."""
        if self.validation_path:
            return {"validation": self.validation_path}
        return {_source_name(v.name, v.path): v.path for v in self.validation}

    @property
    def has_validation(self) -> bool:
        """True when a validation file or a held-out split is configured."""
        return bool(self.validation_sources()) or any(split > 0 for *_, split in self.train_sources())

@dataclass
class LossConfig:
    """Token cross-entropy, normalised by the trained tokens of the whole global batch (``docs/loss.md``)."""

    fused_linear_cross_entropy: bool = True
    """True: packsft's chunked fused linear-CE (never holds ``[t, v]`` logits); False: Megatron's stock
    ``vocab_parallel_cross_entropy`` on full logits."""
    chunk_size: int = 1024
    """Tokens per chunk of the fused loss; with vocabulary blocks of ``b = min(32768, vocab / tp)`` rows, its
    buffers are about ``chunk_size * b * (4 + 2e)`` bytes (``e`` = 2 for bf16 inputs, 0 for fp32; ``docs/loss.md``)."""

    def __post_init__(self) -> None:
        """Raise ``ValueError`` for a non-positive ``chunk_size``."""
        _positive("loss", self, "chunk_size")


@dataclass
class OptimizerConfig:
    """AdamW with two parameter groups (decay / no decay) and global-norm clipping, from torch or Megatron-Core."""

    backend: str = "torch"
    """``torch``: ``torch.optim.AdamW`` replicated on every rank, torch ``DistributedDataParallel``. ``megatron``:
    Megatron-Core's ``DistributedDataParallel`` + ``get_megatron_optimizer`` (needed for
    ``use_distributed_optimizer`` and ``train.bf16``)."""
    use_distributed_optimizer: bool = False
    """Megatron's distributed optimizer (ZeRO-1): fp32 master weights and Adam moments sharded over the
    data-parallel(-with-context-parallel) group; needs ``backend: megatron``."""
    lr: float = 3e-4
    """Peak learning rate (reached at the end of warmup)."""
    weight_decay: float = 0.1
    """Decoupled weight decay of matrices; 1-D parameters (norm weights, biases) get 0."""
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    adam_eps: float = 1e-8
    clip_grad: float = 1.0
    """Clip the global gradient L2 norm (TP-aware) to this value; 0 disables clipping (the norm is still logged)."""

    def __post_init__(self) -> None:
        """Raise ``ValueError`` naming the field for invalid values."""
        if self.backend not in OPTIMIZER_BACKENDS:
            raise ValueError(f"optimizer.backend must be one of {OPTIMIZER_BACKENDS}, got {self.backend!r}")
        if self.use_distributed_optimizer and self.backend != "megatron":
            raise ValueError("optimizer.use_distributed_optimizer=true needs optimizer.backend=megatron, "
                             f"got {self.backend!r}")
        _positive("optimizer", self, "lr", "adam_eps")
        _positive("optimizer", self, "weight_decay", "clip_grad", allow_zero=True)
        for name in ("adam_beta1", "adam_beta2"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ValueError(f"optimizer.{name} must be in [0, 1), got {getattr(self, name)!r}")


@dataclass
class SchedulerConfig:
    """Learning rate per optimizer step: linear warmup from 0, then decay to ``min_lr``."""

    warmup_steps: int = 0
    """Steps of linear warmup (lr = lr * (step + 1) / warmup_steps)."""
    decay_style: str = "cosine"
    """``cosine``, ``linear`` or ``constant``."""
    decay_steps: int | None = None
    """Steps of decay after warmup; default ``train.train_steps - warmup_steps``. After it lr stays ``min_lr``."""
    min_lr: float = 0.0
    """Final learning rate."""

    def __post_init__(self) -> None:
        """Raise ``ValueError`` naming the field for invalid values."""
        _positive("scheduler", self, "warmup_steps", "min_lr", allow_zero=True)
        _positive("scheduler", self, "decay_steps")
        if self.decay_style not in DECAY_STYLES:
            raise ValueError(f"scheduler.decay_style must be one of {DECAY_STYLES}, got {self.decay_style!r}")


@dataclass
class ParallelConfig:
    """Parallel layout; the data-parallel size is ``WORLD_SIZE / (tensor * context * pipeline)``."""

    tensor_model_parallel_size: int = 1
    context_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    """Pipeline stages ``P``: the layers are split over ``P`` ranks and each step runs Megatron-Core's 1F1B schedule
    (``get_forward_backward_func``) over the micro-batches; needs ``optimizer.backend: megatron`` and
    ``model.num_layers`` a multiple of ``P`` (times the virtual stages)."""
    virtual_pipeline_model_parallel_size: int | None = None
    """Model chunks per pipeline rank (Megatron's interleaved 1F1B schedule); null: not interleaved. Needs ``P > 1``
    and micro-batches per step a multiple of ``P``."""
    sequence_parallel: bool = False
    """Megatron's sequence parallelism (norms and residual stream split over the TP group); needs TP > 1 and
    ``data.max_seq_len`` a multiple of ``lcm(2 * cp, cp * tp)`` (pack with ``--tensor-model-parallel-size TP
    --sequence-parallel``). Ignored with a warning at TP = 1, as Megatron-LM does."""
    backend: str | None = None
    """``nccl`` or ``gloo``; default NCCL with CUDA, gloo on CPU."""

    @property
    def sequence_parallel_size(self) -> int:
        """The TP size when sequence parallelism is on, else 1."""
        return self.tensor_model_parallel_size if self.sequence_parallel else 1

    def __post_init__(self) -> None:
        """Raise ``ValueError`` naming the field for invalid values."""
        _positive("parallel", self, "tensor_model_parallel_size", "context_parallel_size",
                  "pipeline_model_parallel_size", "virtual_pipeline_model_parallel_size")
        if self.virtual_pipeline_model_parallel_size is not None and self.pipeline_model_parallel_size == 1:
            raise ValueError("parallel.virtual_pipeline_model_parallel_size needs pipeline_model_parallel_size > 1, "
                             f"got {self.virtual_pipeline_model_parallel_size} with 1")
        if self.backend not in (None, "nccl", "gloo"):
            raise ValueError(f"parallel.backend must be 'nccl', 'gloo' or null, got {self.backend!r}")


@dataclass
class TrainConfig:
    """The step loop: batch size, length, seed, precision."""

    global_batch_size: int = 8
    """Packed rows per optimizer step over all data-parallel ranks (= micro-batches x data-parallel size)."""
    train_steps: int = MISSING
    """Optimizer steps of the whole run (defines the LR schedule)."""
    stop_at_step: int | None = None
    """Stop (after checkpointing) once this step is done, before ``train_steps``; the schedule is unchanged.
    For time-limited jobs: resume later with ``checkpoint.resume=auto``."""
    seed: int = 1234
    """Seeds weight init (``torch.manual_seed``) and ``random``, plus 100 x the pipeline rank (as Megatron-LM); the
    data order uses ``loader.seed``."""
    autocast_dtype: str | None = None
    """``bfloat16``/``float16``: ``torch.autocast`` on CUDA with fp32 master weights; null = no autocast (fp32).
    CPU autocast is refused (Megatron's backward fails in ``LinearWithGradAccumulationAndAsyncCommunication``)."""
    bf16: bool = False
    """Megatron mixed precision: bf16 parameters and activations (``Float16Module``), fp32 gradient accumulation
    and reduction (``main_grad``), fp32 master weights in the optimizer. Needs ``optimizer.backend: megatron``;
    exclusive with ``autocast_dtype``. Runs on CPU too."""
    compile: bool = False
    """``torch.compile`` each transformer layer (``packsft.model.compile``; the core attention stays eager). The first
    steps pay the compile time (about a minute per distinct layer graph); off by default."""

    max_skipped_steps: int = 10
    """Steps in a row whose loss or gradient norm is not finite that are skipped (no update, counted in
    ``skipped_steps``) before the run stops with an error; 0 stops at the first."""
    save_on_sigterm: bool = True
    """On SIGTERM (what Slurm and torchrun send before killing) or SIGINT (Ctrl-C) finish the current step, write a
    checkpoint and exit 0; false leaves the signals' defaults (the process ends at once, no checkpoint)."""

    def __post_init__(self) -> None:
        """Raise ``ValueError`` naming the field for invalid values."""
        _positive("train", self, "global_batch_size", "train_steps", "stop_at_step")
        _positive("train", self, "max_skipped_steps", allow_zero=True)
        if not isinstance(self.compile, bool):
            raise ValueError(f"train.compile must be true or false, got {self.compile!r}")
        if not 0 <= self.seed < 2**63:  # torch.manual_seed overflows past 64 bits; negative seeds as loader.seed
            raise ValueError(f"train.seed must be in [0, 2**63), got {self.seed}")
        if self.autocast_dtype not in (None, *AUTOCAST_DTYPES):
            raise ValueError(f"train.autocast_dtype must be null or one of {AUTOCAST_DTYPES}, "
                             f"got {self.autocast_dtype!r}")


@dataclass
class CheckpointConfig:
    """Megatron ``dist_checkpointing`` checkpoints (layout in ``packsft.train.checkpoint``)."""

    dir: str | None = None
    """Checkpoint folder; default ``<logging.output_dir>/checkpoints``."""
    save_interval: int = 0
    """Save every N steps; 0 = only at the end."""
    save_at_end: bool = True
    """Save after step ``train_steps``. A stop at ``train.stop_at_step`` always saves (it exists to resume later,
    as Megatron-LM's ``--exit-interval`` saves)."""
    resume: str = "auto"
    """``auto`` (the ``latest`` checkpoint in ``dir`` if any), ``none``, or a path to an ``iter_XXXXXXX`` folder."""
    restore_data_order: bool = True
    """Restore the loader's sampler position (needs the same data-parallel size and data); false restarts the
    data order from its first rows, those already trained included (a ``note:`` says so; use it to resume with
    another data-parallel size or context-parallel file)."""
    init_from: str | None = None
    """Model-only checkpoint folder (``tools/convert_checkpoint.py import --out``) whose weights start the run when
    there is nothing to resume (a checkpoint found by ``resume`` wins); optimizer, schedule and data order start
    fresh. Its ``model_config.json`` fills the ``model`` section; ``model`` keys set in the YAML or overrides must
    agree with it, except those in ``INIT_FROM_FREE_MODEL_KEYS`` and ``INIT_ONLY_FREE_MODEL_KEYS``."""
    keep_last: int = 0
    """Keep only the N newest complete checkpoints (by step; never the one ``latest`` names); 0 keeps all."""

    def __post_init__(self) -> None:
        """Raise ``ValueError`` for a negative ``save_interval`` or ``keep_last``."""
        _positive("checkpoint", self, "save_interval", "keep_last", allow_zero=True)


@dataclass
class LoggingConfig:
    """Outputs of the run: progress bar, ``metrics.jsonl``, TensorBoard events."""

    output_dir: str = "out/train"
    """Run folder: ``metrics.jsonl``, ``tensorboard/``, ``config.yaml``, ``checkpoints/`` (by default)."""
    log_interval: int = 1
    """Write a metrics record every N steps."""
    tensorboard: bool = True
    progress: bool = True
    """tqdm progress bar on rank 0."""

    def __post_init__(self) -> None:
        """Raise ``ValueError`` for a non-positive ``log_interval``."""
        _positive("logging", self, "log_interval")


@dataclass
class ValidationConfig:
    """Validation passes over ``data.validation_path`` or the ``data.split_validation_size`` held-out rows."""

    val_period: int = 0
    """Validate every N steps; 0 = never periodically."""
    val_at_start: bool = False
    val_at_end: bool = False
    max_batches: int | None = None
    """Micro-batches per data-parallel rank and pass; null = the whole validation set."""

    def __post_init__(self) -> None:
        """Raise ``ValueError`` naming the field for invalid values."""
        _positive("validation", self, "val_period", allow_zero=True)
        _positive("validation", self, "max_batches")

    @property
    def enabled(self) -> bool:
        """True when any validation pass is requested."""
        return self.val_period > 0 or self.val_at_start or self.val_at_end


@dataclass
class Config:
    """The whole training configuration (see the module docstring)."""

    model: ModelConfig = MISSING
    data: DataConfig = field(default_factory=DataConfig)
    loader: DataLoaderConfig = field(default_factory=DataLoaderConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    validation: ValidationConfig = field(default_factory=ValidationConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)

    def __post_init__(self) -> None:
        """Cross-section checks.

        Raises:
            ValueError: naming both dotted keys and values: ``data.max_seq_len`` not a multiple of
                ``2 * context_parallel_size``, ``max_seq_len`` above ``model.max_position_embeddings``, warmup
                longer than the run, validation without data, ``stop_at_step`` past ``train_steps``,
                ``scheduler.min_lr`` above ``optimizer.lr``.
        """
        cp, seq = self.parallel.context_parallel_size, self.data.max_seq_len
        if cp > 1 and seq % (2 * cp):
            raise ValueError(f"data.max_seq_len ({seq}) must be a multiple of 2 * parallel.context_parallel_size "
                             f"({2 * cp})")
        if self.parallel.sequence_parallel and self.parallel.tensor_model_parallel_size == 1:
            warnings.warn("parallel.sequence_parallel needs tensor_model_parallel_size > 1; it is ignored",
                          UserWarning, stacklevel=2)
            self.parallel.sequence_parallel = False
        granularity = row_granularity(cp, self.parallel.sequence_parallel_size)
        if seq % granularity:
            raise ValueError(f"data.max_seq_len ({seq}) must be a multiple of {granularity} with "
                             f"parallel.sequence_parallel: lcm(CP padding, CP x TP) = lcm({cp_granularity(cp)}, "
                             f"{cp} x {self.parallel.tensor_model_parallel_size}), the CP padding being 2 x CP when CP "
                             "> 1, else 1")
        if seq > self.model.max_position_embeddings:
            raise ValueError(f"data.max_seq_len ({seq}) must be <= model.max_position_embeddings "
                             f"({self.model.max_position_embeddings})")
        if self.scheduler.min_lr > self.optimizer.lr:
            raise ValueError(f"scheduler.min_lr ({self.scheduler.min_lr}) must be <= optimizer.lr "
                             f"({self.optimizer.lr}): the decay would raise the learning rate")
        if self.scheduler.warmup_steps > self.train.train_steps:
            raise ValueError(f"scheduler.warmup_steps ({self.scheduler.warmup_steps}) must be <= "
                             f"train.train_steps ({self.train.train_steps})")
        if self.train.bf16 and self.optimizer.backend != "megatron":
            raise ValueError(f"train.bf16=true needs optimizer.backend=megatron (fp32 master weights in Megatron's "
                             f"optimizer), got {self.optimizer.backend!r}")
        if self.train.bf16 and self.train.autocast_dtype is not None:
            raise ValueError(f"set either train.bf16 or train.autocast_dtype ({self.train.autocast_dtype!r}), not both")
        if self.train.stop_at_step is not None and self.train.stop_at_step > self.train.train_steps:
            raise ValueError(f"train.stop_at_step ({self.train.stop_at_step}) must be <= train.train_steps "
                             f"({self.train.train_steps})")
        pp, vp = self.parallel.pipeline_model_parallel_size, self.parallel.virtual_pipeline_model_parallel_size
        if pp > 1 and self.optimizer.backend != "megatron":
            raise ValueError(f"parallel.pipeline_model_parallel_size={pp} needs optimizer.backend=megatron (Megatron "
                             "DDP reduces the tied embedding over the first and last stage), got "
                             f"{self.optimizer.backend!r}")
        if self.model.num_layers % (pp * (vp or 1)):
            raise ValueError(f"model.num_layers ({self.model.num_layers}) must be a multiple of "
                             f"parallel.pipeline_model_parallel_size ({pp})"
                             + (f" x parallel.virtual_pipeline_model_parallel_size ({vp})" if vp else ""))
        if self.lora.enabled and self.model.attention_backend != "torch":
            raise ValueError(f"lora.enabled=true needs model.attention_backend=torch (Megatron's parallel linears), "
                             f"got {self.model.attention_backend!r}")
        if not self.data.train and not self.data.train_path:
            raise ValueError("data.train_path (one file) or data.train (a list of {name, path, weight}) is required")
        if self.validation.enabled and not self.data.has_validation:
            raise ValueError("validation is enabled (validation.val_period / val_at_start / val_at_end) but there is "
                             "no validation data: set data.validation, data.validation_path or a split_validation_size")

    @property
    def checkpoint_dir(self) -> Path:
        """``checkpoint.dir``, or ``<logging.output_dir>/checkpoints``."""
        return Path(self.checkpoint.dir) if self.checkpoint.dir else Path(self.logging.output_dir) / "checkpoints"


def load_config(path: str | Path | None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Build a :class:`Config` from a YAML file and dotted overrides (``section.key=value``).

    Args:
        path: YAML file, or None for schema defaults plus overrides only.
        overrides: e.g. ``["optimizer.lr=1e-3", "parallel.context_parallel_size=2"]``; applied after the file.

    Returns:
        The validated :class:`Config` (plain dataclasses, not OmegaConf nodes).

    With ``checkpoint.init_from`` set, the checkpoint's ``model_config.json`` is merged under the YAML as the
    ``model`` section (so a YAML may omit ``model``), then :func:`check_init_model` compares the result with it.
    When that folder is gone but ``checkpoint.resume`` finds a checkpoint (whose weights a resume loads instead),
    the ``model`` section that checkpoint records takes its place, with a ``note:`` on stderr.

    Raises:
        FileNotFoundError: ``path`` does not exist, or ``checkpoint.init_from`` has no ``model_config.json`` and
            there is no checkpoint to resume.
        ValueError: an unknown key, a value of the wrong type, a missing required value (``???``) or any validation
            failure; the message names the file and the dotted key.
    """
    where = (str(path) if path else "") + (f" with overrides {list(overrides)}" if overrides else "")
    where = where.strip() or "<defaults>"
    if path is not None and not Path(path).is_file():
        raise missing_file("config file", path)
    try:
        loose = [o for o in overrides if "=" not in o]
        if loose:
            raise ValueError(f"override {loose[0]!r} is not key=value (e.g. train.train_steps=100)")
        loaded = OmegaConf.load(path) if path else OmegaConf.create()
        if not isinstance(loaded, DictConfig):
            raise ValueError("the file must be a mapping of sections (model:, data:, train:, ...), not a list")
        layers = [_rename_old_keys(loaded, str(path)),
                  _rename_old_keys(OmegaConf.from_dotlist(list(overrides)), "the overrides")]
        merged = OmegaConf.merge(OmegaConf.structured(Config), *layers)
        imported, source = _init_model_fields(merged)
        if imported is not None:
            merged = OmegaConf.merge(OmegaConf.structured(Config), {"model": imported}, *layers)
        cfg = OmegaConf.to_object(merged)
        if imported is not None:
            check_init_model(cfg, imported, source)
            check_init_window(cfg, merged.checkpoint.init_from)
        return cfg
    except OmegaConfBaseException as err:
        raise _config_error(err, f"invalid config {where}") from err
    except ValueError as err:
        raise ValueError(f"invalid config {where}: {err}") from err
    except TypeError as err:  # OmegaConf.merge: a mapping where the schema has a list (data.train, data.validation)
        raise ValueError(f"invalid config {where}: {err} (a mapping where a list is expected: data.train and "
                         "data.validation are lists of entries, data.train=[{path: ..., weight: ...}, {...}]; an "
                         "override cannot set one item of a list, as data.train.1.weight=0 tries)") from err
    except yaml.YAMLError as err:  # the file is not YAML (its own message spans lines: one is kept)
        raise ValueError(f"invalid config {where}: not valid YAML: {' '.join(str(err).split())}") from err


def _config_error(err: OmegaConfBaseException, where: str) -> ValueError:
    """OmegaConf's error (its message, then lines of full_key and types) as one line: ``where``, the key, the first
    line."""
    key = getattr(err, "full_key", None)
    first = str(err).splitlines()[0] if str(err) else type(err).__name__
    return ValueError(f"{where}: {f'{key}: ' if key else ''}{first}")


def _rename_old_keys(layer, where: str):
    """Move every :data:`RENAMED_KEYS` old key of one config layer to its new name, warning once per key.

    Raises:
        ValueError: both the old and the new name are set in the same layer.
    """
    for old, new in RENAMED_KEYS.items():
        value = OmegaConf.select(layer, old, default=MISSING)
        if value == MISSING:
            continue
        if OmegaConf.select(layer, new, default=MISSING) != MISSING:
            raise ValueError(f"{where} sets both {old} (the old name) and {new}; keep only {new}")
        section, key = old.split(".")
        del layer[section][key]
        OmegaConf.update(layer, new, value)
        warnings.warn(f"{where}: {old} is renamed {new}; the old name will be removed", FutureWarning, stacklevel=3)
    return layer


def _init_model_fields(merged) -> tuple[dict | None, str | None]:
    """The ``model`` fields ``checkpoint.init_from`` supplies (``merged``: the OmegaConf config) and, when not its
    ``model_config.json``, where they come from; ``(None, None)`` without ``init_from``. When that file is gone and
    a checkpoint will be resumed: the ``model`` section that checkpoint records (the run no longer reads
    ``init_from``'s weights; a LoRA resume still needs them and says so)."""
    from packsft.train.checkpoint_files import find_resume_checkpoint, load_train_state

    init_from = merged.checkpoint.init_from
    if not init_from or (Path(init_from) / MODEL_CONFIG_FILE).is_file():
        return (read_init_model_fields(init_from) if init_from else None), None
    ckpt_dir = merged.checkpoint.dir or Path(merged.logging.output_dir) / "checkpoints"   # as Config.checkpoint_dir
    path = find_resume_checkpoint(ckpt_dir, merged.checkpoint.resume)
    if path is None:
        read_init_model_fields(init_from)      # raises, naming the missing file
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"note: checkpoint.init_from={str(init_from)!r} has no {MODEL_CONFIG_FILE}; the run resumes {path}, "
              "whose recorded model section is used", file=sys.stderr)
    return recorded_architecture(load_train_state(path), path)["model"], f"the model section checkpoint {path} records"


def read_init_model_fields(init_from: str | Path) -> dict:
    """The ``ModelConfig`` fields (a dict) of a checkpoint written by ``tools/convert_checkpoint.py import``.

    Raises:
        FileNotFoundError: ``<init_from>/model_config.json`` does not exist (not an imported checkpoint folder).
    """
    file = Path(init_from) / MODEL_CONFIG_FILE
    if not file.is_file():
        raise FileNotFoundError(f"checkpoint.init_from={str(init_from)!r}: {file} not found; point it at a folder "
                                "written by `tools/convert_checkpoint.py import --out DIR`")
    return read_json_object(file)


def _first_difference(current: dict, reference: dict, free: tuple[str, ...] = ()) -> str | None:
    """The first key of ``reference`` (not in ``free``) whose value ``current`` does not share, or None.

    Floats agree within a relative 1e-6 (an imported GGUF's ``norm_epsilon`` 1e-5 reads back as float32).
    """
    for key, value in reference.items():
        if key in free:
            continue
        if isinstance(value, float) and isinstance(current.get(key), float):
            same = math.isclose(current[key], value, rel_tol=1e-6)
        else:
            same = current.get(key) == value
        if not same:
            return key
    return None


def check_init_window(cfg: Config, init_from: str | Path) -> None:
    """Refuse a ``data.max_seq_len`` longer than the sliding window of the imported model (a Mistral, or a
    Qwen2/Qwen3 with windowed layers, whose ``sliding_window`` is below its ``max_position_embeddings``, read from
    ``<init_from>/hf_config.json``):
    packsft's full causal attention equals the model's only up to the window, whatever
    ``model.max_position_embeddings`` the config sets.

    Raises:
        ValueError: naming both lengths and the file.
    """
    from packsft.model.hf_config import full_attention_length

    file = Path(init_from) / "hf_config.json"       # written by tools/convert_checkpoint.py import
    if not file.is_file():
        return
    window = full_attention_length(read_json_object(file))
    if window is not None and cfg.data.max_seq_len > window:
        raise ValueError(f"data.max_seq_len ({cfg.data.max_seq_len}) is longer than the sliding_window ({window}) of "
                         f"the model checkpoint.init_from holds ({file}): packsft's full causal attention equals "
                         f"that model's only up to the window; set data.max_seq_len <= {window}")


def check_init_model(cfg: Config, imported: dict, source: str | None = None) -> None:
    """Refuse a ``model`` section that contradicts the ``checkpoint.init_from`` weights.

    ``source`` names where ``imported`` comes from (default: ``checkpoint.init_from``'s ``model_config.json``).

    Raises:
        ValueError: a ``model`` field (other than ``INIT_FROM_FREE_MODEL_KEYS`` and ``INIT_ONLY_FREE_MODEL_KEYS``)
            differs from ``imported``; the message names the field and both values.
    """
    check_model_fields(cfg.model, imported, source or f"checkpoint.init_from's {MODEL_CONFIG_FILE}")


def check_model_fields(model: ModelConfig, imported: dict, source: str) -> None:
    """Refuse a ``model`` section that differs from a checkpoint's ``ModelConfig`` fields ``imported`` (read from
    ``source``, named in the message) in a key other than ``INIT_FROM_FREE_MODEL_KEYS`` and
    ``INIT_ONLY_FREE_MODEL_KEYS``.

    Raises:
        ValueError: naming the field and both values.
    """
    current = asdict(model)
    key = _first_difference(current, imported, INIT_FROM_FREE_MODEL_KEYS + INIT_ONLY_FREE_MODEL_KEYS)
    if key is not None:
        raise ValueError(f"model.{key} ({current.get(key)!r}) differs from {source} ({imported[key]!r}): the "
                         f"weights have the latter; drop model.{key} from the config or set it to match")


def read_yaml_model(path: str | Path, base: dict | None, source: str | None = None, *,
                    check: bool = True) -> ModelConfig:
    """The ``ModelConfig`` of a training YAML's ``model:`` section merged over ``base`` (a checkpoint's
    ``ModelConfig`` fields, read from ``source``), as :func:`load_config` merges ``checkpoint.init_from``'s
    ``model_config.json`` under it: a partial section, or none, takes the rest from ``base``, and (``check``) a key
    that differs from ``base`` is refused (:func:`check_model_fields`). Without ``base``, the YAML's own
    ``checkpoint.init_from`` supplies it (:func:`read_init_model_fields`) when set.

    Raises:
        ValueError: naming the file: unknown fields, required fields with nothing to take them from, an invalid
            value, or (``check``) a key that differs from ``base``.
        FileNotFoundError: the YAML's ``checkpoint.init_from`` (read without ``base``) has no ``model_config.json``.
    """
    section = yaml_model_section(path)
    section = {} if section is None else section
    if base is None:
        checkpoint = (yaml.safe_load(Path(path).read_text()) or {}).get("checkpoint")
        init_from = checkpoint.get("init_from") if isinstance(checkpoint, dict) else None
        if init_from:
            base, source = read_init_model_fields(init_from), str(Path(init_from) / MODEL_CONFIG_FILE)
    if base is None:
        return config_from_dict(ModelConfig, section, str(path), missing_hint=(
            ": a partial model section takes the rest from a checkpoint model config (model_config.json, "
            "train_state.json) or checkpoint.init_from, and there is none here; give every field"))
    check_field_names(ModelConfig, section, str(path))
    try:
        model = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ModelConfig), base, section))
    except OmegaConfBaseException as err:
        raise _config_error(err, f"{path} model section over {source}") from None
    except ValueError as err:
        raise ValueError(f"{path} model section over {source}: {err}") from None
    if check:
        check_model_fields(model, base, source or "the checkpoint's model config")
    return model


RESUME_FREE_LORA_KEYS = ("dropout", "seed")
"""``lora`` keys that may change when a checkpoint is resumed or exported (they shape no weight and no output)."""


def recorded_architecture(train_state: dict, checkpoint: str | Path) -> dict[str, dict]:
    """The ``model``, ``lora``, ``optimizer`` and ``train`` sections of the config a checkpoint was trained with
    (its ``train_state.json``).

    Returns:
        ``{"model": {...}, "lora": {...}, "optimizer": {...}, "train": {...}, "parallel": {...}}`` (``lora``
        empty when the run predates it), plain YAML values.

    Raises:
        CheckpointError: ``train_state.json`` has no ``config`` with a ``model`` section.
    """
    import yaml

    from packsft.train.checkpoint_files import TRAIN_STATE, CheckpointError

    text = train_state.get("config")
    try:
        recorded = yaml.safe_load(text) if isinstance(text, str) else None
    except yaml.YAMLError:
        recorded = None
    if not isinstance(recorded, dict) or not isinstance(recorded.get("model"), dict):
        raise CheckpointError(f"{Path(checkpoint) / TRAIN_STATE} records no config with a model section (its "
                              "'config' is the run's YAML config as a string)")
    return {"model": recorded["model"], "lora": recorded.get("lora") or {},
            "optimizer": recorded.get("optimizer") or {}, "train": recorded.get("train") or {},
            "parallel": recorded.get("parallel") or {}}


RESUME_FIXED_OPTIMIZER_KEYS = ("backend", "use_distributed_optimizer")
"""``optimizer`` keys that set the format of a checkpoint's optimizer state, so a resume must keep them."""


DISTRIBUTED_OPTIMIZER_FIXED_PARALLEL_KEYS = ("tensor_model_parallel_size", "pipeline_model_parallel_size")
"""``parallel`` keys the distributed optimizer's state is sharded by (its ``dp_reshardable`` format: the DP size may
change on resume, these may not)."""


def check_recorded_optimizer(optimizer: OptimizerConfig, recorded: dict[str, dict], checkpoint: str | Path,
                             parallel: ParallelConfig | None = None) -> None:
    """Refuse a resume whose optimizer state format (:data:`RESUME_FIXED_OPTIMIZER_KEYS`) differs from the
    checkpoint's (before: a ``KeyError`` traceback inside Megatron's ``load_state_dict``, or a silent conversion),
    or, with the distributed optimizer, whose :data:`DISTRIBUTED_OPTIMIZER_FIXED_PARALLEL_KEYS` differ (before:
    Megatron's ``Global shape mismatch`` of the optimizer shards).

    Raises:
        CheckpointError: naming the dotted key and both values.
    """
    from packsft.train.checkpoint_files import CheckpointError

    new_run = ("start a new run from its weights (tools/convert_checkpoint.py export, import, then "
               "checkpoint.init_from)")
    for key in RESUME_FIXED_OPTIMIZER_KEYS:
        if key in recorded["optimizer"] and recorded["optimizer"][key] != getattr(optimizer, key):
            was = recorded["optimizer"][key]
            raise CheckpointError(f"optimizer.{key} is {getattr(optimizer, key)!r} but checkpoint {checkpoint} was "
                                  f"trained with {was!r}, and its optimizer state has that format; resume with "
                                  f"optimizer.{key}={str(was).lower() if isinstance(was, bool) else was}, or "
                                  f"{new_run}")
    if parallel is None or not optimizer.use_distributed_optimizer:
        return
    for key in DISTRIBUTED_OPTIMIZER_FIXED_PARALLEL_KEYS:
        was = recorded.get("parallel", {}).get(key, 1)
        if was != getattr(parallel, key):
            raise CheckpointError(f"parallel.{key} is {getattr(parallel, key)} but checkpoint {checkpoint} was "
                                  f"trained with {was}, and the distributed optimizer's state is sharded for it "
                                  f"(only the data-parallel size may change); resume with parallel.{key}={was}, or "
                                  f"{new_run}")


def _lora_fields(lora: dict) -> dict:
    """``lora`` fields as compared: ``target_modules`` as a sorted list (their order changes no weight)."""
    modules = lora.get("target_modules")
    return {**lora, "target_modules": sorted(modules)} if isinstance(modules, list) else lora


def check_recorded_architecture(model: ModelConfig, lora: LoraConfig | None, recorded: dict[str, dict],
                                checkpoint: str | Path, *, fix: str) -> None:
    """Refuse a ``model`` / ``lora`` section that differs from what a checkpoint was trained with.

    ``model`` keys in ``INIT_FROM_FREE_MODEL_KEYS`` (no weight depends on them) and ``lora`` keys in
    ``RESUME_FREE_LORA_KEYS`` may differ (``lora`` keys are compared only when either side has LoRA on, and
    ``target_modules`` as a set); every other key the checkpoint records must agree (a changed
    ``rotary_base`` or ``lora.alpha`` would load cleanly and silently compute another function).

    Args:
        model, lora: the current sections (``lora`` None: LoRA off).
        recorded: :func:`recorded_architecture` of the checkpoint.
        checkpoint: the checkpoint folder, named in the message. fix: how to proceed, appended to the message
            (``{key}`` and ``{value}`` are replaced by the dotted key and the recorded value).

    Raises:
        CheckpointError: naming the first differing dotted key and both values.
    """
    from packsft.train.checkpoint_files import CheckpointError

    current_lora = _lora_fields(asdict(lora)) if lora is not None else {"enabled": False}
    recorded_lora = _lora_fields(recorded["lora"]) if recorded["lora"].get("enabled") else {"enabled": False}
    for section, current, reference, free in (("model", asdict(model), recorded["model"], INIT_FROM_FREE_MODEL_KEYS),
                                              ("lora", current_lora, recorded_lora, RESUME_FREE_LORA_KEYS)):
        key = _first_difference(current, reference, free)
        if key is not None:
            how = fix.format(key=f"{section}.{key}", value=reference[key])
            raise CheckpointError(f"{section}.{key} is {current.get(key)!r} but checkpoint {checkpoint} was trained "
                                  f"with {reference[key]!r}; {how}")


def config_to_yaml(cfg: Config) -> str:
    """The resolved configuration as YAML (written to ``<output_dir>/config.yaml`` and into checkpoints)."""
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


def check_parallel_layout(cfg: Config, world_size: int) -> int:
    """Check the configuration against the job's world size and return the data-parallel size.

    ``world_size = TP x CP x PP x DP``.

    Raises:
        ValueError: ``world_size`` not a multiple of ``tp * cp * pp``, ``train.global_batch_size`` not a multiple
            of ``loader.micro_batch_size * data_parallel_size``, or (interleaved pipeline) micro-batches per step
            not a multiple of ``pp``; the message names the keys and values.
    """
    par = cfg.parallel
    tp, cp, pp = par.tensor_model_parallel_size, par.context_parallel_size, par.pipeline_model_parallel_size
    if world_size % (tp * cp * pp):
        raise ValueError(f"WORLD_SIZE ({world_size}) must be a multiple of parallel.tensor_model_parallel_size "
                         f"({tp}) * parallel.context_parallel_size ({cp}) * "
                         f"parallel.pipeline_model_parallel_size ({pp}) (world = TP x CP x PP x DP)")
    dp = world_size // (tp * cp * pp)
    per_step = cfg.loader.micro_batch_size * dp
    if cfg.train.global_batch_size % per_step:
        raise ValueError(f"train.global_batch_size ({cfg.train.global_batch_size}) must be a multiple of "
                         f"loader.micro_batch_size ({cfg.loader.micro_batch_size}) * data-parallel size ({dp})")
    micro_batches = cfg.train.global_batch_size // per_step
    if par.virtual_pipeline_model_parallel_size is not None and micro_batches % pp:
        raise ValueError(f"the interleaved pipeline schedule (parallel.virtual_pipeline_model_parallel_size="
                         f"{par.virtual_pipeline_model_parallel_size}) needs the micro-batches per step "
                         f"(train.global_batch_size {cfg.train.global_batch_size} / (loader.micro_batch_size "
                         f"{cfg.loader.micro_batch_size} x DP {dp}) = {micro_batches}) to be a multiple of "
                         f"parallel.pipeline_model_parallel_size ({pp})")
    return dp
